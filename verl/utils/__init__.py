"""Utilities; ``verl.utils.load_hf_dataset`` (from :mod:`verl.data.hf_dataset`) is imported on first use."""

import importlib
from typing import Any

_LAZY = {"load_hf_dataset": "verl.data.hf_dataset", "RecordData": "verl.data.hf_dataset"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'verl.utils' has no attribute {name!r}")


__all__ = list(_LAZY)
