"""KL estimators between the policy and the reference, KL controllers, and the two places KL goes.

Token-level estimators of KL(pi || pi_ref) from sampled tokens' log-probs (Schulman,
"Approximating KL divergence", 2020), with x = log_prob - ref_log_prob:

- ``kl`` / ``k1``: x (unbiased, can be negative);
- ``abs``: |x|;
- ``mse`` / ``k2``: x^2 / 2 (biased value, but its gradient is the gradient of the KL);
- ``low_var_kl`` / ``k3``: exp(-x) - 1 + x with -x clamped to [-20, 20] and the result to
  [-10, 10] (unbiased, nonnegative, low variance);
- ``full``: sum_v p_v (log p_v - log q_v) from the whole distributions ([..., V] logits or
  log-probs of both models; the reference leaves this unimplemented). A token the reference
  model gives probability 0 costs at most 1e4 per unit of policy mass instead of inf.

Appending ``+`` (``k1+``, ``k3+``, ``low_var_kl+``, ``abs+``) gives the straight-through
variant defined by the reference verl: the forward value of the named estimator with the
gradient of ``k2`` (whose gradient is the unbiased KL gradient). ``k2+``/``mse+`` equal ``k2``.

KL enters training either in the reward (``algorithm.use_kl_in_reward``: ``apply_kl_penalty``
with a fixed or adaptive controller) or as a loss term (``actor.use_kl_loss``:
``compute_kl_loss`` times ``actor.kl_loss_coef``, estimator ``actor.kl_loss_type``).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from verl.algos.aggregation import GlobalBatchInfo, agg_loss
from verl.algos.checks import check_float, check_mask, check_positive, check_token_level
from verl.algos.masked import masked_mean
from verl.algos.registry import Registry

KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

KL_ESTIMATORS: Registry[KLFn] = Registry("KL estimator", "algorithm.kl_penalty / actor.kl_loss_type")
register_kl_estimator = KL_ESTIMATORS.register

# Straight-through variants exist for estimators of sampled-token log-probs, not for "full".
_NO_STRAIGHT_THROUGH = ("full",)


@register_kl_estimator("kl", "k1")
def kl_k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k1 = log_prob - ref_log_prob, [B, T]."""
    return log_prob - ref_log_prob


