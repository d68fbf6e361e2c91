"""Per-token log-probabilities and entropy from vocabulary-parallel logits.

Each tensor-parallel rank holds logits for a contiguous slice of the (padded) vocabulary,
``[..., V/TP]``. The full distribution is never materialised on any rank: the softmax is
computed from three all-reduces over the TP group, each of a tensor with one number per token
(the max, the sum of exponentials, and the target logit / the expected logit for entropy).

Columns at or past ``vocab_size`` (padding added at the vocabulary's end so it splits evenly)
are left out of every pass: they get probability exactly 0, never count in the entropy and
receive zero gradient.

Both quantities come from one autograd Function with an analytic, communication-free backward:

- d logp(y) / d z_j = 1[j = y] - p_j
- d H / d z_j = -p_j (z_j - E_p[z])          (H = -sum_j p_j log p_j)

With a :class:`SamplingTruncation` (the rollout sampled with top-k / top-p) the softmax runs over the
tokens the sampler kept only (:func:`truncation_mask`), so the log-probabilities are those of the
distribution the engine drew from; the dropped tokens get probability 0 and zero gradient, the mask
itself is a constant of the pass (as it is for the sampler).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, kw_only=True)
class SamplingTruncation:
    """The rollout sampler's top-k / top-p truncation, replayed by the trainer's log-prob passes
    (``actor_rollout_ref.actor.replay_sampling_mask``)."""

    top_k: int
    """Keep the ``top_k`` largest logits (ties with the k-th kept); <= 0: off."""
    top_p: float
    """Then keep the smallest set of most probable tokens whose mass reaches ``top_p``; 1: off."""

    @property
    def active(self) -> bool:
        """Whether anything is truncated."""
        return self.top_k > 0 or self.top_p < 1.0


@torch.no_grad()
def truncation_mask(z: torch.Tensor, truncation: SamplingTruncation) -> torch.Tensor:
    """Which tokens the sampler keeps: bool [N, V] from the temperature-scaled float32 logits ``z`` [N, V]
    over the whole vocabulary (padding columns already -inf).

    The rule of both engines' samplers (transformers' top-k then top-p warpers, vLLM's
    ``apply_top_k_top_p``), step for step so the same logits give the same mask bit for bit: top-k
    drops every logit below the k-th largest; top-p sorts the survivors ascending, takes the cumulative
    sum of their softmax and drops those whose cumulative mass is <= 1 - top_p, always keeping the
    largest. The most probable token is always kept.
    """
    keep = torch.isfinite(z)
    if truncation.top_k > 0 and truncation.top_k < z.shape[-1]:
        kth = z.topk(truncation.top_k, dim=-1).values[:, -1:]  # [N, 1]
        keep &= z >= kth
    if truncation.top_p < 1.0:
        masked = z.masked_fill(~keep, float("-inf"))
        sorted_z, order = masked.sort(dim=-1, descending=False)
        cumulative = sorted_z.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= 1.0 - truncation.top_p
        drop_sorted[:, -1] = False
        keep &= ~drop_sorted.scatter(-1, order, drop_sorted)
    return keep


# Rows of the mask computed at once: its sort holds ~5 full-vocabulary tensors per row (values, the
# int64 order, cumulative sums), so a long micro-batch is cut into pieces of about this many elements.
_MASK_CHUNK_ELEMENTS = 2**24


@torch.no_grad()
def _local_truncation_mask(
    z: torch.Tensor, truncation: SamplingTruncation, vocab_start: int, vocab_size: int, v_local: int,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """This rank's columns ``z`` [N, n_valid] of :func:`truncation_mask` over the full vocabulary. Under
    tensor parallelism the top-k / top-p boundary depends on every rank's logits: the slices are
    all-gathered (float32, no gradient; a piece of [rows, V] on each rank for the mask only) and each
    rank keeps its part. Every rank of ``group`` cuts the same row pieces (N is the same on all)."""
    n, n_valid = z.shape
    tp = 1 if group is None else dist.get_world_size(group)
    keep = torch.empty((n, n_valid), dtype=torch.bool, device=z.device)
    step = max(1, _MASK_CHUNK_ELEMENTS // max(vocab_size, 1))
    for r0 in range(0, n, step):
        piece = z[r0 : r0 + step]
        if tp == 1:
            keep[r0 : r0 + step] = truncation_mask(piece, truncation)
            continue
        padded = torch.full((len(piece), v_local), float("-inf"), dtype=torch.float32, device=z.device)
        padded[:, :n_valid] = piece
        parts = [torch.empty_like(padded) for _ in range(tp)]
        dist.all_gather(parts, padded, group=group)
        full = torch.cat(parts, dim=-1)[:, :vocab_size]  # [rows, V]
        keep[r0 : r0 + step] = truncation_mask(full, truncation)[:, vocab_start : vocab_start + n_valid]
    return keep


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, group, with_entropy, truncation):
        # logits [N, V_local] (any float dtype), target [N] global token ids. Megatron pads the
        # vocabulary at its end: this rank's columns past vocab_size are padding, which gets
        # probability 0, so they are left out of every pass (their gradient is 0).
        n, v_local = logits.shape
        n_valid = max(0, min(v_local, vocab_size - vocab_start))
        z = logits[:, :n_valid].float()  # [N, n_valid]
        dropped = None
        if truncation is not None and truncation.active:
            keep = _local_truncation_mask(z, truncation, vocab_start, vocab_size, v_local, group)
            # The sampled token was in the engine's kept set; where the trainer's logits put it just past
            # the boundary (logits that differ in the last bits), keep it rather than give it log(0).
            mine = ((target >= vocab_start) & (target < vocab_start + n_valid)).nonzero().squeeze(-1)
            keep[mine, target[mine] - vocab_start] = True
            dropped = ~keep
        if n_valid:
            zmax = z.max(dim=-1).values  # [N] (the most probable token is always kept)
        else:  # a rank holding only padding
            zmax = torch.full((n,), float("-inf"), dtype=torch.float32, device=logits.device)
        zmax = _all_reduce(zmax, dist.ReduceOp.MAX, group)
        shifted = z - zmax.unsqueeze(-1)  # [N, n_valid]
        probs = shifted.exp()
        if dropped is not None:  # probability 0; the shifted logit 0 so that 0 * it stays 0 (not 0 * -inf)
            probs.masked_fill_(dropped, 0.0)
            shifted.masked_fill_(dropped, 0.0)
        sum_exp = _all_reduce(probs.sum(dim=-1), dist.ReduceOp.SUM, group)  # [N]
        log_sum = sum_exp.log()
        probs.div_(sum_exp.unsqueeze(-1))  # [N, n_valid]: exp(shifted) / sum, in place

        in_range = (target >= vocab_start) & (target < vocab_start + n_valid)
        local_idx = (target - vocab_start).clamp(0, max(n_valid - 1, 0))
        if n_valid:
            target_shifted = shifted.gather(-1, local_idx.unsqueeze(-1)).squeeze(-1)
            target_shifted = torch.where(in_range, target_shifted, torch.zeros_like(target_shifted))
        else:
            target_shifted = torch.zeros_like(zmax)
        target_shifted = _all_reduce(target_shifted, dist.ReduceOp.SUM, group)
        logprob = target_shifted - log_sum  # [N]

        if with_entropy:
            expected = _all_reduce((probs * shifted).sum(dim=-1), dist.ReduceOp.SUM, group)  # E_p[z - max]
            entropy = log_sum - expected  # [N]
        else:
            expected = torch.zeros_like(logprob)
            entropy = torch.zeros_like(logprob)
        ctx.save_for_backward(probs, shifted, expected, in_range, local_idx)
        ctx.with_entropy = with_entropy
        ctx.logits_dtype = logits.dtype
        ctx.padding = v_local - n_valid
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        probs, shifted, expected, in_range, local_idx = ctx.saved_tensors
        grad = -probs * grad_logprob.unsqueeze(-1)
        if probs.shape[-1]:  # + grad_logprob at the target column (where this rank holds it)
            grad.scatter_add_(-1, local_idx.unsqueeze(-1), (in_range.to(probs.dtype) * grad_logprob).unsqueeze(-1))
        if ctx.with_entropy:
            grad = grad - grad_entropy.unsqueeze(-1) * probs * (shifted - expected.unsqueeze(-1))
        if ctx.padding:
            grad = torch.nn.functional.pad(grad, (0, ctx.padding))
        return grad.to(ctx.logits_dtype), None, None, None, None, None, None


def vocab_parallel_logprobs_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None,
    with_entropy: bool = True,
    truncation: SamplingTruncation | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of ``target`` and entropy of the full-vocabulary softmax, per token (of the
    sampler's truncated softmax with ``truncation``).

    Args:
        logits: this rank's vocabulary slice, [..., V_local].
        target: global token ids, [...].
        vocab_start: global id of this rank's first column (tp_rank * V_local).
        vocab_size: real vocabulary size; columns at or past it are padding.
        group: the tensor-parallel group (None or size 1: no communication).
        with_entropy: False returns zeros for entropy and skips its all-reduce.
        truncation: the rollout's top-k / top-p (None or inactive: the full vocabulary); ``logits`` must
            already be divided by the sampling temperature. ``target`` is always kept.

    Returns:
        (logprobs [...], entropy [...]) in float32, differentiable w.r.t. ``logits``.
    """
    lead = target.shape
    if logits.shape[:-1] != lead:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(lead)} disagree on leading dims")
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_target = target.reshape(-1).long()
    logprob, entropy = _VocabParallelLogprobEntropy.apply(
        flat_logits, flat_target, vocab_start, vocab_size, group, with_entropy, truncation
    )
    return logprob.reshape(lead), entropy.reshape(lead)


