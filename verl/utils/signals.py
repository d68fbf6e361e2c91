"""Clean-up that an asynchronous timeout must not cut short: :func:`deferred`.

``verl.rewards.timeout.time_limit`` raises its ``ScoreTimeout`` from a SIGALRM handler, and past a
deadline the timer fires again every 50 ms until the limited block has unwound. Clean-up on that
way out (the sandbox killing a process tree) can take longer than 50 ms on a loaded machine; inside
``deferred()`` the handler holds the timeout back, and the next signal after the block raises it.
:func:`interruptible` lets it through again in the waits of such a body. Lives here, below the
layers of both the sandbox and the rewards, which each use it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

# deferred() blocks open, per thread: a timeout's signal handler runs in the main thread and asks
# about the main thread's only. Other threads (the agent loop's tool calls, which may run the
# sandbox) open and close their own blocks without holding back the main thread's timeouts.
_local = threading.local()


def _depth() -> int:
    return getattr(_local, "depth", 0)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold back a due timeout while the body runs. Keep the body short and bounded: the limit
    cannot interrupt it (the timer keeps firing, so the timeout is raised right after it)."""
    outer = _depth()
    _local.depth = outer + 1
    try:
        yield
    finally:
        # Restored, not decremented: a timeout raised inside an inner interruptible()'s finally,
        # before it restored the depth, must not leave this thread's count off by one for good.
        _local.depth = outer


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Inside a :func:`deferred` block, let a due timeout raise again (one level: an enclosing
    caller's own ``deferred()`` still holds). For the waits of a clean-up-guarded body, where the
    raise leaves a state the clean-up handles."""
    outer = _depth()
    _local.depth = outer - 1
    try:
        yield
    finally:
        _local.depth = outer


def deferring() -> bool:
    """Whether a :func:`deferred` block is open in this thread (a timeout handler, which runs in the
    main thread, returns without raising)."""
    return _depth() > 0
