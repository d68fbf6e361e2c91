"""Progress of a long loop: a live bar on a terminal, a periodic log line everywhere else.

:func:`progress_bar` decides once, when the loop starts, what the user gets:

- a tqdm bar when the caller allows it (``trainer.progress_bar``), ``TQDM_DISABLE`` is unset
  (any non-empty value disables, as tqdm reads it) and stderr is a terminal with a width
  (:func:`bar_allowed`). While the bar is up, log records are printed above it
  (``tqdm.write``), so the bar stays on the bottom line;
- otherwise (a log file, a pipe, ``nohup``, a cluster job, the bar turned off) an ordinary
  log line, ``sft: step 120/1200 (10%), 0:01:02 elapsed, 0:09:18 left, 1.9 steps/s, loss=0.4``,
  every :data:`LOG_EVERY_S` seconds and at the last step: never a ``\\r`` frame in a file;
- on every rank but global rank 0, nothing.

The loop calls ``set_postfix(...)`` then ``update(1)`` per step and ``close()`` at the end.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import time
from typing import IO, Any

from verl.utils.logging import global_rank

__all__ = ["LOG_EVERY_S", "bar_allowed", "progress_bar"]

logger = logging.getLogger("verl.progress")

LOG_EVERY_S = 30.0
"""Seconds between two progress lines when no bar is drawn (the last step is always logged)."""


def bar_allowed(stream: IO[str] | None = None) -> bool:
    """Whether a live bar may be drawn on ``stream`` (default stderr): it is a terminal with a
    non-zero width and ``TQDM_DISABLE`` is unset or empty."""
    stream = sys.stderr if stream is None else stream
    if os.environ.get("TQDM_DISABLE"):
        return False
    try:
        if not stream.isatty():
            return False
        return os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):  # closed, replaced by an object without a file
        return False


class _NoBar:
    """The progress of non-zero ranks: accepts the bar's calls, shows nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **values: Any) -> None:
        pass

    def close(self) -> None:
        pass


class _LogProgress:
    """Progress as a periodic log line (see the module docstring)."""

    def __init__(self, *, total: int, initial: int, desc: str, every_s: float) -> None:
        self.total, self.n, self._start_n, self.desc, self.every_s = total, initial, initial, desc, every_s
        self._t0 = self._last = time.monotonic()
        self._postfix: dict[str, Any] = {}

    def set_postfix(self, **values: Any) -> None:
        self._postfix = values

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if self.n >= self.total or now - self._last >= self.every_s:
            self._last = now
            logger.info("%s", self._line(now))

    def _line(self, now: float) -> str:
        elapsed = now - self._t0
        done = self.n - self._start_n
        parts = [f"{self.desc}: step {self.n}/{self.total} ({100 * self.n / max(self.total, 1):.0f}%)",
                 f"{_hms(elapsed)} elapsed"]
        if done > 0 and elapsed > 0:
            rate = done / elapsed
            if self.n < self.total:
                parts.append(f"{_hms((self.total - self.n) / rate)} left")
            parts.append(f"{rate:.3g} steps/s" if rate >= 1 else f"{1 / rate:.3g} s/step")
        parts += [f"{k}={v}" for k, v in self._postfix.items()]
        return ", ".join(parts)

    def close(self) -> None:
        pass


class _Bar:
    """A tqdm bar whose lifetime also routes log records through ``tqdm.write``, so log lines
    (the console logger's metrics) print above the bar instead of through it."""

    def __init__(self, *, total: int, initial: int, desc: str, stream: IO[str]) -> None:
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self._bar = tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True, file=stream)
        self._redirect = logging_redirect_tqdm()
        self._redirect.__enter__()

    def update(self, n: int = 1) -> None:
        self._bar.update(n)

    def set_postfix(self, **values: Any) -> None:
        self._bar.set_postfix(values, refresh=False)

    def close(self) -> None:
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None
        self._bar.close()


def _hms(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds)))


def progress_bar(
    *,
    total: int,
    initial: int = 0,
    desc: str = "training",
    enabled: bool = True,
    rank: int | None = None,
    stream: IO[str] | None = None,
    log_every_s: float = LOG_EVERY_S,
) -> _Bar | _LogProgress | _NoBar:
    """The progress of a loop over ``total`` steps from ``initial`` (see the module docstring).

    Args:
        enabled: the caller's setting (``trainer.progress_bar``); False: log lines only.
        rank: the global rank; None reads torch.distributed (RANK as a fallback).
        stream: where a bar would be drawn (default stderr, where the log goes).
        log_every_s: seconds between progress lines when no bar is drawn.
    """
    if (global_rank() if rank is None else rank) != 0:
        return _NoBar()
    stream = sys.stderr if stream is None else stream
    if enabled and bar_allowed(stream):
        return _Bar(total=total, initial=initial, desc=desc, stream=stream)
    return _LogProgress(total=total, initial=initial, desc=desc, every_s=log_every_s)
