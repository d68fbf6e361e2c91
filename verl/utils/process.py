"""Child processes that die with the process that started them.

A trainer killed with SIGKILL cannot stop its children, and Linux hands them to PID 1: the
reward pool's spawned workers, Megatron's forked checkpoint writers and the multiprocessing
resource tracker would stay alive, holding the run's log open (a forked writer can wait forever
for a queue item its dead parent never sent).

- :func:`exit_with_parent`, called in a child at start-up, watches the parent from a daemon
  thread and kills the child (or its whole process group) once the parent is gone; the resource
  tracker then sees its last client go and exits by itself. Entry points call it for every
  spawned multiprocessing child: such a child imports the parent's ``__main__`` module under the
  name ``__mp_main__``, so ``if __name__ == "__mp_main__": exit_with_parent()`` in the entry
  module covers every child, whoever starts it.
- :func:`forks_exit_with_parent`, called in the parent, does the same for every process it forks
  from then on (``os.fork``, multiprocessing's fork context: Megatron's checkpoint writers, which
  run no module of ours).
"""

from __future__ import annotations

import os
import signal
import threading
import time

__all__ = ["exit_with_parent", "forks_exit_with_parent"]

_watching = False
_forks_hooked = False
_forking_pid: int | None = None


def _spawned_parent_pid(poll_s: float) -> int:
    """The multiprocessing parent's pid, waiting for the child's bootstrap to record it."""
    import multiprocessing

    while (started_by := multiprocessing.parent_process()) is None:
        time.sleep(min(poll_s, 0.05))
    assert started_by.pid is not None
    return started_by.pid


def _watch(parent: int | None, poll_s: float, kill_group: bool) -> None:
    if parent is None:
        parent = _spawned_parent_pid(poll_s)
    while os.getppid() == parent:
        time.sleep(poll_s)
    if kill_group:
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _start_watcher(parent: int | None, poll_s: float, kill_group: bool) -> None:
    global _watching
    _watching = True
    threading.Thread(
        target=_watch, args=(parent, poll_s, kill_group), name="verl-exit-with-parent", daemon=True
    ).start()


def exit_with_parent(*, poll_s: float = 1.0, kill_group: bool = False) -> None:
    """Kill this process (``kill_group``: its whole process group) within ``poll_s`` of its parent's death.

    Idempotent. The parent is the multiprocessing parent (else the current parent process);
    once it dies this process is re-parented (to PID 1 or a subreaper), which the watcher notices.
    """
    if _watching:
        return
    import multiprocessing
    from multiprocessing import process

    started_by = multiprocessing.parent_process()
    if started_by is not None and started_by.pid:
        parent: int | None = started_by.pid
    elif getattr(process.current_process(), "_inheriting", False):
        # A spawned child importing the parent's __main__ (the stdlib marks that phase with
        # ``_inheriting``; CPython 3.8-3.13): its parent is recorded only at bootstrap, after the
        # import. os.getppid() would be PID 1 if the parent was killed before this line ran, and
        # the watcher would never fire: the watcher waits for the recorded parent instead.
        parent = None
    else:
        parent = os.getppid()
    _start_watcher(parent, poll_s, kill_group)


def _note_forking_pid() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


def forks_exit_with_parent(*, poll_s: float = 1.0) -> None:
    """Every process this one forks from now on is killed within ``poll_s`` of this one's death.

    Idempotent; a fork hook cannot be removed, so it holds for the rest of the process. A fork
    that execs at once (``subprocess``) runs no hook: a program it starts is not watched.
    """
    global _forks_hooked
    if _forks_hooked:
        return
    _forks_hooked = True
    os.register_at_fork(
        before=_note_forking_pid,
        after_in_child=lambda: _start_watcher(_forking_pid, poll_s, False),
    )
