"""tests/processes.py: a time limit ends the whole tree a test started, not only its first process."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from tests.processes import run_tree


@pytest.mark.timeout(300)  # without the tree's kill, the grandchildren hold the pipes for 600 s
def test_a_time_limit_kills_the_grandchildren_too_and_keeps_the_output():
    # bash starts grandchildren that would outlive bash (subprocess.run's timeout kills bash only), one
    # of them in its own session (as torchrun starts its workers), out of reach of the group's kill.
    code = ("import os, subprocess, sys, time; "
            "[subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=s) for s in (False, True)]; "
            "print('pid', os.getpid(), flush=True); time.sleep(600)")
    start = time.time()
    with pytest.raises(subprocess.TimeoutExpired) as info:
        # 20 s: the output must be there when the limit fires (3 s was too short at load 17, suite23)
        run_tree(["bash", "-c", f"{sys.executable} -c \"{code}\""], timeout=20)
    assert "pid" in info.value.output
    # the stacks at the limit: bash has none to give, each Python process its own (py-spy, a test dependency)
    if "Permission" not in info.value.stacks:  # (a container without ptrace rights says so in their place)
        assert info.value.stacks.count("<module> (<string>:1)") == 3, info.value.stacks
    assert "-- the output ends:\npid" in str(info.value)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = [
            p for p in psutil.process_iter(["cmdline", "create_time"])
            if p.info["create_time"] >= start - 1 and "time.sleep(600)" in " ".join(p.info["cmdline"] or [])
        ]
        if not left:
            break
        time.sleep(0.1)
    assert not left, left


def test_a_finished_run_returns_its_status_and_output():
    proc = run_tree([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"], 60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "out\n", "err\n")
