"""Running a command tree from a test: its own session, and on a time limit the whole tree killed.

``subprocess.run(timeout=...)`` kills only the process it started: a launcher's bash, and not the
torchrun, trainer and sandbox processes under it, which ran on and loaded the rest of the suite
(suite17). The limits of the tests that use this are hang guards sized for a loaded machine: there
(two busy loops beside the suite on 2 cores, load up to 39) a run took 10-15x its quiet time.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence


def run_tree(cmd: Sequence[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)``, except that
    the command starts a new session and a time limit kills every process of it; the
    ``TimeoutExpired`` raised then carries the output so far (as str)."""
    proc = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=kwargs.pop("stderr", subprocess.PIPE), text=True,
        start_new_session=True, **kwargs,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired as left:  # something beyond the tree holds the pipes
            out, err = left.output, left.stderr
            out, err = (x.decode(errors="replace") if isinstance(x, bytes) else x for x in (out, err))
        raise subprocess.TimeoutExpired(list(cmd), timeout, output=out, stderr=err) from None
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
