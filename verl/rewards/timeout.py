"""A wall-clock limit for one scoring call that nests with other limits and outer timers.

Symbolic math (sympy through math-verify) can take minutes on an adversarial answer such as
``10^{10^{10}}``; a reward function must return a score instead. Usage::

    with time_limit(5.0) as limit:
        verdict = slow_check()
    if limit.expired:
        verdict = fallback

On expiry the body is abandoned (a ``ScoreTimeout`` unwinds it) and the ``with`` block ends
normally with ``limit.expired`` set. The timeout is raised as a ``BaseException``, so the
``except Exception`` blocks common in sympy and math-verify cannot swallow it. Limits nest:
when an *outer* limit expires while an inner one is active, its ``ScoreTimeout`` passes through
the inner block (which does not claim it) up to the outer one. The manager's per-sample limit
therefore still holds while a scorer runs its own shorter math-verify limit.

The limit is a SIGALRM interval timer: it interrupts Python code (not a single long C call)
and only works in a process's main thread on POSIX. Past the deadline it re-fires every
``_REFIRE_S`` until the block has unwound, since a signal that lands where Python cannot raise
(a gc callback, ``__del__``) is lost. Elsewhere (a worker thread, Windows) ``time_limit`` runs
the body without a limit and says so once; the reward manager's process pool scores every
sample in a worker's main thread, where limits always apply. A timer that was running before
(pytest-timeout, say) is saved and re-armed with what is left of it; if it came due meanwhile,
it fires as the block ends.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from verl.utils.signals import deferring

logger = logging.getLogger(__name__)

# Re-arm delay for an outer timer whose deadline passed while an inner block ran: fire "now"
# (0 would disarm it).
_FIRE_NOW_S = 1e-6
# After a deadline the timer keeps firing at this interval until the block has unwound: a
# signal that lands where Python cannot raise (a gc or weakref callback, __del__) is reported
# as "unraisable" and lost, and the next one must try again.
_REFIRE_S = 0.05
# The interval timer and time.monotonic may disagree by a hair; a deadline this close counts
# as reached.
_EARLY_S = 1e-3


@dataclass(eq=False)
class Limit:
    """One active ``time_limit``: its length, deadline (``time.monotonic``) and whether it expired."""

    seconds: float | None
    deadline: float = math.inf
    expired: bool = False


class ScoreTimeout(BaseException):
    """Unwinds the body of the ``time_limit`` whose deadline passed (``limit``).

    A ``BaseException`` (like ``KeyboardInterrupt``) on purpose: sympy and math-verify wrap
    much of their work in ``except Exception``, which would swallow an ``Exception`` timeout and
    carry on without any limit.
    """

    def __init__(self, limit: Limit):
        super().__init__(f"scoring took longer than {limit.seconds:g} s")
        self.limit = limit


# Limits active in this (main) thread, outermost first.
_active: list[Limit] = []
_UNSET = object()


def timeouts_supported() -> bool:
    """Whether ``time_limit`` can interrupt code here (POSIX, main thread)."""
    return os.name == "posix" and threading.current_thread() is threading.main_thread()


def _on_alarm(signum: int, frame: object) -> None:
    if deferring():  # clean-up that must not be cut short (verl.utils.signals): the timer fires again after it
        return
    now = time.monotonic()
    pending = [lim for lim in _active if not lim.expired]  # expired ones are already unwinding
    # The outermost expired limit owns the timeout: every block inside it must unwind too.
    for limit in pending:
        if limit.deadline <= now + _EARLY_S:
            raise ScoreTimeout(limit)
    if pending:  # an early or stray signal: wait on for the nearest deadline
        nearest = min(lim.deadline for lim in pending)
        signal.setitimer(signal.ITIMER_REAL, max(nearest - now, _FIRE_NOW_S), _REFIRE_S)


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[Limit]:
    """Abandon the body after ``seconds`` (None or <= 0: no limit) and set ``expired`` on the result."""
    limit = Limit(seconds)
    if seconds is None or seconds <= 0:
        yield limit
        return
    if not timeouts_supported():
        # Imported here: verl.utils.logging pulls in torch, which pool workers never need.
        from verl.utils.logging import warn_once

        warn_once(
            logger,
            "time_limit(%.1fs) ignored: timers need the main thread of a POSIX process (this is %s); "
            "score in a process pool (num_workers > 0) to bound slow answers",
            seconds,
            threading.current_thread().name,
        )
        yield limit
        return

    start = time.monotonic()
    limit.deadline = start + seconds
    outer_handler: object = _UNSET
    outer_delay, outer_interval = 0.0, 0.0
    # Everything from here on sits inside try/finally, so that a signal landing during set-up
    # (an outer limit expiring) still leaves the handler, the timer and _active as they were.
    try:
        _active.append(limit)
        outer_handler = signal.signal(signal.SIGALRM, _on_alarm)
        outer_delay, outer_interval = signal.setitimer(signal.ITIMER_REAL, seconds, _REFIRE_S)
        if 0 < outer_delay < seconds:
            # An outer deadline comes first: keep it (the handler attributes the timeout to it).
            signal.setitimer(signal.ITIMER_REAL, outer_delay, _REFIRE_S)
        yield limit
    except ScoreTimeout as exc:
        if exc.limit is not limit:
            raise
        limit.expired = True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        if limit in _active:
            _active.remove(limit)
        if outer_handler is not _UNSET:
            # None: the outer handler was installed from C; the default is the closest we can restore.
            signal.signal(signal.SIGALRM, signal.SIG_DFL if outer_handler is None else outer_handler)
        if outer_delay > 0:
            left = outer_delay - (time.monotonic() - start)
            signal.setitimer(signal.ITIMER_REAL, max(left, _FIRE_NOW_S), outer_interval)