@register_kl_estimator("abs")
def kl_abs(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """|log_prob - ref_log_prob|, [B, T]."""
    return (log_prob - ref_log_prob).abs()


@register_kl_estimator("mse", "k2")
def kl_k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 * (log_prob - ref_log_prob)^2, [B, T]."""
    return 0.5 * (log_prob - ref_log_prob).square()


@register_kl_estimator("low_var_kl", "k3")
def kl_k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k3 = r - log r - 1 with log r = ref_log_prob - log_prob clamped to [-20, 20], result clamped to [-10, 10]."""
    log_r = torch.clamp(ref_log_prob - log_prob, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(log_r) - log_r - 1.0, min=-10.0, max=10.0)


@register_kl_estimator("full")
def kl_full(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """Exact KL(p || q) per position from full distributions: [..., V] x [..., V] -> [...].

    Inputs may be logits or log-probs (both are renormalised with log_softmax).
    """
    if log_prob.dim() < 1 or log_prob.shape[-1] < 1:
        raise ValueError(f"'full' KL needs [..., V] distributions, got shape {tuple(log_prob.shape)}")
    logp = torch.log_softmax(log_prob, dim=-1)
    logq = torch.log_softmax(ref_log_prob, dim=-1).clamp(min=-1e4)
    p = logp.exp()
    terms = torch.where(p > 0, p * (logp - logq), torch.zeros((), dtype=logp.dtype, device=logp.device))
    return terms.sum(dim=-1)


def list_kl_estimators() -> list[str]:
    """Every accepted estimator name, straight-through ``+`` variants included."""
    base = KL_ESTIMATORS.names()
    return sorted(base + [f"{n}+" for n in base if n not in _NO_STRAIGHT_THROUGH])


def get_kl_estimator(kind: str) -> KLFn:
    """The estimator function for ``kind`` (``+`` variants resolved to their straight-through form)."""
    if isinstance(kind, str) and kind.endswith("+"):
        base = kind[:-1]
        if base in _NO_STRAIGHT_THROUGH or base not in KL_ESTIMATORS:
            raise ValueError(f"unknown KL estimator {kind!r}; registered: {list_kl_estimators()}")
        forward = KL_ESTIMATORS.get(base)
        if forward is kl_k2:
            return kl_k2

        def straight_through(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
            value = forward(log_prob, ref_log_prob)
            grad_source = kl_k2(log_prob, ref_log_prob)
            return grad_source - grad_source.detach() + value.detach()

        straight_through.__doc__ = f"Value of {base!r}, gradient of 'k2'."
        return straight_through
    if isinstance(kind, str) and kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; registered: {list_kl_estimators()}")
    return KL_ESTIMATORS.get(kind)


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Token-level KL estimate of kind ``kind`` (see module doc). [B, T], or [B, T, V] -> [B, T] for ``full``."""
    fn = get_kl_estimator(kind)
    check_float("log_prob", log_prob)
    check_float("ref_log_prob", ref_log_prob)
    if log_prob.shape != ref_log_prob.shape:
        raise ValueError(
            f"log_prob {tuple(log_prob.shape)} and ref_log_prob {tuple(ref_log_prob.shape)} must have the same shape"
        )
    if log_prob.numel() == 0:
        raise ValueError(f"log_prob is empty (shape {tuple(log_prob.shape)}); there is nothing to compute")
    return fn(log_prob, ref_log_prob.to(log_prob.dtype))


_token_kl = kl_penalty  # apply_kl_penalty's argument is named after the config key and shadows it


def compute_kl_loss(
    *,
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_loss_type: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    global_batch_info: GlobalBatchInfo | None = None,
    loss_scale_factor: float | None = None,
    sample_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """The KL loss term (``actor.use_kl_loss``): agg(kl_penalty(log_prob, ref_log_prob, kl_loss_type)).
    ``sample_weight`` [B] scales each sequence's term (``agg_loss``).

    log_prob, ref_log_prob, response_mask: [B, T] (``full``: [B, T, V] distributions with a
    [B, T] mask). The actor adds ``actor.kl_loss_coef`` times this scalar to its loss.
    """
    check_float("log_prob", log_prob)
    check_float("ref_log_prob", ref_log_prob)
    if not isinstance(response_mask, torch.Tensor) or tuple(log_prob.shape[: response_mask.dim()]) != tuple(
        response_mask.shape
    ):
        raise ValueError(
            f"response_mask {tuple(getattr(response_mask, 'shape', ()))} must match the leading [B, T] dims "
            f"of log_prob {tuple(log_prob.shape)}"
        )
    # Zero the padding of the inputs (uniform logits for 'full'), not only of the loss, so a NaN
    # or -inf there cannot reach the gradients through the masked branch.
    valid = (response_mask != 0).reshape(tuple(response_mask.shape) + (1,) * (log_prob.dim() - response_mask.dim()))
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    log_prob = torch.where(valid, log_prob, zero)
    if ref_log_prob.shape == log_prob.shape:
        ref_log_prob = torch.where(valid, ref_log_prob.to(log_prob.dtype), zero)
    kld = kl_penalty(log_prob, ref_log_prob, kl_loss_type)  # [B, T]
    return agg_loss(
        kld, response_mask, loss_agg_mode, global_batch_info=global_batch_info, loss_scale_factor=loss_scale_factor,
        sample_weight=sample_weight,
    )


# ----------------------------------------------------------------------------------------------
# KL in the reward


class FixedKLController:
    """A constant KL coefficient (``algorithm.kl_ctrl.type=fixed``)."""

    def __init__(self, *, kl_coef: float) -> None:
        self.value = check_positive("algorithm.kl_ctrl.kl_coef", kl_coef, allow_zero=True)

    def update(self, current_kl: float, n_steps: int) -> None:
        """A fixed coefficient does not react to the measured KL."""

    def state_dict(self) -> dict[str, Any]:
        """The coefficient, for checkpoints."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the coefficient saved by ``state_dict``."""
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, arXiv:1909.08593), ``algorithm.kl_ctrl.type=adaptive``.

    After each batch: e = clip(current_kl / target_kl - 1, -0.2, 0.2) and
    value *= 1 + e * n_steps / horizon, so the coefficient rises while the KL overshoots the
    target and decays while it undershoots, at a rate set by ``horizon`` (in samples).
    """

    def __init__(self, *, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        self.value = check_positive("algorithm.kl_ctrl.kl_coef", init_kl_coef, allow_zero=True)
        self.target = check_positive("algorithm.kl_ctrl.target_kl", target_kl)
        self.horizon = check_positive("algorithm.kl_ctrl.horizon", horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient towards keeping ``current_kl`` at the target; ``n_steps`` = batch size."""
        error = float(np.clip(float(current_kl) / self.target - 1.0, -0.2, 0.2))
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        """The current coefficient, for checkpoints (target and horizon come from the config)."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the coefficient saved by ``state_dict``."""
        self.value = float(state["value"])


KLController = FixedKLController | AdaptiveKLController


def make_kl_controller(
    *, type: str, kl_coef: float, target_kl: float | None = None, horizon: float | None = None
) -> KLController:
    """Build the controller named by ``algorithm.kl_ctrl.type`` ("fixed" or "adaptive")."""
    if type == "fixed":
        return FixedKLController(kl_coef=kl_coef)
    if type == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError("algorithm.kl_ctrl.type=adaptive needs algorithm.kl_ctrl.target_kl and .horizon")
        return AdaptiveKLController(init_kl_coef=kl_coef, target_kl=target_kl, horizon=horizon)
    raise ValueError(f"unknown algorithm.kl_ctrl.type {type!r}; supported: ['adaptive', 'fixed']")


@torch.no_grad()
def apply_kl_penalty(
    *,
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: KLController,
    kl_penalty: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """token_level_rewards = token_level_scores - beta * KL on valid tokens, then update the controller.

    All tensors [B, T]; KL is the estimator named by ``kl_penalty`` (``algorithm.kl_penalty``)
    applied to (old_log_prob, ref_log_prob), zero on masked tokens; beta is the controller's value before
    the update. The controller is updated with the batch KL (mean over sequences of each
    sequence's mean token KL) and n_steps = B, as in the reference.
    Returns (token_level_rewards [B, T], metrics with ``reward_kl_penalty`` and
    ``reward_kl_penalty_coeff``).
    """
    check_token_level("token_level_scores", token_level_scores)
    check_token_level("old_log_prob", old_log_prob, like=token_level_scores)
    check_token_level("ref_log_prob", ref_log_prob, like=token_level_scores)
    if isinstance(kl_penalty, str) and kl_penalty.startswith("full"):
        raise ValueError("algorithm.kl_penalty='full' needs whole distributions; the reward path only has token log-probs")
    mask = check_mask("response_mask", response_mask, token_level_scores.shape, torch.bool)
    kld = _token_kl(old_log_prob, ref_log_prob, kl_penalty)
    kld = torch.where(mask, kld, torch.zeros((), dtype=kld.dtype, device=kld.device))
    beta = float(kl_ctrl.value)
    token_level_rewards = token_level_scores - beta * kld.to(token_level_scores.dtype)
    current_kl = float(masked_mean(kld, mask, dim=-1).mean())
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    return token_level_rewards, {"reward_kl_penalty": current_kl, "reward_kl_penalty_coeff": beta}
