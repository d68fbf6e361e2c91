"""DAPO's batch-level pieces (arXiv:2503.14476): overlong reward shaping and dynamic sampling.

- Overlong shaping (``reward_model.overlong_buffer``: ``len``, ``penalty_factor``, with
  ``data.max_response_length``): responses longer than ``max_response_length - len`` lose
  reward linearly, reaching ``-penalty_factor`` at ``max_response_length``.
- Dynamic sampling (``algorithm.filter_groups``): a prompt whose responses all score the same
  has zero GRPO advantage for every response and only dilutes the batch; its group is dropped
  and the trainer samples more prompts until the batch is full.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from verl.algos.checks import check_mask, check_positive, check_token_level, group_ids


def overlong_penalty(
    response_mask: torch.Tensor,
    *,
    max_response_length: int,
    overlong_buffer_len: int,
    overlong_penalty_factor: float,
) -> torch.Tensor:
    """Soft overlong punishment per response, [B] (<= 0), from ``response_mask`` [B, T].

    With L the number of valid tokens and E = max_response_length - overlong_buffer_len:
    penalty = min(-(L - E) / overlong_buffer_len * overlong_penalty_factor, 0), as the
    reference's DAPO reward manager adds to each response's score.
    """
    if not isinstance(response_mask, torch.Tensor) or response_mask.dim() != 2:
        raise ValueError(f"response_mask must be [B, T], got {getattr(response_mask, 'shape', type(response_mask))}")
    buffer_len = check_positive("reward_model.overlong_buffer.len", overlong_buffer_len)
    max_len = check_positive("data.max_response_length", max_response_length)
    factor = check_positive("reward_model.overlong_buffer.penalty_factor", overlong_penalty_factor, allow_zero=True)
    if buffer_len > max_len:
        raise ValueError(
            f"reward_model.overlong_buffer.len ({overlong_buffer_len}) must not exceed "
            f"data.max_response_length ({max_response_length})"
        )
    lengths = (response_mask != 0).sum(dim=-1).to(torch.float32)  # [B]
    expected = max_len - buffer_len
    return torch.clamp(-(lengths - expected) / buffer_len * factor, max=0.0)


def apply_overlong_penalty(
    token_level_scores: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    max_response_length: int,
    overlong_buffer_len: int,
    overlong_penalty_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add ``overlong_penalty`` to each response's last valid token of ``token_level_scores`` [B, T].

    Outcome rewards sit on the last valid token, so adding the penalty there changes each
    response's total score by exactly the penalty. Rows with no valid token are left unchanged.
    Returns (new token_level_scores [B, T], penalty [B]).
    """
    check_token_level("token_level_scores", token_level_scores)
    mask = check_mask("response_mask", response_mask, token_level_scores.shape, torch.bool)
    penalty = overlong_penalty(
        mask,
        max_response_length=max_response_length,
        overlong_buffer_len=overlong_buffer_len,
        overlong_penalty_factor=overlong_penalty_factor,
    ).to(token_level_scores.dtype)
    positions = torch.arange(mask.shape[1], device=mask.device).expand(mask.shape)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=-1).values  # [B]
    has_token = last >= 0
    out = token_level_scores.clone()
    rows = torch.nonzero(has_token).flatten()
    out[rows, last[rows]] += penalty[rows]
    return out, torch.where(has_token, penalty, torch.zeros_like(penalty))


@dataclass(frozen=True, kw_only=True)
class GroupFilterResult:
    """Which samples survive DAPO's dynamic-sampling filter."""

    kept_indices: np.ndarray
    """Positions (int64, ascending) of the samples whose group was kept."""
    num_groups: int
    """Groups (distinct uids) in the input."""
    num_kept_groups: int
    """Groups kept: their metric values differ, or the group has a single sample."""
    num_dropped_groups: int
    """Groups dropped because every sample had the same metric value."""


def filter_groups(*, index: Any, metric_values: Any) -> GroupFilterResult:
    """Drop every group (same uid in ``index`` [B]) whose ``metric_values`` [B] are all equal.

    ``metric_values`` is the per-sample metric named by ``algorithm.filter_groups.metric``
    (e.g. the sequence score or accuracy), a tensor, numpy array or list. Singleton groups
    are kept, as in the reference. Departure: "all equal" is tested exactly (max == min); the
    reference tests np.std > 0, which keeps a group of identical values such as
    [0.1, 0.1, 0.1] whenever rounding makes their std a tiny nonzero number.
    """
    if isinstance(metric_values, torch.Tensor):
        values = metric_values.detach().to(torch.float64).cpu().numpy()
    else:
        try:
            values = np.asarray(metric_values, dtype=np.float64)
        except (TypeError, ValueError):
            raise ValueError("metric_values must be numeric (one value per sample)") from None
    if values.ndim != 1:
        raise ValueError(f"metric_values must be 1-D [B], got shape {values.shape}")
    if values.shape[0] == 0:
        raise ValueError("filter_groups got an empty batch")
    if not np.all(np.isfinite(values)):
        bad = int(np.flatnonzero(~np.isfinite(values))[0])
        raise ValueError(f"metric_values[{bad}] = {values[bad]} is not finite; the filter metric must be a number")
    gid, num_groups, _ = group_ids(index, values.shape[0])
    g = gid.numpy()
    gmax = np.full(num_groups, -np.inf)
    gmin = np.full(num_groups, np.inf)
    np.maximum.at(gmax, g, values)
    np.minimum.at(gmin, g, values)
    sizes = np.bincount(g, minlength=num_groups)
    keep_group = (gmax != gmin) | (sizes == 1)
    kept = np.flatnonzero(keep_group[g]).astype(np.int64)
    num_kept = int(keep_group.sum())
    return GroupFilterResult(
        kept_indices=kept,
        num_groups=num_groups,
        num_kept_groups=num_kept,
        num_dropped_groups=num_groups - num_kept,
    )
