"""A wall-clock limit for one scoring call that nests with any timer already running.

Symbolic math (sympy through math-verify) can take minutes on an adversarial answer such as
``10^{10^{10}}``; a reward function must return a score instead. The limit is a SIGALRM
interval timer, so it interrupts pure-Python work (not a single long C call) and only works
in a process's main thread on POSIX. Elsewhere (a worker thread, Windows) ``time_limit`` runs
the body without a limit and says so once; the reward manager's process pool runs every
sample in a worker's main thread, where the limit always applies.

An outer timer (pytest-timeout, an outer ``time_limit``) is saved and re-armed with what is
left of it when the inner block ends; if it expired meanwhile it fires right after.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator

logger = logging.getLogger(__name__)

# Re-arm delay for an outer timer whose deadline passed while the inner block ran: fire
# "now" (0 would disarm it instead).
_FIRE_NOW_S = 1e-6


class ScoreTimeout(BaseException):
    """Raised inside a ``time_limit`` block when its time is up.

    A ``BaseException`` (like ``KeyboardInterrupt``) on purpose: sympy and math-verify wrap
    much of their work in ``except Exception``, which would swallow an ``Exception`` timeout and
    carry on without any limit. Catch it by name.
    """


def timeouts_supported() -> bool:
    """Whether ``time_limit`` can interrupt code here (POSIX, main thread)."""
    return os.name == "posix" and threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise ``ScoreTimeout`` in the body if it runs longer than ``seconds`` (None or <= 0: no limit)."""
    if seconds is None or seconds <= 0:
        yield
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
        yield
        return

    def _on_alarm(signum, frame):
        raise ScoreTimeout(f"scoring took longer than {seconds:g} s")

    outer_handler = signal.signal(signal.SIGALRM, _on_alarm)
    outer_delay, outer_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    if 0 < outer_delay < seconds:
        # The outer deadline comes first: keep it (our handler raises ScoreTimeout then;
        # the outer timer is re-armed to fire right after the block unwinds).
        signal.setitimer(signal.ITIMER_REAL, outer_delay)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        # None: the outer handler was installed from C; the default is the closest we can restore.
        signal.signal(signal.SIGALRM, signal.SIG_DFL if outer_handler is None else outer_handler)
        if outer_delay > 0:
            left = outer_delay - (time.monotonic() - start)
            signal.setitimer(signal.ITIMER_REAL, max(left, _FIRE_NOW_S), outer_interval)
