"""Running a command tree from a test: its own session, and on a time limit the whole tree killed.

``subprocess.run(timeout=...)`` kills only the process it started: a launcher's bash, and not the
torchrun, trainer and sandbox processes under it, which ran on and loaded the rest of the suite
(suite17). The limits of the tests that use this are hang guards sized for a loaded machine: there
(two busy loops beside the suite on 2 cores, load up to 39) a run took 10-15x its quiet time.

When a limit fires, the error carries each Python process's stack at that moment (``py-spy dump``,
a test dependency), taken before the kill: suite23's launcher run hung past its summary with
nothing to say where.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

STACKS_LIMIT_S = 30  # the py-spy dumps of one tree, run at once; quiet each takes well under a second
MAX_STACKS = 12  # the processes dumped, oldest first (bash, torchrun, the trainer, its workers)


class TreeTimedOut(subprocess.TimeoutExpired):
    """:func:`run_tree`'s time limit: the output so far and every Python process's stack at the limit."""

    def __init__(self, cmd: Sequence[str], timeout: float, output: str, stderr: str, stacks: str) -> None:
        super().__init__(list(cmd), timeout, output=output, stderr=stderr)
        self.stacks = stacks

    def __str__(self) -> str:
        tail = ((self.output or "") + (self.stderr or ""))[-3000:]
        return f"{super().__str__()}\n-- the output ends:\n{tail}\n-- the stacks at the limit:\n{self.stacks}"


def run_tree(cmd: Sequence[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)``, except that
    the command starts a new session and a time limit kills every process of it; the
    ``TimeoutExpired`` raised then (a :class:`TreeTimedOut`) carries the output so far (as str) and
    the stacks of the tree's Python processes at the limit."""
    proc = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=kwargs.pop("stderr", subprocess.PIPE), text=True,
        start_new_session=True, **kwargs,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stacks = python_stacks(proc.pid)
        kill_tree(proc)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired as left:  # something beyond the tree holds the pipes
            out, err = left.output, left.stderr
            out, err = (x.decode(errors="replace") if isinstance(x, bytes) else x for x in (out, err))
        raise TreeTimedOut(cmd, timeout, out, err, stacks) from None
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the session ``proc`` leads (started with ``start_new_session=True``), itself included,
    and every descendant of ``proc`` that started its own session or group (torchrun starts its
    workers so: suite23's launcher run left its trainer holding the test's pipes)."""
    import psutil

    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for child in descendants:
        try:
            child.kill()
        except psutil.Error:
            pass


def python_stacks(pid: int) -> str:
    """``py-spy dump`` of ``pid`` and its Python descendants (at most :data:`MAX_STACKS`), or why not."""
    import psutil

    spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if spy is None:
        return "(py-spy is not installed: no stacks; it comes with setup_env.sh --test)"
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error as exc:
        return f"(no stacks: {exc})"
    found = []
    for process in tree:
        try:
            if "python" in process.name().lower() or any("python" in a for a in process.cmdline()[:1]):
                found.append(process)
        except psutil.Error:
            pass
    # All dumps at once, under one deadline: one after another, a dozen stuck ones would add minutes
    # to a failing test's report.
    spies = []
    for process in found[:MAX_STACKS]:
        try:
            spies.append((process.pid, subprocess.Popen([spy, "dump", "--pid", str(process.pid)],
                                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
        except OSError as exc:
            spies.append((process.pid, exc))
    deadline = time.monotonic() + STACKS_LIMIT_S
    parts = []
    for pid_, spy_run in spies:
        if isinstance(spy_run, OSError):
            parts.append(f"pid {pid_}: py-spy dump failed ({spy_run})")
            continue
        try:
            out, err = spy_run.communicate(timeout=max(0.1, deadline - time.monotonic()))
            parts.append(out.strip() or f"pid {pid_}: {err.strip()[-500:]}")
        except subprocess.TimeoutExpired:
            spy_run.kill()
            spy_run.communicate()
            parts.append(f"pid {pid_}: py-spy dump gave nothing within {STACKS_LIMIT_S} s")
    if len(found) > MAX_STACKS:
        parts.append(f"({len(found) - MAX_STACKS} more Python processes not dumped)")
    return "\n\n".join(parts) or "(no Python process was left in the tree)"
