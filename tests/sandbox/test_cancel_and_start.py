"""The runner's own ends (#58): a caller's cancel ends a run and its processes, the unconfined
fallback keeps its wall limit, a failure before the program's first line is the sandbox's error,
and inputs the work dir cannot take are refused before anything starts.

Every wait here is bounded: the runs have wall limits of seconds, the cancel timers fire within
one, and the ``no_leftovers`` fixture gives up after 10 s.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.sandbox.conftest import ROOMY_LIMITS, TEST_LIMITS
from tests.sandbox.test_runner import _without_bwrap
from verl.config.schema import SandboxConfig, SandboxLimitsConfig
from verl.sandbox import Sandbox

# A forked child and its parent both sleep: only a kill ends them.
SLEEPERS = "import os, time\nos.fork()\ntime.sleep(30)\n"


def _cancel_after(seconds: float) -> threading.Event:
    event = threading.Event()
    timer = threading.Timer(seconds, event.set)
    timer.daemon = True
    timer.start()
    return event


@pytest.mark.usefixtures("no_leftovers")
def test_cancel_ends_a_running_program_and_its_children(sandbox):
    start = time.monotonic()
    result = sandbox.run(SLEEPERS, limits=ROOMY_LIMITS, cancel=_cancel_after(0.5))
    assert result.reason == "cancelled" and "cancelled" in result.detail, result
    assert time.monotonic() - start < 5.0  # the wall limit is 30 s: the cancel ended it


def test_cancel_while_waiting_for_a_slot_gives_up_the_wait(tmp_path):
    box = Sandbox(SandboxConfig(max_concurrent=1, slots_dir=str(tmp_path)))
    from verl.sandbox import runner

    box._backend = runner._Backend("bwrap", "prlimit")  # the slot logic only: no program runs
    slots = runner._Slots(1, str(tmp_path))
    held = slots.acquire()
    try:
        start = time.monotonic()
        result = box.run("print(1)", cancel=_cancel_after(0.3))
        assert result.reason == "cancelled" and "slot" in result.detail, result
        assert time.monotonic() - start < 3.0
    finally:
        slots.release(held)


@pytest.mark.usefixtures("no_leftovers")
@pytest.mark.parametrize(
    "code",
    ["while True:\n    pass\n", "import time\ntime.sleep(30)\n", SLEEPERS],
    ids=["busy", "sleep", "forked"],
)
def test_the_unconfined_fallback_keeps_its_wall_limit_within_a_second(monkeypatch, tmp_path, code):
    """A 1 s wall limit returned after 6 s: only the program's children were killed (as bwrap's
    are), and the program itself, the group's leader, ran on until the 5 s reap wait ran out."""
    _without_bwrap(monkeypatch)
    limits = SandboxLimitsConfig(**{**TEST_LIMITS.__dict__, "wall_time_s": 1.0, "cpu_time_s": 10.0})
    box = Sandbox(SandboxConfig(allow_unconfined=True, slots_dir=str(tmp_path), limits=limits))
    start = time.monotonic()
    result = box.run(code)
    elapsed = time.monotonic() - start
    assert (result.reason, result.confined) == ("timeout", False), result
    assert elapsed < 2.0, f"a 1 s wall limit returned after {elapsed:.1f} s"


@pytest.mark.usefixtures("no_leftovers")
def test_the_unconfined_fallback_cancels_too(monkeypatch, tmp_path):
    _without_bwrap(monkeypatch)
    box = Sandbox(SandboxConfig(allow_unconfined=True, slots_dir=str(tmp_path), limits=ROOMY_LIMITS))
    result = box.run(SLEEPERS, cancel=_cancel_after(0.5))
    assert (result.reason, result.confined) == ("cancelled", False), result


def test_a_failure_before_the_programs_first_line_is_the_sandboxs(sandbox, monkeypatch):
    """The inputs' copy into the work dir failing (here: made to fail) ends the run before the
    program starts: a sandbox_error naming the cause, not the program's error output."""
    from verl.sandbox import runner

    boot = runner._boot
    monkeypatch.setattr(
        runner, "_boot", lambda fd, copy_inputs: "raise OSError('no room in the work dir')\n" + boot(fd, copy_inputs)
    )
    result = sandbox.run("print(1)", limits=ROOMY_LIMITS)
    assert result.reason == "sandbox_error" and result.exit_code is None, result
    assert "failed to start" in result.detail and "no room in the work dir" in result.detail
    # The program's own failure stays the program's.
    monkeypatch.setattr(runner, "_boot", boot)
    crash = sandbox.run("raise OSError('mine')", limits=ROOMY_LIMITS)
    assert (crash.reason, crash.exit_code) == ("error", 1) and "mine" in crash.stderr


@pytest.mark.parametrize(
    "files, match",
    [
        ({"big.bin": b"x" * (9 << 20)}, "tmp_size_mb"),
        ({"main.py": "print(2)"}, "program's own file"),
        ({"a": "x", "a/b": "y"}, "clashes"),
        ({".": "x"}, "relative path"),
    ],
    ids=["too-big", "main.py", "clash", "dot"],
)
def test_inputs_the_work_dir_cannot_take_are_refused_before_the_run(sandbox, files, match):
    with pytest.raises(ValueError, match=match):
        sandbox.run("print(1)", files=files, limits=ROOMY_LIMITS)  # tmp_size_mb=8
