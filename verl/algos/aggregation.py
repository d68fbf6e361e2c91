"""Loss aggregation (``actor.loss_agg_mode``): a [B, T] loss matrix to one scalar.

Micro-batching and data parallelism split a mini-batch into pieces whose losses are each
back-propagated and whose gradients are summed over micro-batches and averaged over DP ranks.
For the result to equal one step on the whole mini-batch, every piece must divide by the
GLOBAL denominator (tokens or sequences in the whole mini-batch on all DP ranks), not its own,
and multiply by ``dp_size`` to undo the DP average. ``GlobalBatchInfo`` carries those numbers;
without it a call aggregates over its own batch only (correct for one micro-batch on one rank).

Modes, with M the mask, L the loss matrix, S the number of sequences with at least one valid
token and N the number of valid tokens (global when given, local otherwise):

- ``token-mean``:              sum(L * M) / N * dp_size
- ``token-sum``:               sum(L * M) * dp_size
  (no denominator at all, so no count has to be shared: the sum over micro-batches and the
  average over DP ranks times dp_size are the sum over the whole mini-batch, whatever the cut;
  the loss's scale grows with the batch's tokens, so the learning rate must account for it)
- ``seq-mean-token-sum``:      sum_i sum_t L*M / S * dp_size
- ``seq-mean-token-mean``:     sum_i (sum_t L*M / sum_t M) / S * dp_size
- ``seq-mean-token-sum-norm``: sum_i sum_t L*M / S * dp_size / loss_scale_factor (default T)
  (Dr. GRPO: a constant length normaliser instead of each sequence's own length)

These follow the reference verl's ``agg_loss`` with ``global_batch_info`` (``dp_size``,
``batch_num_tokens``, ``global_batch_size``, ``loss_scale_factor``). Departures: fully masked
sequences never count in S and an all-masked batch gives 0 rather than NaN (denominators are
clamped to at least 1); ``seq-mean-token-sum-norm`` defaults ``loss_scale_factor`` to T as the
reference does, so micro-batches padded to different T must pass the same explicit factor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from verl.algos.checks import check_mask, check_positive, check_token_level
from verl.algos.masked import masked_sum

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def list_loss_agg_modes() -> list[str]:
    """Every supported ``loss_agg_mode``."""
    return list(LOSS_AGG_MODES)


@dataclass(frozen=True, kw_only=True)
class GlobalBatchInfo:
    """Denominators of one optimizer step, shared by all its micro-batches and DP ranks."""

    batch_num_tokens: float
    """Valid tokens (response_mask == 1) in the whole mini-batch, summed over micro-batches and DP ranks."""
    global_batch_size: float
    """Sequences with at least one valid token in the whole mini-batch, over micro-batches and DP ranks."""
    dp_size: int = 1
    """Data-parallel ranks whose gradients are averaged (each rank's loss is scaled up by this)."""

    def __post_init__(self) -> None:
        check_positive("GlobalBatchInfo.batch_num_tokens", self.batch_num_tokens, allow_zero=True)
        check_positive("GlobalBatchInfo.global_batch_size", self.global_batch_size, allow_zero=True)
        if not isinstance(self.dp_size, int) or self.dp_size < 1:
            raise ValueError(f"GlobalBatchInfo.dp_size must be an int >= 1, got {self.dp_size!r}")

    @classmethod
    def from_masks(
        cls, masks: Sequence[torch.Tensor], *, group: dist.ProcessGroup | None = None
    ) -> "GlobalBatchInfo":
        """Count tokens and sequences over this rank's micro-batch masks (each [b, T]).

        With ``group`` (the DP process group, torch.distributed initialised) the counts are
        summed over its ranks and ``dp_size`` is its size; every rank must call this together.
        """
        if len(masks) == 0:
            raise ValueError("GlobalBatchInfo.from_masks needs at least one micro-batch mask")
        tokens = 0.0
        seqs = 0.0
        for i, m in enumerate(masks):
            if not isinstance(m, torch.Tensor) or m.dim() != 2:
                raise ValueError(f"masks[{i}] must be a [b, T] tensor, got {getattr(m, 'shape', type(m))}")
            mf = m.to(torch.float64)
            tokens += float(mf.sum())
            seqs += float((mf.sum(dim=-1) > 0).sum())
        dp_size = 1
        if group is not None:
            from verl.protocol.collectives import comm_device

            # On the group's device: NCCL reduces CUDA tensors only.
            counts = torch.tensor([tokens, seqs], dtype=torch.float64, device=comm_device(group))
            dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
            tokens, seqs = counts.tolist()
            dp_size = dist.get_world_size(group=group)
        return cls(batch_num_tokens=tokens, global_batch_size=seqs, dp_size=dp_size)


def _check_weight(weight: torch.Tensor, loss_mat: torch.Tensor) -> torch.Tensor:
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (loss_mat.shape[0],):
        raise ValueError(
            f"sample_weight must be a [B] tensor with B={loss_mat.shape[0]}, got {tuple(getattr(weight, 'shape', ()))}"
        )
    weight = weight.detach().to(loss_mat.dtype)
    if not bool(torch.isfinite(weight).all()) or bool((weight < 0).any()):
        raise ValueError(f"sample_weight must be finite and >= 0, got {weight.tolist()}")
    return weight


def agg_loss(
    loss_mat: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    global_batch_info: GlobalBatchInfo | None = None,
    dp_size: int = 1,
    batch_num_tokens: float | None = None,
    global_batch_size: float | None = None,
    loss_scale_factor: float | None = None,
    sample_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Aggregate ``loss_mat`` [B, T] under ``response_mask`` [B, T] into a scalar (see module doc).

    ``sample_weight`` [B] (optional, >= 0, detached) scales each sequence's losses before they are
    aggregated; the denominators (tokens, sequences) stay the unweighted counts, so a weight of 0
    removes a sequence's contribution as dropping it would, except that it still counts in them.

    Either pass ``global_batch_info`` or the reference verl's separate keywords (``dp_size``,
    ``batch_num_tokens``, ``global_batch_size``), not both. ``loss_scale_factor`` is the constant
    length normaliser of ``seq-mean-token-sum-norm`` (ignored by the other modes).
    """
    check_token_level("loss_mat", loss_mat)
    mask = check_mask("response_mask", response_mask, loss_mat.shape, loss_mat.dtype)
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; supported: {list(LOSS_AGG_MODES)}")
    if global_batch_info is not None:
        if batch_num_tokens is not None or global_batch_size is not None or dp_size != 1:
            raise ValueError(
                "pass either global_batch_info or dp_size/batch_num_tokens/global_batch_size to agg_loss, not both"
            )
        dp_size = global_batch_info.dp_size
        batch_num_tokens = global_batch_info.batch_num_tokens
        global_batch_size = global_batch_info.global_batch_size
    if not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size must be an int >= 1, got {dp_size!r}")

    if sample_weight is not None:
        loss_mat = loss_mat * _check_weight(sample_weight, loss_mat).unsqueeze(-1)
    token_counts = mask.sum(dim=-1)  # [B]
    seq_valid = token_counts > 0  # [B]

    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError(
                    "token-mean with dp_size > 1 needs the global batch_num_tokens (GlobalBatchInfo.from_masks)"
                )
            batch_num_tokens = token_counts.sum()
        denom = torch.as_tensor(batch_num_tokens, dtype=loss_mat.dtype, device=loss_mat.device).clamp(min=1)
        return masked_sum(loss_mat, mask) / denom * dp_size
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, mask) * dp_size

    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError(
                f"{loss_agg_mode} with dp_size > 1 needs the global global_batch_size (GlobalBatchInfo.from_masks)"
            )
        global_batch_size = seq_valid.sum()
    seq_denom = torch.as_tensor(global_batch_size, dtype=loss_mat.dtype, device=loss_mat.device).clamp(min=1)

    seq_sums = masked_sum(loss_mat, mask, dim=-1)  # [B]
    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = seq_sums / token_counts.clamp(min=1)
    else:
        seq_losses = seq_sums
    zero = torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device)
    loss = torch.where(seq_valid, seq_losses, zero).sum() / seq_denom * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        if loss_scale_factor is None:
            loss_scale_factor = loss_mat.shape[-1]
        loss = loss / check_positive("loss_scale_factor", loss_scale_factor)
    return loss
