"""Policy losses (``actor.policy_loss.loss_mode``), the clipped value loss and entropy.

A policy loss takes keyword arguments ``old_log_prob``, ``log_prob``, ``advantages``,
``response_mask`` (all [B, T]) plus hyperparameters named after the actor config keys, and
``sample_weight`` [B] (optional: a ``verl.WeightedFilterOperator``'s per-sample weights, scaling
each sequence's losses inside ``agg_loss``), returns ``(loss, metrics)``: a scalar to back-propagate (aggregated by ``agg_loss``, so pass
``global_batch_info`` under micro-batching) and a dict of detached 0-dim tensors
``pg_clipfrac``, ``ppo_kl``, ``pg_clipfrac_lower`` (the reference logs them as
``actor/pg_clipfrac`` etc.; the metrics are local masked means over this micro-batch).

Departures from the reference verl, all on inputs where it gives NaN or asserts: the masked
entries of the inputs are replaced by 0 before anything is computed (a ``-inf`` log-prob in
padding reaches neither the loss nor the gradients), bad hyperparameters are ValueErrors, and
the loss and metrics of an all-masked micro-batch are 0. ``clip_ratio_low``/``clip_ratio_high`` default to ``clip_ratio`` when None, as there.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from verl.algos.aggregation import GlobalBatchInfo, agg_loss
from verl.algos.checks import check_mask, check_positive, check_token_level
from verl.algos.masked import masked_mean
from verl.algos.registry import Registry, call_with_accepted
from verl.utils.logging import warn_once

logger = logging.getLogger(__name__)

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]

POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss", "actor.policy_loss.loss_mode")
register_policy_loss = POLICY_LOSSES.register

# log(ratio) is clamped to this range before exp() so one wild token cannot overflow the loss.
_LOG_RATIO_BOUND = 20.0


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered as ``name`` (ValueError listing the registered names otherwise)."""
    return POLICY_LOSSES.get(name)


def list_policy_losses() -> list[str]:
    """Names accepted by ``actor.policy_loss.loss_mode``."""
    return POLICY_LOSSES.names()


