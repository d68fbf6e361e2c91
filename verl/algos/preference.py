"""Preference losses for offline (chosen, rejected) pairs: DPO and IPO.

Each registered loss takes sequence log-probs [B] of the policy and of the frozen reference
model for the chosen and rejected response of each of B pairs, and returns (loss, metrics).
h = (policy_chosen - policy_rejected) - (reference_chosen - reference_rejected) is the
log-ratio margin; the implicit rewards are beta * (policy - reference) per response.

- ``sigmoid`` (DPO, arXiv:2305.18290): -log sigmoid(beta * h), with optional conservative
  label smoothing eps: -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h);
- ``ipo`` (arXiv:2310.12036): (h - 1 / (2 beta))^2, on length-averaged log-probs (as TRL
  computes it): a loss function with ``length_averaged = True`` gets each response's mean token
  log-prob instead of the sum (:func:`preference_step`, which the trainer's DPO step uses).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from verl.algos.checks import check_mask, check_positive, check_seq_level, check_token_level
from verl.algos.masked import masked_mean, masked_sum
from verl.algos.registry import Registry, call_with_accepted

PreferenceLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]

PREFERENCE_LOSSES: Registry[PreferenceLossFn] = Registry("preference loss", "dpo.loss_type")
register_preference_loss = PREFERENCE_LOSSES.register


def get_preference_loss(name: str) -> PreferenceLossFn:
    """The preference loss registered as ``name`` (ValueError listing the registered names otherwise)."""
    return PREFERENCE_LOSSES.get(name)


def list_preference_losses() -> list[str]:
    """Registered preference loss names."""
    return PREFERENCE_LOSSES.names()


def compute_preference_loss(name: str, **inputs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run preference loss ``name`` with the subset of ``inputs`` it takes."""
    return call_with_accepted(get_preference_loss(name), f"preference loss {name!r}", inputs)


def uses_length_average(name: str) -> bool:
    """Whether preference loss ``name`` is defined on per-response mean (not summed) log-probs."""
    return bool(getattr(get_preference_loss(name), "length_averaged", False))


def preference_step(
    loss_type: str,
    *,
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """The preference loss of pairs laid out as rows 2i (chosen) and 2i + 1 (rejected), from token
    log-probs [2B, R] of the policy and the reference; returns (loss, metrics, coef [2B]).

    ``coef_i`` is the loss's derivative with respect to response i's *summed* token log-prob at
    these log-probs, so that ``sum_i coef_i * sum_t logp_it(theta)`` has the loss's gradient
    (the surrogate the trainer back-propagates micro-batch by micro-batch). For a
    length-averaged loss (:func:`uses_length_average`) the sequence log-prob is the mean over the
    response's tokens and ``coef_i`` carries the 1 / length.
    """
    average = uses_length_average(loss_type)
    policy = sequence_log_prob(log_prob, response_mask, average=average).double().requires_grad_(True)  # [2B]
    reference = sequence_log_prob(ref_log_prob, response_mask, average=average).double()  # [2B]
    loss, metrics = compute_preference_loss(
        loss_type,
        policy_chosen_logps=policy[0::2],
        policy_rejected_logps=policy[1::2],
        reference_chosen_logps=reference[0::2],
        reference_rejected_logps=reference[1::2],
        beta=beta,
        label_smoothing=label_smoothing,
    )
    (coef,) = torch.autograd.grad(loss, policy)  # d loss / d (sequence log-prob)
    if average:
        coef = coef / response_mask.sum(-1).clamp(min=1).to(coef.dtype)
    return loss.detach(), {k: v.detach() for k, v in metrics.items()}, coef


def sequence_log_prob(log_prob: torch.Tensor, response_mask: torch.Tensor, *, average: bool = False) -> torch.Tensor:
    """Per-sequence log-prob [B] from token log-probs [B, T]: the sum (or mean) over valid tokens."""
    check_token_level("log_prob", log_prob)
    mask = check_mask("response_mask", response_mask, log_prob.shape, log_prob.dtype)
    return masked_mean(log_prob, mask, dim=-1) if average else masked_sum(log_prob, mask, dim=-1)


def _margins(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    reference_chosen_logps: torch.Tensor,
    reference_rejected_logps: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    shape = tuple(getattr(policy_chosen_logps, "shape", ()))
    if len(shape) != 1 or shape[0] == 0:
        raise ValueError(f"policy_chosen_logps must be a non-empty sequence-level [B] tensor, got shape {shape}")
    b = shape[0]
    check_seq_level("policy_chosen_logps", policy_chosen_logps, b)
    check_seq_level("policy_rejected_logps", policy_rejected_logps, b)
    check_seq_level("reference_chosen_logps", reference_chosen_logps, b)
    check_seq_level("reference_rejected_logps", reference_rejected_logps, b)
    chosen = policy_chosen_logps - reference_chosen_logps.detach()  # [B]
    rejected = policy_rejected_logps - reference_rejected_logps.detach()  # [B]
    return chosen, rejected, chosen - rejected


def _reduce(losses: torch.Tensor, global_num_pairs: float | None, dp_size: int) -> torch.Tensor:
    """Mean over pairs; under micro-batching, the sum over the global number of pairs (times dp_size)."""
    if global_num_pairs is None:
        if dp_size != 1:
            raise ValueError("dp_size > 1 needs global_num_pairs (pairs in the whole mini-batch on all ranks)")
        return losses.mean()
    return losses.sum() / check_positive("global_num_pairs", global_num_pairs) * dp_size


def _pref_metrics(chosen: torch.Tensor, rejected: torch.Tensor, beta: float) -> dict[str, torch.Tensor]:
    chosen_rewards = (beta * chosen).detach()
    rejected_rewards = (beta * rejected).detach()
    return {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracy": (chosen_rewards > rejected_rewards).to(chosen.dtype).mean(),
        "rewards/margin": (chosen_rewards - rejected_rewards).mean(),
    }


@register_preference_loss("sigmoid", "dpo")
def dpo_sigmoid(
    *,
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    reference_chosen_logps: torch.Tensor,
    reference_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    global_num_pairs: float | None = None,
    dp_size: int = 1,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO loss, mean over the B pairs of -log sigmoid(beta * h) (see module doc); all inputs [B]."""
    beta = check_positive("beta", beta)
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    chosen, rejected, h = _margins(
        policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps
    )
    losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    return _reduce(losses, global_num_pairs, dp_size), _pref_metrics(chosen, rejected, beta)


@register_preference_loss("ipo")
def ipo(
    *,
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    reference_chosen_logps: torch.Tensor,
    reference_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    global_num_pairs: float | None = None,
    dp_size: int = 1,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """IPO loss, mean over the B pairs of (h - 1/(2 beta))^2 (see module doc); all inputs [B]."""
    beta = check_positive("beta", beta)
    chosen, rejected, h = _margins(
        policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps
    )
    losses = (h - 1.0 / (2.0 * beta)) ** 2
    return _reduce(losses, global_num_pairs, dp_size), _pref_metrics(chosen, rejected, beta)


ipo.length_averaged = True
