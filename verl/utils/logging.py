"""Rank-aware logging helpers.

Library code logs through ``logging.getLogger(__name__)``; these helpers add the two things
a distributed job needs on top: log on one rank of a group unless asked, and warn once for a
warning that would otherwise repeat every step.
"""

from __future__ import annotations

import logging
import os
import threading

_warned: set[str] = set()
_lock = threading.Lock()


def _dist():
    """torch.distributed if torch is already imported, else None (keeps torch-free tools fast)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = torch.distributed
    return dist if dist.is_available() and dist.is_initialized() else None


def global_rank() -> int:
    """The global rank, 0 when torch.distributed is not initialised (reads RANK as a fallback)."""
    dist = _dist()
    if dist is not None:
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def log_rank0(logger: logging.Logger, level: int, msg: str, *args, group=None) -> None:
    """Log ``msg`` only on rank 0 of ``group`` (the whole world when ``group`` is None)."""
    dist = _dist()
    if dist is not None:
        if dist.get_rank(group=group) != 0:
            return
    logger.log(level, msg, *args)


def warn_once(logger: logging.Logger, msg: str, *args) -> None:
    """Emit a warning the first time this exact (formatted) message is seen in this process."""
    text = msg % args if args else msg
    with _lock:
        if text in _warned:
            return
        _warned.add(text)
    logger.warning(text)


def setup_logging(level: int | str = logging.INFO) -> None:
    """Configure the root logger for command-line entry points (never called by library code).

    The format carries the rank so interleaved output from several processes stays readable.
    """
    rank = global_rank()
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
