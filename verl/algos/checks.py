"""Input validation shared by the algorithm functions.

Every check raises ValueError naming the argument at fault, its shape or dtype, and what was
expected, so a wiring mistake in a trainer fails at the first step with a readable message
instead of broadcasting silently into wrong numbers.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch


def check_float(name: str, t: Any) -> torch.Tensor:
    """``t`` must be a floating-point tensor."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}; cast it with .float()")
    return t


def check_token_level(name: str, t: Any, like: torch.Tensor | None = None) -> torch.Tensor:
    """``t`` must be a non-empty float tensor of shape [B, T] (and equal to ``like``'s shape if given)."""
    check_float(name, t)
    if t.dim() != 2:
        raise ValueError(f"{name} must be token-level [B, T], got shape {tuple(t.shape)}")
    if t.shape[0] == 0:
        raise ValueError(f"{name} is an empty batch (shape {tuple(t.shape)}); there is nothing to compute")
    if like is not None and t.shape != like.shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)} but must match [B, T] = {tuple(like.shape)}")
    return t


def check_mask(name: str, mask: Any, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``mask`` must have ``shape``; bool, integer and float masks are accepted, returned as ``dtype`` 0/1.

    A float mask may hold weights other than 0/1 only through the loss functions that document it;
    here it is kept as given.
    """
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(mask.shape)} but must match {tuple(shape)}")
    if mask.is_complex():
        raise ValueError(f"{name} must be bool, integer or float, got dtype {mask.dtype}")
    return mask.to(dtype)


def check_seq_level(name: str, t: Any, batch_size: int) -> torch.Tensor:
    """``t`` must be a float tensor of shape [B]."""
    check_float(name, t)
    if t.dim() != 1 or t.shape[0] != batch_size:
        raise ValueError(f"{name} must be sequence-level [B] = [{batch_size}], got shape {tuple(t.shape)}")
    return t


def check_positive(name: str, value: float, *, allow_zero: bool = False) -> float:
    """A hyperparameter that must be finite and > 0 (or >= 0)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not np.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be finite and {bound}, got {value!r}")
    return v


def group_ids(index: Any, batch_size: int) -> tuple[torch.Tensor, int, list[Any]]:
    """Map per-sample group uids to dense ids in first-appearance order.

    ``index`` is the per-sample prompt uid (``non_tensor_batch["uid"]``: a numpy object array of
    strings in practice; any 1-D array, list or tensor of hashable values works). Returns
    (ids [B] int64, number of groups, the uid of each group id).
    """
    if isinstance(index, torch.Tensor):
        if index.dim() != 1:
            raise ValueError(f"index must be 1-D [B], got shape {tuple(index.shape)}")
        values = index.tolist()
    elif isinstance(index, np.ndarray):
        if index.ndim != 1:
            raise ValueError(f"index must be 1-D [B], got shape {index.shape}")
        values = index.tolist()
    elif isinstance(index, (list, tuple)):
        values = list(index)
    else:
        raise ValueError(
            f"index must be a numpy array, list or tensor of per-sample group uids, got {type(index).__name__}"
        )
    if len(values) != batch_size:
        raise ValueError(f"index has {len(values)} entries but the batch has B = {batch_size} samples")
    table: dict[Any, int] = {}
    ids = []
    for v in values:
        try:
            ids.append(table.setdefault(v, len(table)))
        except TypeError:
            raise ValueError(f"index entries must be hashable group uids, got {type(v).__name__} {v!r}") from None
    return torch.tensor(ids, dtype=torch.int64), len(table), list(table)
