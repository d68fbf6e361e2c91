"""Fixtures of the sandbox tests: a confined sandbox with small limits, and a check that nothing is left."""

from __future__ import annotations

import os
import time

import psutil
import pytest

from verl.config.schema import SandboxConfig, SandboxLimitsConfig
from verl.sandbox import Sandbox, SandboxUnavailable
from verl.sandbox.runner import MAIN_FILE

# Small limits so each hostile program is stopped within a second or two.
TEST_LIMITS = SandboxLimitsConfig(
    wall_time_s=2.0, cpu_time_s=1.0, memory_mb=256, max_processes=16, output_bytes=64 * 1024, tmp_size_mb=8
)
# The same with a long wall limit, for programs that must end by another limit or by themselves:
# on a loaded machine (the test suite's workers, other jobs) start-up alone can take a second.
ROOMY_LIMITS = SandboxLimitsConfig(**{**TEST_LIMITS.__dict__, "wall_time_s": 30.0})


@pytest.fixture(scope="session")
def sandbox(tmp_path_factory) -> Sandbox:
    box = Sandbox(SandboxConfig(limits=TEST_LIMITS, slots_dir=str(tmp_path_factory.mktemp("slots"))))
    try:
        if not box.confined:
            pytest.skip("bubblewrap cannot confine here")
    except (SandboxUnavailable, ValueError) as exc:  # no bwrap, or no interpreter nobody can read
        pytest.skip(
            f"no confinement on this machine ({exc}); tools/setup_env.sh --test installs bubblewrap as root"
        )
    return box


def _is_sandbox_process(p: psutil.Process) -> bool:
    """bwrap, or a process still running the sandbox's boot code (a fork keeps its parent's command line)."""
    cmdline = p.cmdline()
    return bool(cmdline) and (
        os.path.basename(cmdline[0]) == "bwrap" or any(f"run_path({MAIN_FILE!r}" in a for a in cmdline)
    )


def sandbox_processes(since: float) -> list[psutil.Process]:
    """Live sandbox processes started after ``since`` that belong to this test process: its
    descendants, and orphans (a chain of sandbox processes up to pid 1: nothing else owns them).
    Sandboxes of other processes (parallel test workers) are not counted."""
    me = os.getpid()
    alive = []
    for p in psutil.process_iter():
        try:
            if (
                p.create_time() < since - 1
                or p.status() == psutil.STATUS_ZOMBIE
                or not _is_sandbox_process(p)
            ):
                continue
            ancestor = p.parent()
            while ancestor is not None and ancestor.pid not in (me, 1) and _is_sandbox_process(ancestor):
                ancestor = ancestor.parent()
            if ancestor is None or ancestor.pid in (me, 1):
                alive.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return alive


@pytest.fixture
def no_leftovers():
    """Asserts after the test that no sandbox process outlived its run."""
    start = time.time()
    yield
    # The kernel tears a pid namespace down asynchronously after its init dies: allow it a moment
    # (seconds on a loaded machine; a leak outlives it: the programs here sleep 30 s or spin).
    deadline = time.monotonic() + 10.0
    left = sandbox_processes(start)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = sandbox_processes(start)
    assert not left, f"processes left behind: {[(p.pid, p.cmdline()) for p in left]}"