def compute_policy_loss(name: str, **inputs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run policy loss ``name`` with the subset of ``inputs`` it takes (see ``compute_advantage``)."""
    return call_with_accepted(get_policy_loss(name), f"policy loss {name!r}", inputs)


def _inputs(
    old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate, and zero the masked entries of the inputs (not only of the loss).

    Masking the loss alone is not enough: a -inf log-prob in padding makes exp() or the
    difference NaN there, and backward multiplies that NaN by the zero gradient of the masked
    branch, poisoning the model's gradients. Returns (old_log_prob, log_prob, advantages, mask).
    """
    check_token_level("log_prob", log_prob)
    check_token_level("old_log_prob", old_log_prob, like=log_prob)
    check_token_level("advantages", advantages, like=log_prob)
    mask = check_mask("response_mask", response_mask, log_prob.shape, log_prob.dtype)
    valid = mask != 0
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    return (
        torch.where(valid, old_log_prob, zero),
        torch.where(valid, log_prob, zero),
        torch.where(valid, advantages, zero),
        mask,
    )


def _clip_range(
    clip_ratio: float, clip_ratio_low: float | None, clip_ratio_high: float | None
) -> tuple[float, float]:
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    low = check_positive("actor.clip_ratio_low", low, allow_zero=True)
    high = check_positive("actor.clip_ratio_high", high, allow_zero=True)
    return low, high


def _metrics(clipfrac: torch.Tensor, ppo_kl: torch.Tensor, clipfrac_lower: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        "pg_clipfrac": clipfrac.detach(),
        "ppo_kl": ppo_kl.detach(),
        "pg_clipfrac_lower": clipfrac_lower.detach(),
    }


def _weighted(pg_losses: torch.Tensor, rollout_is_weights: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
    if rollout_is_weights is None:
        return pg_losses
    check_token_level("rollout_is_weights", rollout_is_weights, like=pg_losses)
    zero = torch.zeros((), dtype=pg_losses.dtype, device=pg_losses.device)
    weights = torch.where(mask != 0, rollout_is_weights.detach(), zero)
    return pg_losses * weights


@register_policy_loss("vanilla")
def vanilla(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    global_batch_info: GlobalBatchInfo | None = None,
    loss_scale_factor: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    sample_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (arXiv:1707.06347) with clip-higher (DAPO) and dual-clip (arXiv:1912.09729).

    ratio = exp(clamp(log_prob - old_log_prob, -20, 20)) [B, T];
    L1 = -A * ratio, L2 = -A * clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high),
    L = max(L1, L2); for A < 0 the loss is further capped at -A * clip_ratio_c (> 1).
    Metrics: pg_clipfrac = share of valid tokens where L2 > L1; pg_clipfrac_lower = share where
    the dual clip bound is active (A < 0); ppo_kl = masked mean of old_log_prob - log_prob.
    ``rollout_is_weights`` [B, T] (optional, detached) scale the per-token losses.
    """
    old_log_prob, log_prob, advantages, mask = _inputs(old_log_prob, log_prob, advantages, response_mask)
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    if not clip_ratio_c > 1.0:
        raise ValueError(f"actor.clip_ratio_c (dual-clip lower bound) must be > 1.0, got {clip_ratio_c}")

    neg_kl = torch.clamp(log_prob - old_log_prob, min=-_LOG_RATIO_BOUND, max=_LOG_RATIO_BOUND)
    ratio = torch.exp(neg_kl)
    ppo_kl = masked_mean(-neg_kl, mask)

    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    clipped = torch.maximum(loss1, loss2)
    clipfrac = masked_mean((loss2 > loss1).to(log_prob.dtype), mask)

    loss3 = -advantages * clip_ratio_c
    dual = torch.minimum(loss3, clipped)
    negative = advantages < 0
    clipfrac_lower = masked_mean(((clipped > loss3) & negative).to(log_prob.dtype), mask)

    pg_losses = _weighted(torch.where(negative, dual, clipped), rollout_is_weights, mask)
    loss = agg_loss(
        pg_losses, mask, loss_agg_mode, global_batch_info=global_batch_info, loss_scale_factor=loss_scale_factor,
        sample_weight=sample_weight,
    )
    return loss, _metrics(clipfrac, ppo_kl, clipfrac_lower)


@register_policy_loss("gspo")
def gspo(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    global_batch_info: GlobalBatchInfo | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    sample_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Group Sequence Policy Optimization (arXiv:2507.18071): a sequence-level importance ratio.

    s_i = exp(mean over valid t of (log_prob - old_log_prob)) is the length-normalised sequence
    ratio; each token uses s_i,t = sg[s_i] * pi(t) / sg[pi(t)] (same value as s_i, gradient of
    log_prob per token), with log s_i,t clamped at 10. The PPO clip is applied to s_i,t, and the
    loss is always aggregated with ``seq-mean-token-mean`` as in the reference (another
    ``loss_agg_mode`` is ignored with a warning). pg_clipfrac_lower is 0.

    GSPO's clip ranges are much tighter than PPO's (the paper uses 3e-4 / 4e-4).
    """
    old_log_prob, log_prob, advantages, mask = _inputs(old_log_prob, log_prob, advantages, response_mask)
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    if loss_agg_mode != "seq-mean-token-mean":
        warn_once(logger, "gspo always aggregates with seq-mean-token-mean; loss_agg_mode=%s is ignored", loss_agg_mode)

    neg_kl = log_prob - old_log_prob  # [B, T]
    seq_neg_kl = masked_mean(neg_kl, mask, dim=-1)  # [B]
    log_seq_ratio = log_prob - log_prob.detach() + seq_neg_kl.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(log_seq_ratio, max=10.0))

    loss1 = -advantages * seq_ratio
    loss2 = -advantages * torch.clamp(seq_ratio, 1.0 - low, 1.0 + high)
    pg_losses = _weighted(torch.maximum(loss1, loss2), rollout_is_weights, mask)
    loss = agg_loss(
        pg_losses, mask, "seq-mean-token-mean", global_batch_info=global_batch_info, sample_weight=sample_weight
    )

    clipfrac = masked_mean((loss2 > loss1).to(log_prob.dtype), mask)
    ppo_kl = masked_mean(-neg_kl, mask)
    return loss, _metrics(clipfrac, ppo_kl, torch.zeros((), dtype=log_prob.dtype, device=log_prob.device))


@register_policy_loss("cispo")
def cispo(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    global_batch_info: GlobalBatchInfo | None = None,
    loss_scale_factor: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    sample_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv:2506.13585).

    loss_t = -sg[clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)] * A * log_prob: the
    importance weight is clipped and detached, so every token keeps a REINFORCE gradient
    (PPO's clip would zero it). ratio = exp(clamp(log_prob - old_log_prob, -20, 20)).
    pg_clipfrac = share of valid tokens whose weight was clipped; pg_clipfrac_lower is 0.
    """
    old_log_prob, log_prob, advantages, mask = _inputs(old_log_prob, log_prob, advantages, response_mask)
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)

    neg_kl = torch.clamp(log_prob - old_log_prob, min=-_LOG_RATIO_BOUND, max=_LOG_RATIO_BOUND)
    ratio = torch.exp(neg_kl)
    ppo_kl = masked_mean(-neg_kl, mask)
    weight = torch.clamp(ratio, 1.0 - low, 1.0 + high)
    clipfrac = masked_mean((ratio != weight).to(log_prob.dtype), mask)

    pg_losses = _weighted(-weight.detach() * advantages * log_prob, rollout_is_weights, mask)
    loss = agg_loss(
        pg_losses, mask, loss_agg_mode, global_batch_info=global_batch_info, loss_scale_factor=loss_scale_factor,
        sample_weight=sample_weight,
    )
    return loss, _metrics(clipfrac, ppo_kl, torch.zeros((), dtype=log_prob.dtype, device=log_prob.device))


@register_policy_loss("gpg")
def gpg(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    global_batch_info: GlobalBatchInfo | None = None,
    loss_scale_factor: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    sample_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Group Policy Gradient (arXiv:2504.02546): plain policy gradient, loss_t = -A * log_prob.

    No ratio, no clipping: pg_clipfrac and pg_clipfrac_lower are 0. ppo_kl is still reported
    (masked mean of old_log_prob - log_prob) to watch drift; the reference reports nothing.
    """
    old_log_prob, log_prob, advantages, mask = _inputs(old_log_prob, log_prob, advantages, response_mask)
    pg_losses = _weighted(-advantages * log_prob, rollout_is_weights, mask)
    loss = agg_loss(
        pg_losses, mask, loss_agg_mode, global_batch_info=global_batch_info, loss_scale_factor=loss_scale_factor,
        sample_weight=sample_weight,
    )
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    ppo_kl = masked_mean((old_log_prob - log_prob).detach(), mask)
    return loss, _metrics(zero, ppo_kl, zero)


# ----------------------------------------------------------------------------------------------
# value loss and entropy


def compute_value_loss(
    *,
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    global_batch_info: GlobalBatchInfo | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (PPO): 0.5 * agg(max((V - R)^2, (clip(V, V_old +- eps) - R)^2)).

    vpreds: new critic values [B, T]; values: the critic's values at rollout time [B, T];
    returns: targets [B, T]; cliprange_value: eps (``critic.cliprange_value``).
    Returns (loss, vf_clipfrac): the share of valid tokens where the clipped term was larger.
    """
    check_token_level("vpreds", vpreds)
    check_token_level("returns", returns, like=vpreds)
    check_token_level("values", values, like=vpreds)
    mask = check_mask("response_mask", response_mask, vpreds.shape, vpreds.dtype)
    eps = check_positive("critic.cliprange_value", cliprange_value, allow_zero=True)
    valid = mask != 0
    zero = torch.zeros((), dtype=vpreds.dtype, device=vpreds.device)
    # zero the padding of the inputs, not only of the loss, so NaN there cannot reach the gradients
    vpreds, returns, values = (torch.where(valid, t, zero) for t in (vpreds, returns, values))
    clipped_pred = torch.maximum(torch.minimum(vpreds, values + eps), values - eps)
    loss1 = (vpreds - returns) ** 2
    loss2 = (clipped_pred - returns) ** 2
    loss = 0.5 * agg_loss(
        torch.maximum(loss1, loss2),
        mask,
        loss_agg_mode,
        global_batch_info=global_batch_info,
        loss_scale_factor=loss_scale_factor,
    )
    clipfrac = masked_mean((loss2 > loss1).to(vpreds.dtype), mask).detach()
    return loss, clipfrac


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: [..., V] -> [...].

    H = logsumexp(z) - sum_v p_v z_v. Vocabulary entries at -inf (masked out) have p = 0 and
    contribute 0 here, where the reference's p * z gives NaN.
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point tensor [..., V], got {getattr(logits, 'dtype', type(logits))}")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have a non-empty vocabulary dim, got shape {tuple(logits.shape)}")
    probs = torch.softmax(logits, dim=-1)
    weighted = torch.where(probs > 0, probs * logits, torch.zeros((), dtype=logits.dtype, device=logits.device))
    return torch.logsumexp(logits, dim=-1) - weighted.sum(dim=-1)


def compute_entropy_loss(
    *,
    logits: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    global_batch_info: GlobalBatchInfo | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregated token entropy of ``logits`` [B, T, V] under ``response_mask`` [B, T] (a scalar).

    The actor subtracts ``entropy_coeff`` times this from its loss to encourage exploration.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(getattr(logits, 'shape', ()))}")
    ent = entropy_from_logits(logits)
    return agg_loss(
        ent, response_mask, loss_agg_mode, global_batch_info=global_batch_info, loss_scale_factor=loss_scale_factor
    )
