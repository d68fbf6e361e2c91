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
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, group, with_entropy):
        # logits [N, V_local] (any float dtype), target [N] global token ids. Megatron pads the
        # vocabulary at its end: this rank's columns past vocab_size are padding, which gets
        # probability 0, so they are left out of every pass (their gradient is 0).
        n, v_local = logits.shape
        n_valid = max(0, min(v_local, vocab_size - vocab_start))
        z = logits[:, :n_valid].float()  # [N, n_valid]
        if n_valid:
            zmax = z.max(dim=-1).values  # [N]
        else:  # a rank holding only padding
            zmax = torch.full((n,), float("-inf"), dtype=torch.float32, device=logits.device)
        zmax = _all_reduce(zmax, dist.ReduceOp.MAX, group)
        shifted = z - zmax.unsqueeze(-1)  # [N, n_valid]
        probs = shifted.exp()
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
        return grad.to(ctx.logits_dtype), None, None, None, None, None


def vocab_parallel_logprobs_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of ``target`` and entropy of the full-vocabulary softmax, per token.

    Args:
        logits: this rank's vocabulary slice, [..., V_local].
        target: global token ids, [...].
        vocab_start: global id of this rank's first column (tp_rank * V_local).
        vocab_size: real vocabulary size; columns at or past it are padding.
        group: the tensor-parallel group (None or size 1: no communication).
        with_entropy: False returns zeros for entropy and skips its all-reduce.

    Returns:
        (logprobs [...], entropy [...]) in float32, differentiable w.r.t. ``logits``.
    """
    lead = target.shape
    if logits.shape[:-1] != lead:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(lead)} disagree on leading dims")
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_target = target.reshape(-1).long()
    logprob, entropy = _VocabParallelLogprobEntropy.apply(
        flat_logits, flat_target, vocab_start, vocab_size, group, with_entropy
    )
    return logprob.reshape(lead), entropy.reshape(lead)
