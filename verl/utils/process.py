"""Child processes that die with the process that started them.

A trainer killed with SIGKILL cannot stop its children, and Linux hands them to PID 1: the
reward pool's spawned workers and the multiprocessing resource tracker would stay alive, holding
the run's log open. (Megatron's checkpoint writer no longer starts a lasting process:
:mod:`verl.models.dist_save`.)
:func:`exit_with_parent`, called in a child at start-up, watches the parent from a daemon
thread and kills the child (or its whole process group) once the parent is gone; the resource
tracker then sees its last client go and exits by itself.

Entry points call it for every multiprocessing child: a spawned child imports the parent's
``__main__`` module under the name ``__mp_main__``, so ``if __name__ == "__mp_main__":
exit_with_parent()`` in the entry module covers every child, whoever starts it.
"""

from __future__ import annotations

import os
import signal
import threading
import time

__all__ = ["exit_with_parent"]

_watching = False


def _watch(parent: int, poll_s: float, kill_group: bool) -> None:
    while os.getppid() == parent:
        time.sleep(poll_s)
    if kill_group:
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def exit_with_parent(*, poll_s: float = 1.0, kill_group: bool = False) -> None:
    """Kill this process (``kill_group``: its whole process group) within ``poll_s`` of its parent's death.

    Idempotent. The parent is the multiprocessing parent (else the current parent process);
    once it dies this process is re-parented (to PID 1 or a subreaper), which the watcher notices.
    """
    global _watching
    if _watching:
        return
    _watching = True
    import multiprocessing

    started_by = multiprocessing.parent_process()  # set in multiprocessing children
    parent = started_by.pid if started_by is not None and started_by.pid else os.getppid()
    threading.Thread(
        target=_watch, args=(parent, poll_s, kill_group), name="verl-exit-with-parent", daemon=True
    ).start()