def _log_normaliser(z: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(max [N], log sum exp(z - max) [N]) of the full-vocabulary softmax from this rank's valid
    columns ``z`` [N, n_valid] (float32), two all-reduces over ``group``."""
    if z.shape[-1]:
        zmax = z.max(dim=-1).values
    else:  # a rank holding only padding
        zmax = torch.full(z.shape[:1], float("-inf"), dtype=torch.float32, device=z.device)
    zmax = _all_reduce(zmax, dist.ReduceOp.MAX, group)
    sum_exp = _all_reduce((z - zmax.unsqueeze(-1)).exp().sum(dim=-1), dist.ReduceOp.SUM, group)
    return zmax, sum_exp.log()


class _VocabParallelGatherLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ids, vocab_start, vocab_size, group):
        # logits [N, V_local], ids [N, k] global token ids below vocab_size. Padding columns are left
        # out as in _VocabParallelLogprobEntropy (probability 0, gradient 0).
        n, v_local = logits.shape
        n_valid = max(0, min(v_local, vocab_size - vocab_start))
        z = logits[:, :n_valid].float()  # [N, n_valid]
        zmax, log_sum = _log_normaliser(z, group)
        shifted = z - zmax.unsqueeze(-1)
        in_range = (ids >= vocab_start) & (ids < vocab_start + n_valid)  # [N, k]
        local_idx = (ids - vocab_start).clamp(0, max(n_valid - 1, 0))
        if n_valid:
            picked = torch.where(in_range, shifted.gather(-1, local_idx), torch.zeros((), device=z.device))
        else:
            picked = torch.zeros(ids.shape, dtype=torch.float32, device=logits.device)
        picked = _all_reduce(picked, dist.ReduceOp.SUM, group)  # each id is on exactly one rank
        logprob = picked - log_sum.unsqueeze(-1)  # [N, k]
        probs = (shifted - log_sum.unsqueeze(-1)).exp()  # [N, n_valid]
        ctx.save_for_backward(probs, in_range, local_idx)
        ctx.logits_dtype = logits.dtype
        ctx.padding = v_local - n_valid
        return logprob

    @staticmethod
    def backward(ctx, grad_logprob):
        # d logp(id_i) / d z_j = 1[j = id_i] - p_j, summed over the k ids: communication-free.
        probs, in_range, local_idx = ctx.saved_tensors
        grad = -probs * grad_logprob.sum(dim=-1, keepdim=True)
        if probs.shape[-1]:
            grad.scatter_add_(-1, local_idx, in_range.to(probs.dtype) * grad_logprob)
        if ctx.padding:
            grad = torch.nn.functional.pad(grad, (0, ctx.padding))
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_gather_logprobs(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Full-vocabulary log-probabilities of several token ids per position (the student's side of a
    top-k distillation loss), without gathering the vocabulary.

    Args:
        logits: this rank's vocabulary slice, [..., V_local].
        ids: global token ids below ``vocab_size``, [..., k].
        vocab_start, vocab_size, group: as :func:`vocab_parallel_logprobs_entropy`.

    Returns:
        log p(ids) [..., k] in float32, differentiable w.r.t. ``logits`` (analytic backward, no
        communication).
    """
    lead = ids.shape[:-1]
    if logits.shape[:-1] != lead:
        raise ValueError(f"logits {tuple(logits.shape)} and ids {tuple(ids.shape)} disagree on leading dims")
    k = ids.shape[-1]
    flat = _VocabParallelGatherLogprobs.apply(
        logits.reshape(-1, logits.shape[-1]), ids.reshape(-1, k).long(), vocab_start, vocab_size, group
    )
    return flat.reshape(*lead, k)


@torch.no_grad()
def vocab_parallel_topk(
    logits: torch.Tensor,
    k: int,
    *,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most probable token ids per position and their full-vocabulary log-probabilities
    (the teacher's side of a top-k distillation loss), without gathering the vocabulary.

    Each rank takes the top-k of its valid columns (padding columns at or past ``vocab_size`` are
    never candidates), the candidates ([N, k] ids and logits per rank) are gathered over ``group``,
    and the global top-k is taken from them: the k largest logits overall are among the union of
    every rank's k largest. Ties are broken toward the smaller id, so the result does not depend on
    the TP split. Log-probabilities are normalised over the whole vocabulary (two all-reduces).

    Args:
        logits: this rank's vocabulary slice, [..., V_local].
        k: how many ids, at most ``vocab_size``.
        vocab_start, vocab_size, group: as :func:`vocab_parallel_logprobs_entropy`.

    Returns:
        (ids [..., k] int64, logprobs [..., k] float32), most probable first; no gradient.
    """
    if not 1 <= k <= vocab_size:
        raise ValueError(f"top-k with k={k} over a vocabulary of {vocab_size}: k must be in [1, vocab_size]")
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    n, v_local = flat.shape
    n_valid = max(0, min(v_local, vocab_size - vocab_start))
    z = flat[:, :n_valid].float()  # [N, n_valid]
    zmax, log_sum = _log_normaliser(z, group)
    local_k = min(k, n_valid)
    values = torch.full((n, k), float("-inf"), dtype=torch.float32, device=flat.device)
    ids = torch.full((n, k), vocab_size, dtype=torch.long, device=flat.device)  # never chosen over a real id
    if local_k:
        top = z.topk(local_k, dim=-1)
        picked, cols = top.values, top.indices  # [N, local_k]
        # torch.topk's choice among values equal to the k-th is unspecified: where a row has more of
        # them than it picked, pick the smallest ids among them (every value above, then the first equal).
        kth = picked[:, -1:]
        ambiguous = ((z == kth).sum(dim=-1) > (picked == kth).sum(dim=-1)).nonzero().squeeze(-1)
        if ambiguous.numel():
            zr, kr = z[ambiguous], kth[ambiguous]
            above, tied = zr > kr, zr == kr
            room = local_k - above.sum(dim=-1, keepdim=True)
            pick = above | (tied & (tied.to(torch.int32).cumsum(dim=-1, dtype=torch.int32) <= room))
            fixed = pick.nonzero()[:, 1].view(-1, local_k)  # row-major: each row's local_k columns
            cols[ambiguous], picked[ambiguous] = fixed, zr.gather(-1, fixed)
        values[:, :local_k] = picked
        ids[:, :local_k] = cols + vocab_start
    if group is not None and dist.get_world_size(group) > 1:
        size = dist.get_world_size(group)
        gathered_values = [torch.empty_like(values) for _ in range(size)]
        gathered_ids = [torch.empty_like(ids) for _ in range(size)]
        dist.all_gather(gathered_values, values, group=group)
        dist.all_gather(gathered_ids, ids, group=group)
        values, ids = torch.cat(gathered_values, dim=-1), torch.cat(gathered_ids, dim=-1)  # [N, size * k]
    # Largest logit first, the smaller id first among equal logits: sort by id, then stably by value.
    by_id = ids.argsort(dim=-1)
    values, ids = values.gather(-1, by_id), ids.gather(-1, by_id)
    by_value = values.argsort(dim=-1, descending=True, stable=True)[:, :k]
    values, ids = values.gather(-1, by_value), ids.gather(-1, by_value)
    logprobs = values - zmax.unsqueeze(-1) - log_sum.unsqueeze(-1)
    return ids.reshape(*lead, k), logprobs.reshape(*lead, k)
