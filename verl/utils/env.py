"""Process-environment helpers (no torch import: the test harness sets variables before torch loads)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

__all__ = ["environ"]


@contextlib.contextmanager
def environ(overrides: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of a block, then restore the previous values.

    Spawned child processes inherit the environment as it is when they start, so a block that
    starts processes hands them ``overrides``.
    """
    saved = {key: os.environ.get(key) for key in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
