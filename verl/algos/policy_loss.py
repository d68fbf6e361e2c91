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
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, NamedTuple

import torch

from verl.algos.aggregation import GlobalBatchInfo, agg_loss
from verl.algos.checks import check_mask, check_positive, check_token_level
from verl.algos.masked import masked_mean, masked_sum
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


def _zero_like(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=t.dtype, device=t.device)


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


class _Agg(NamedTuple):
    """A loss's arguments for ``agg_loss``, and the token weights applied before it."""

    loss_agg_mode: str
    global_batch_info: GlobalBatchInfo | None
    loss_scale_factor: float | None
    rollout_is_weights: torch.Tensor | None  # [B, T]
    sample_weight: torch.Tensor | None  # [B]


@dataclass(frozen=True)
class _Prologue:
    """What a policy loss starts from (built by ``_prologue``), and the steps shared after its formula."""

    old_log_prob: torch.Tensor  # [B, T], padding zeroed
    log_prob: torch.Tensor  # [B, T], padding zeroed
    advantages: torch.Tensor  # [B, T], padding zeroed
    mask: torch.Tensor  # [B, T]
    low: float  # the clip range is [1 - low, 1 + high]; both 0 for a loss without one
    high: float
    agg: _Agg

    # computed on first read, once: only the losses that read them pay for them
    @cached_property
    def neg_kl(self) -> torch.Tensor:
        """log(ratio) = log_prob - old_log_prob [B, T], clamped to +-_LOG_RATIO_BOUND."""
        return torch.clamp(self.log_prob - self.old_log_prob, min=-_LOG_RATIO_BOUND, max=_LOG_RATIO_BOUND)

    @cached_property
    def ratio(self) -> torch.Tensor:
        return torch.exp(self.neg_kl)  # [B, T]

    @cached_property
    def ppo_kl(self) -> torch.Tensor:
        """The ppo_kl metric of most losses: the masked mean of -neg_kl (a scalar)."""
        return masked_mean(-self.neg_kl, self.mask)

    @cached_property
    def zero(self) -> torch.Tensor:
        return _zero_like(self.log_prob)

    def ppo_clip(self, ratio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """PPO's two surrogates -A * r and -A * clamp(r, 1 - low, 1 + high) [B, T] for ``ratio`` r [B, T]."""
        clipped = torch.clamp(ratio, 1.0 - self.low, 1.0 + self.high)
        return -self.advantages * ratio, -self.advantages * clipped

    def finish(
        self,
        pg_losses: torch.Tensor,
        ppo_kl: torch.Tensor,
        clipfrac: torch.Tensor | None = None,
        clipfrac_lower: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss, metrics): ``pg_losses`` [B, T] weighted and aggregated as ``agg`` says; a clip share
        left None is 0."""
        agg = self.agg
        loss = agg_loss(
            _weighted(pg_losses, agg.rollout_is_weights, self.mask), self.mask, agg.loss_agg_mode,
            global_batch_info=agg.global_batch_info, loss_scale_factor=agg.loss_scale_factor,
            sample_weight=agg.sample_weight,
        )
        zero = self.zero
        return loss, _metrics(
            zero if clipfrac is None else clipfrac, ppo_kl, zero if clipfrac_lower is None else clipfrac_lower
        )


def _prologue(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    agg: _Agg,
    clip: tuple[float, float | None, float | None] | None = None,
) -> _Prologue:
    """The inputs checked and their padding zeroed (``_inputs``), then ``clip`` = (clip_ratio,
    clip_ratio_low, clip_ratio_high) resolved to (low, high) and checked (``_clip_range``).

    Every loss starts here, so a bad input or clip range is refused before any loss's own checks.
    """
    old_log_prob, log_prob, advantages, mask = _inputs(old_log_prob, log_prob, advantages, response_mask)
    low, high = (0.0, 0.0) if clip is None else _clip_range(*clip)
    return _Prologue(old_log_prob, log_prob, advantages, mask, low, high, agg)


def _ignored_agg_mode(loss_agg_mode: str, why: str) -> None:
    if loss_agg_mode != "seq-mean-token-mean":
        warn_once(logger, "%s; loss_agg_mode=%s is ignored", why, loss_agg_mode)


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
    x = _prologue(
        old_log_prob, log_prob, advantages, response_mask, clip=(clip_ratio, clip_ratio_low, clip_ratio_high),
        agg=_Agg(loss_agg_mode, global_batch_info, loss_scale_factor, rollout_is_weights, sample_weight),
    )
    if not clip_ratio_c > 1.0:
        raise ValueError(f"actor.clip_ratio_c (dual-clip lower bound) must be > 1.0, got {clip_ratio_c}")

    loss1, loss2 = x.ppo_clip(x.ratio)
    clipped = torch.maximum(loss1, loss2)
    clipfrac = masked_mean((loss2 > loss1).to(x.log_prob.dtype), x.mask)

    loss3 = -x.advantages * clip_ratio_c
    dual = torch.minimum(loss3, clipped)
    negative = x.advantages < 0
    clipfrac_lower = masked_mean(((clipped > loss3) & negative).to(x.log_prob.dtype), x.mask)
    return x.finish(torch.where(negative, dual, clipped), x.ppo_kl, clipfrac, clipfrac_lower)


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
    x = _prologue(
        old_log_prob, log_prob, advantages, response_mask, clip=(clip_ratio, clip_ratio_low, clip_ratio_high),
        agg=_Agg("seq-mean-token-mean", global_batch_info, None, rollout_is_weights, sample_weight),
    )
    _ignored_agg_mode(loss_agg_mode, "gspo always aggregates with seq-mean-token-mean")

    neg_kl = x.log_prob - x.old_log_prob  # [B, T], unclamped: the sequence mean is clamped below
    seq_neg_kl = masked_mean(neg_kl, x.mask, dim=-1)  # [B]
    log_seq_ratio = x.log_prob - x.log_prob.detach() + seq_neg_kl.detach().unsqueeze(-1)
    loss1, loss2 = x.ppo_clip(torch.exp(torch.clamp(log_seq_ratio, max=10.0)))
    clipfrac = masked_mean((loss2 > loss1).to(x.log_prob.dtype), x.mask)
    return x.finish(torch.maximum(loss1, loss2), masked_mean(-neg_kl, x.mask), clipfrac)


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
    x = _prologue(
        old_log_prob, log_prob, advantages, response_mask, clip=(clip_ratio, clip_ratio_low, clip_ratio_high),
        agg=_Agg(loss_agg_mode, global_batch_info, loss_scale_factor, rollout_is_weights, sample_weight),
    )
    weight = torch.clamp(x.ratio, 1.0 - x.low, 1.0 + x.high)
    clipfrac = masked_mean((x.ratio != weight).to(x.log_prob.dtype), x.mask)
    return x.finish(-weight.detach() * x.advantages * x.log_prob, x.ppo_kl, clipfrac)


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
    x = _prologue(
        old_log_prob, log_prob, advantages, response_mask,
        agg=_Agg(loss_agg_mode, global_batch_info, loss_scale_factor, rollout_is_weights, sample_weight),
    )
    return x.finish(-x.advantages * x.log_prob, masked_mean(x.old_log_prob - x.log_prob, x.mask))


@register_policy_loss("sapo")
def sapo(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    global_batch_info: GlobalBatchInfo | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    sample_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Soft Adaptive Policy Optimization, SAPO (arXiv:2511.20347): a smooth gate instead of a hard clip.

    ratio r = exp(clamp(log_prob - old_log_prob, -20, 20)) [B, T]; loss_t = -f(r_t; tau_t) * A_t with
    f(r; tau) = sigmoid(tau * (r - 1)) * 4 / tau, tau_t = ``tau_pos`` where A_t > 0 and ``tau_neg``
    otherwise (``actor.tau_pos`` / ``actor.tau_neg``). f(1) = 2 / tau and f'(1) = 1, so near r = 1 the
    gradient is the policy gradient's, and it fades smoothly as r leaves 1 instead of dropping to 0
    at a clip edge. Aggregated with ``seq-mean-token-mean`` always, as the paper's objective and the
    reference do (another ``loss_agg_mode`` is ignored with a warning). Reference and paper agree
    except for the reference's clamp of log r at +-20, which we keep. pg_clipfrac and
    pg_clipfrac_lower are 0 (nothing is clipped).
    """
    x = _prologue(
        old_log_prob, log_prob, advantages, response_mask,
        agg=_Agg("seq-mean-token-mean", global_batch_info, None, rollout_is_weights, sample_weight),
    )
    tau_pos = check_positive("actor.tau_pos", tau_pos)
    tau_neg = check_positive("actor.tau_neg", tau_neg)
    _ignored_agg_mode(loss_agg_mode, "sapo always aggregates with seq-mean-token-mean")
    ratio = x.ratio
    tau = torch.where(
        x.advantages > 0,
        torch.as_tensor(tau_pos, dtype=ratio.dtype, device=ratio.device),
        torch.as_tensor(tau_neg, dtype=ratio.dtype, device=ratio.device),
    )
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return x.finish(-gate * x.advantages, x.ppo_kl)


@register_policy_loss("geo_mean")
def geo_mean(
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
    """Geometric-Mean Policy Optimization, GMPO (Zhao et al. 2025, arXiv:2507.20673).

    Per token, d_t = log_prob - old_log_prob (clamped at +-20) is clipped in LOG space to
    [-clip_ratio_low, clip_ratio_high] on the side that PPO would clip (the upper side where
    A_t > 0, the lower side where A_t < 0): d'_t = sign(A) * min(sign(A) * d_t, sign(A) * clip(d_t)).
    Each sequence's ratio is the geometric mean of its token ratios, R_i = exp(mean_t d'_t), its
    advantage the mean of its token advantages A_i, and loss_i = -A_i * R_i [B]; the loss is the
    mean of loss_i over the sequences of the mini-batch (``loss_agg_mode`` is ignored with a
    warning). ``rollout_is_weights`` enter per sequence as the geometric mean of the token weights.

    The paper clips the ratio to (e^-eps_low, e^eps_high) with eps = 0.4; as in the reference, the
    clip ranges here are those log-space bounds, so ``clip_ratio=0.4`` is the paper's setting (the
    default 0.2 is narrower). Departure from the reference: it averages loss_i over the rows of each
    micro-batch (empty rows included) without the global batch's denominators, so its gradient
    changes with the micro-batch size; here the denominator is the number of non-empty sequences
    of the whole mini-batch (``global_batch_info``), the same number for one micro-batch without
    empty rows. Metrics: pg_clipfrac / pg_clipfrac_lower = share of valid tokens whose d_t was
    clipped with A_t > 0 / A_t < 0.
    """
    # rollout_is_weights enter per sequence below, not per token as ``finish`` would apply them
    x = _prologue(
        old_log_prob, log_prob, advantages, response_mask, clip=(clip_ratio, clip_ratio_low, clip_ratio_high),
        agg=_Agg("seq-mean-token-mean", global_batch_info, None, None, sample_weight),
    )
    _ignored_agg_mode(loss_agg_mode, "geo_mean always averages per sequence")
    mask, advantages, neg_kl = x.mask, x.advantages, x.neg_kl  # [B, T]
    sign = torch.sign(advantages)
    clipped_kl = torch.clamp(neg_kl, -x.low, x.high)
    kept_kl = sign * torch.minimum(sign * neg_kl, sign * clipped_kl)
    lengths = mask.sum(dim=-1).clamp(min=1)  # [B]
    seq_ratio = torch.exp(masked_sum(kept_kl, mask, dim=-1) / lengths)  # [B]
    seq_adv = masked_sum(advantages, mask, dim=-1) / lengths  # [B]
    seq_loss = -seq_adv * seq_ratio  # [B]
    if rollout_is_weights is not None:
        check_token_level("rollout_is_weights", rollout_is_weights, like=x.log_prob)
        log_w = torch.log(rollout_is_weights.detach() + 1e-10)
        seq_loss = seq_loss * torch.exp(masked_sum(log_w, mask, dim=-1) / lengths)
    clipped = (neg_kl != clipped_kl).to(x.log_prob.dtype)
    clipfrac = masked_mean(clipped * (advantages > 0).to(x.log_prob.dtype), mask)
    clipfrac_lower = masked_mean(clipped * (advantages < 0).to(x.log_prob.dtype), mask)
    # each sequence's loss on every one of its valid tokens: the token mean is loss_i again
    return x.finish(seq_loss.unsqueeze(-1).expand_as(x.log_prob), x.ppo_kl, clipfrac, clipfrac_lower)


def _centred_product(advantages: torch.Tensor, log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(A - mean A) * (log_prob - mean log_prob) [B, T], means over the valid tokens, detached."""
    adv, lp = advantages.detach(), log_prob.detach()
    return (adv - masked_mean(adv, mask)) * (lp - masked_mean(lp, mask))


@register_policy_loss("clip_cov")
def clip_cov(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    global_batch_info: GlobalBatchInfo | None = None,
    loss_scale_factor: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    sample_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs", arXiv:2505.22617).

    The PPO clipped surrogate (no dual clip) max(-A r, -A clip(r, 1 - low, 1 + high)) [B, T], except
    that a few tokens get no gradient: among the valid tokens that PPO did not clip and whose
    centred product c_t = (A_t - mean A) * (log_prob_t - mean log_prob) lies strictly between
    ``clip_cov_lb`` and ``clip_cov_ub`` (means over this call's valid tokens), max(1,
    int(``clip_cov_ratio`` x valid tokens)) are drawn at random (torch's global generator) and their
    loss is set to 0. Those high-covariance tokens are what drives entropy collapse (the paper).

    The paper detaches the chosen tokens; the reference (followed here) zeroes their loss, which has
    the same gradient and a smaller loss value. Like the reference, the means and the count are
    those of the micro-batch, so which tokens are chosen depends on how the mini-batch is cut (the
    loss is not micro-batch invariant). log r is clamped at +-20 as in ``vanilla`` (the reference does
    not clamp here). pg_clipfrac = share of valid tokens chosen; pg_clipfrac_lower = 0.
    """
    x = _prologue(
        old_log_prob, log_prob, advantages, response_mask, clip=(clip_ratio, clip_ratio_low, clip_ratio_high),
        agg=_Agg(loss_agg_mode, global_batch_info, loss_scale_factor, rollout_is_weights, sample_weight),
    )
    ratio_share = check_positive("actor.policy_loss.clip_cov_ratio", clip_cov_ratio)
    loss1, loss2 = x.ppo_clip(x.ratio)
    valid = x.mask != 0
    cov = _centred_product(x.advantages, x.log_prob, x.mask)
    candidates = torch.nonzero(valid & ~(loss2 > loss1) & (cov > clip_cov_lb) & (cov < clip_cov_ub))  # [K, 2]
    keep = torch.ones_like(x.log_prob)
    if candidates.shape[0] > 0:
        count = max(int(ratio_share * float(x.mask.sum())), 1)
        chosen = candidates[torch.randperm(candidates.shape[0])[:count].to(candidates.device)]
        keep[chosen[:, 0], chosen[:, 1]] = 0.0
    return x.finish(torch.maximum(loss1, loss2) * keep, x.ppo_kl, masked_mean(1.0 - keep, x.mask))


@register_policy_loss("kl_cov")
def kl_cov(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 0.1,
    global_batch_info: GlobalBatchInfo | None = None,
    loss_scale_factor: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    sample_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov (Cui et al. 2025, arXiv:2505.22617): a KL penalty on the highest-covariance tokens only.

    loss_t = -A_t * r_t (unclipped; r = exp(clamp(log_prob - old_log_prob, -20, 20))) [B, T], plus
    ``ppo_kl_coef`` * |log r_t| on the max(1, int(``kl_cov_ratio`` x valid tokens)) valid tokens
    with the largest centred product (A_t - mean A) * (log_prob_t - mean log_prob) (means over this
    call's valid tokens). The paper writes the penalty as a KL between the old and the current
    policy; the reference, followed here, uses |log r| per token. As in the reference the selection
    is per micro-batch (not micro-batch invariant). Metrics: ppo_kl is the masked mean of |log r|
    (the reference's choice for this loss), pg_clipfrac and pg_clipfrac_lower are 0.
    """
    x = _prologue(
        old_log_prob, log_prob, advantages, response_mask,
        agg=_Agg(loss_agg_mode, global_batch_info, loss_scale_factor, rollout_is_weights, sample_weight),
    )
    ratio_share = check_positive("actor.policy_loss.kl_cov_ratio", kl_cov_ratio)
    coef = check_positive("actor.policy_loss.ppo_kl_coef", ppo_kl_coef, allow_zero=True)
    abs_kl = x.neg_kl.abs()
    pg_losses = -x.advantages * x.ratio
    valid = x.mask != 0
    positions = torch.nonzero(valid.flatten()).flatten()  # row-major, the order of cov[valid]
    if positions.numel() > 0:
        cov = _centred_product(x.advantages, x.log_prob, x.mask)[valid]
        count = min(max(1, int(positions.numel() * ratio_share)), positions.numel())
        chosen = positions[torch.topk(cov, count).indices]
        penalised = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
        penalised[chosen] = True
        pg_losses = torch.where(penalised.view_as(valid), pg_losses + coef * abs_kl, pg_losses)
    return x.finish(pg_losses, masked_mean(abs_kl, x.mask))


def _dppo(kind: str, x: _Prologue, clip_ratio_c: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    cap = check_positive("actor.clip_ratio_c", clip_ratio_c)
    old_log_prob, log_prob, advantages, low, high = x.old_log_prob, x.log_prob, x.advantages, x.low, x.high
    ratio = x.ratio
    with torch.no_grad():
        prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
        if kind == "tv":
            up_ok = prob - old_prob <= high
            down_ok = prob - old_prob >= -low
        else:
            # KL between the two Bernoulli distributions "this token / any other token"
            binary_kl = old_prob * (old_log_prob - log_prob) + (1.0 - old_prob) * torch.log(
                (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
            )
            up_ok = (binary_kl <= high) | (prob <= old_prob)
            down_ok = (binary_kl <= low) | (prob >= old_prob)
        keep = torch.where(advantages > 0, up_ok, down_ok).to(log_prob.dtype)
        weight = torch.clamp(ratio, max=cap)
    clipfrac = masked_mean(1.0 - keep, x.mask)
    clipfrac_lower = masked_mean((ratio > cap).to(log_prob.dtype) * keep, x.mask)
    return x.finish(-advantages * weight * log_prob * keep, x.ppo_kl, clipfrac, clipfrac_lower)


@register_policy_loss("dppo_tv")
def dppo_tv(
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
    """DPPO with a binary total-variation trust region (arXiv:2602.04879).

    Instead of clipping the ratio, a token leaves the gradient when the probability of its sampled
    token moved too far in the direction its advantage pushes: with p = exp(log_prob),
    p_old = exp(old_log_prob), a token with A > 0 is kept while p - p_old <= ``clip_ratio_high``
    and one with A <= 0 while p - p_old >= -``clip_ratio_low`` (here the clip ranges are
    probability differences, not ratio ranges). Kept tokens get the truncated-IS policy gradient
    loss_t = -A_t * sg[min(r_t, clip_ratio_c)] * log_prob_t, whose gradient is -A * min(r, c) *
    grad log pi. pg_clipfrac = share of valid tokens dropped; pg_clipfrac_lower = share of kept
    tokens whose ratio exceeded ``clip_ratio_c``.

    The truncation cap: the paper (its Section 5.4, as the reference's comment cites it) recommends a
    large cap, and the reference's code falls back to 20, but it reads ``actor.clip_ratio_c``, which
    always exists there with default 3.0, so 3.0 is what a reference run uses unless set. We read
    the same key with the same default (set ``clip_ratio_c`` high to follow the paper).
    """
    x = _prologue(
        old_log_prob, log_prob, advantages, response_mask, clip=(clip_ratio, clip_ratio_low, clip_ratio_high),
        agg=_Agg(loss_agg_mode, global_batch_info, loss_scale_factor, rollout_is_weights, sample_weight),
    )
    return _dppo("tv", x, clip_ratio_c)


@register_policy_loss("dppo_kl")
def dppo_kl(
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
    """DPPO with a binary KL trust region (arXiv:2602.04879); as ``dppo_tv`` with another test.

    The divergence is the KL between the Bernoulli distributions "the sampled token / any other"
    under the old and the new policy, D = p_old log(p_old / p) + (1 - p_old) log((1 - p_old + 1e-8)
    / (1 - p + 1e-8)) [B, T]. A token with A > 0 is kept while D <= ``clip_ratio_high`` or p <= p_old
    (it moved against its advantage), one with A <= 0 while D <= ``clip_ratio_low`` or p >= p_old.
    Same loss, metrics and truncation cap (``clip_ratio_c``, see ``dppo_tv``) as ``dppo_tv``.
    """
    x = _prologue(
        old_log_prob, log_prob, advantages, response_mask, clip=(clip_ratio, clip_ratio_low, clip_ratio_high),
        agg=_Agg(loss_agg_mode, global_batch_info, loss_scale_factor, rollout_is_weights, sample_weight),
    )
    return _dppo("kl", x, clip_ratio_c)


@register_policy_loss("dro")
def dro(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    dro_beta: float | None = None,
    global_batch_info: GlobalBatchInfo | None = None,
    loss_scale_factor: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    sample_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy gradient with a quadratic log-ratio penalty, the reference's ``dro``.

    loss_t = -(A_t * log_prob_t - ``dro_beta`` / 2 * (log_prob_t - old_log_prob_t)^2) [B, T]: the
    REINFORCE term plus a proximal penalty on the squared log-ratio to the old policy (its
    gradient is 0 at r = 1 and grows with the drift), in place of PPO's clip. The name follows
    Direct Reward Optimisation (Richemond et al. 2024, arXiv:2405.19107), whose loss is a squared
    regression of the reward on a log-ratio with a learnt value baseline; the reference keeps only
    the quadratic log-ratio term, against the rollout policy rather than a reference policy, and
    we follow the reference. ``dro_beta`` (``actor.policy_loss.dro_beta``) has no default and must
    be > 0. No clamp of log r (as in the reference). pg_clipfrac and pg_clipfrac_lower are 0.
    """
    x = _prologue(
        old_log_prob, log_prob, advantages, response_mask,
        agg=_Agg(loss_agg_mode, global_batch_info, loss_scale_factor, rollout_is_weights, sample_weight),
    )
    if dro_beta is None:
        raise ValueError("loss_mode=dro needs actor_rollout_ref.actor.policy_loss.dro_beta (> 0); it has no default")
    beta = check_positive("actor_rollout_ref.actor.policy_loss.dro_beta", dro_beta)
    log_ratio = x.log_prob - x.old_log_prob  # [B, T], unclamped as in the reference
    pg_losses = -(x.advantages * x.log_prob - 0.5 * beta * log_ratio * log_ratio)
    return x.finish(pg_losses, masked_mean(-log_ratio, x.mask))


@register_policy_loss("bypass_mode")
def bypass_mode(
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
    loss_type: str = "ppo_clip",
    rollout_is: str | None = None,
    rollout_is_threshold: float | str = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: float | str | None = None,
    global_batch_info: GlobalBatchInfo | None = None,
    loss_scale_factor: float | None = None,
    sample_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bypass mode: ``old_log_prob`` are the ROLLOUT engine's log-probabilities (no recompute pass).

    Two policies instead of three (Liu et al. 2025, "When Speed Kills Stability"): the ratio is taken
    against the engine's own log-probabilities (``actor.old_log_prob=rollout``). From d = log_prob -
    old_log_prob (detached) it computes the rollout-correction IS weights (``rollout_is``: token or
    sequence, truncated at ``rollout_is_threshold``, ``verl.algos.rollout_correction``) and drops
    tokens or sequences that fail the rejection tests (``rollout_rs``, ``rollout_rs_threshold``), then:

    - ``loss_type="ppo_clip"``: ``vanilla`` (clip, dual clip) on the kept tokens; the IS weights are
      only measured, since the clipped ratio already is the IS correction;
    - ``loss_type="reinforce"``: loss_t = -A_t * log_prob_t * w_t on the kept tokens (no ratio, no clip).

    Rejected tokens leave the numerator but keep counting in the denominators (those of the whole
    mini-batch, ``global_batch_info``, or of this call's unrejected ``response_mask`` when it is
    None), as in the reference's trainer; a standalone call of the reference's function instead
    divides by the kept tokens. Metrics: the loss's own plus ``rollout_corr/kl``,
    ``rollout_corr/k3_kl``, ``rollout_corr/rollout_is_mean``, ``rollout_corr/rollout_rs_masked_fraction``
    (micro-batch means; the engine averages them, so no maxima here).
    Keys are ``actor_rollout_ref.actor.policy_loss.rollout_correction.*`` (the reference reads them there).
    """
    from verl.algos.rollout_correction import is_weights, offpolicy_metrics, rejection_mask

    old_log_prob, log_prob, advantages, mask = _inputs(old_log_prob, log_prob, advantages, response_mask)
    if loss_type not in ("ppo_clip", "reinforce"):
        raise ValueError(
            f"actor_rollout_ref.actor.policy_loss.rollout_correction.loss_type={loss_type!r}; expected ppo_clip or reinforce"
        )
    if global_batch_info is None:
        global_batch_info = GlobalBatchInfo.from_masks([mask])
    log_ratio = (log_prob - old_log_prob).detach()
    extra: dict[str, torch.Tensor] = dict(offpolicy_metrics(log_ratio, mask))
    weights = None
    if rollout_is is not None:
        weights, more = is_weights(
            log_ratio, mask, level=rollout_is, threshold=rollout_is_threshold, batch_normalize=rollout_is_batch_normalize
        )
        extra["rollout_is_mean"] = more["rollout_is_mean"]
    kept = mask
    if rollout_rs is not None:
        kept, more = rejection_mask(log_ratio, mask, options=rollout_rs, threshold=rollout_rs_threshold)
        extra["rollout_rs_masked_fraction"] = more["rollout_rs_masked_fraction"]
    if loss_type == "ppo_clip":
        loss, metrics = vanilla(
            old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=kept,
            loss_agg_mode=loss_agg_mode, clip_ratio=clip_ratio, clip_ratio_low=clip_ratio_low,
            clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c, global_batch_info=global_batch_info,
            loss_scale_factor=loss_scale_factor, sample_weight=sample_weight,
        )
    else:
        pg_losses = -advantages * log_prob
        if weights is not None:
            pg_losses = pg_losses * weights
        loss = agg_loss(
            pg_losses, kept, loss_agg_mode, global_batch_info=global_batch_info, loss_scale_factor=loss_scale_factor,
            sample_weight=sample_weight,
        )
        zero = _zero_like(log_prob)
        metrics = _metrics(zero, masked_mean(-log_ratio, kept), zero)
    metrics.update({f"rollout_corr/{k}": v.detach() for k, v in extra.items()})
    return loss, metrics


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
