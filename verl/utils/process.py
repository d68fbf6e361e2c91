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
- :func:`die_with_launcher`, called first thing by every entry point: a rank started by torchrun
  gets Linux's parent-death signal, so a ``kill -9`` of the torchrun agent (or of a ``launch/``
  script, which execs it) takes its workers along instead of leaving them training on.
- :func:`forks_die_with_this_process`, a block in the parent: the processes a thread forks inside
  it (``os.fork``, multiprocessing's fork context: Megatron's checkpoint writers, which run no
  module of ours) get Linux's parent-death signal.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["die_with_launcher", "die_with_parent", "exit_with_parent", "forks_die_with_this_process"]

_watching = False
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


_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_prctl: Any = None  # libc's prctl, looked up in the parent: the child calls it and nothing else
_parent_death_armed = False
DIES_WITH_PARENT_ENV = "VERL_DIES_WITH_PARENT"


def die_with_launcher() -> None:
    """Under torchrun (``TORCHELASTIC_RUN_ID`` set), SIGKILL this rank when its parent, the torchrun
    agent, dies; also with ``VERL_DIES_WITH_PARENT=1`` (a launch script that runs the trainer or
    verl's torchrun as its child, not by ``exec``); elsewhere nothing. Idempotent; Linux only.

    The agent forwards SIGTERM/SIGINT to its workers and waits for them (``verl.trainer.torchrun``),
    but a ``kill -9`` of it forwards nothing: the workers would train on, writing checkpoints into
    a folder a resumed run then shares. The signal is tied to the agent's thread that started the
    worker (its main thread, which lives as long as the agent)."""
    # Popped: the process's own children (a torchrun agent's workers) have their own launcher.
    asked = os.environ.pop(DIES_WITH_PARENT_ENV, "") == "1"
    if asked or "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()


def die_with_parent() -> None:
    """SIGKILL this process when its parent process dies (Linux's parent-death signal, armed now;
    a parent already gone kills it at once). Idempotent; elsewhere than Linux a no-op."""
    global _parent_death_armed
    if _parent_death_armed:
        return
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # no prctl: not Linux
        return
    parent = os.getppid()
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    _parent_death_armed = True
    if parent == 1 or os.getppid() != parent:  # the parent died before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)
_forks_hooked = False
_hook_state = threading.local()  # per thread: whether its forks get the parent-death signal


def _in_forked_child() -> None:
    # Runs in every forked child of this process (os.register_at_fork), between the fork and
    # anything else: only a ctypes call there (no thread, no allocation-heavy code; a fork for a
    # subprocess with preexec_fn passes here too, and its exec would keep the signal).
    expected = _forking_pid
    if expected is None:
        return
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != expected:  # the parent died before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)


def _note_forking_pid() -> None:
    global _forking_pid
    _forking_pid = os.getpid() if getattr(_hook_state, "on", False) else None


@contextlib.contextmanager
def forks_die_with_this_process() -> Iterator[None]:
    """While open, every process this thread forks (``os.fork``, multiprocessing's fork context:
    Megatron's checkpoint writers, which run no module of ours) is killed (SIGKILL) when this
    thread's process dies: Linux's parent-death signal, armed in the child right after the fork.
    Linux only (elsewhere a no-op). The signal is tied to the forking thread: keep the children
    inside the block (Megatron's save joins its writers before it returns)."""
    global _forks_hooked, _prctl
    if not _forks_hooked:
        try:
            import ctypes

            _prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):  # no prctl: not Linux
            yield
            return
        os.register_at_fork(before=_note_forking_pid, after_in_child=_in_forked_child)
        _forks_hooked = True
    was = getattr(_hook_state, "on", False)
    _hook_state.on = True
    try:
        yield
    finally:
        _hook_state.on = was
