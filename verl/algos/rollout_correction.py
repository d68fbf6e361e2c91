"""Rollout correction: importance weights and rejection masks between the trainer and the rollout engine.

The engine that sampled a response (vLLM, bf16, another version of the weights) and the trainer
disagree slightly on its log-probabilities. With ``log_ratio = log pi_train - log pi_rollout``
[B, T] this module gives

- importance-sampling (IS) weights ``pi_train / pi_rollout``, per token (``rollout_is="token"``)
  or one per sequence (``"sequence"``: the product over its valid tokens), truncated above at
  ``rollout_is_threshold`` (TIS), or, with a ``"lower_upper"`` threshold such as ``"0.5_2.0"``,
  zeroed outside [lower, upper] (IcePop);
- a rejection mask (``rollout_rs``): tokens or whole sequences whose divergence estimate exceeds
  a threshold are dropped from the loss. Options, combined with commas (all must pass):
  ``token_k1``/``k2``/``k3`` (per token), ``seq_sum_k*``, ``seq_mean_k*`` (sum or mean of the
  token estimates over the sequence), ``seq_max_k2``/``k3`` (their maximum), where with
  ``d = log_ratio``: k1 = -d, k2 = d^2 / 2, k3 = exp(d) - 1 - d (Schulman's estimators of
  KL(rollout || train)). k1 options take ``"lower_upper"`` bounds on the *ratio* (compared in log
  space; a single number u means [1/u, u]); k2/k3 take one upper bound.

Definitions and option names are those of the reference verl 0.9.1 (``rollout_corr_helper.py``,
after Liu et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the
Training-Inference Mismatch"). Departures: log-ratios of masked tokens are zeroed before use (a
-inf log-prob in padding cannot make a sequence's weight NaN); only the handful of metrics the
actor logs are computed (the reference computes some forty).
"""

from __future__ import annotations

import math

import torch

from verl.algos.masked import masked_mean, masked_sum

# exp() of a log-ratio beyond this is clamped (exp(20) ~ 4.9e8): one wild token cannot overflow.
SAFETY_BOUND = 20.0

RS_OPTIONS: tuple[str, ...] = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
IS_LEVELS: tuple[str, ...] = ("token", "sequence")


def parse_is_threshold(spec: float | str, key: str = "rollout_is_threshold") -> tuple[float, float | None]:
    """``2.0`` or ``"2.0"`` -> (2.0, None) (truncation); ``"0.5_2.0"`` -> (2.0, 0.5) (IcePop band)."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"{key} must be a number or a 'lower_upper' string such as '0.5_2.0', got {spec!r}")
    lower: float | None = None
    try:
        if isinstance(spec, str) and "_" in spec:
            low_text, high_text = spec.strip().split("_", 1)
            lower, upper = float(low_text), float(high_text)
        else:
            upper = float(spec)
    except ValueError:
        raise ValueError(f"{key}={spec!r} is not a number or a 'lower_upper' pair such as '0.5_2.0'") from None
    if not upper > 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"{key}={spec!r}: the bounds must satisfy 0 < lower <= upper")
    return upper, lower


def parse_rs(options: str, thresholds: float | str | None) -> dict[str, tuple[float | None, float]]:
    """``rollout_rs`` and ``rollout_rs_threshold`` -> {option: (lower log-bound or None, upper bound)}.

    One threshold is shared by every option; otherwise give one per option, comma-separated.
    k1 bounds are returned in log space (they bound -log_ratio); k2/k3 bounds as given.
    """
    names = list(dict.fromkeys(o.strip() for o in str(options).split(",") if o.strip()))
    if not names:
        raise ValueError(f"rollout_rs={options!r} names no option; choose from {list(RS_OPTIONS)}")
    for name in names:
        if name not in RS_OPTIONS:
            raise ValueError(f"rollout_rs option {name!r} is unknown; choose from {list(RS_OPTIONS)}")
    if thresholds is None:
        raise ValueError(f"rollout_rs={options!r} needs rollout_rs_threshold (one bound, or one per option)")
    specs = [t.strip() for t in str(thresholds).split(",") if t.strip()]
    if len(specs) == 1:
        specs = specs * len(names)
    if len(specs) != len(names):
        raise ValueError(
            f"rollout_rs_threshold={thresholds!r} gives {len(specs)} bounds for {len(names)} rollout_rs options; "
            "give one shared bound or one per option"
        )
    out: dict[str, tuple[float | None, float]] = {}
    for name, spec in zip(names, specs):
        try:
            if name.endswith("k1"):
                if "_" in spec:
                    low_text, high_text = spec.split("_", 1)
                    low, high = float(low_text), float(high_text)
                else:
                    high = float(spec)
                    low = 1.0 / high
                if not 0 < low <= high:
                    raise ValueError
                out[name] = (math.log(low), math.log(high))
            else:
                if "_" in spec:
                    raise ValueError
                high = float(spec)
                if not high > 0:
                    raise ValueError
                out[name] = (None, high)
        except (ValueError, ZeroDivisionError):
            form = "'lower_upper' ratio bounds or one upper bound u ([1/u, u])" if name.endswith("k1") else "one positive upper bound"
            raise ValueError(f"rollout_rs_threshold {spec!r} for {name}: expected {form}") from None
    return out


def is_weights(
    log_ratio: torch.Tensor, mask: torch.Tensor, *, level: str, threshold: float | str, batch_normalize: bool = False
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated (or IcePop-banded) IS weights [B, T], detached and 0 on masked tokens.

    log_ratio: log pi_train - log pi_rollout [B, T]; mask: [B, T] 0/1. ``batch_normalize`` divides
    by the mean weight of this call's batch (over valid tokens for ``token``, over sequences for
    ``sequence``), so it depends on how the batch is cut into micro-batches, as in the reference.
    Metrics: ``rollout_is_mean`` (of the applied weights over valid tokens).
    """
    if level not in IS_LEVELS:
        raise ValueError(f"rollout_is={level!r}; expected one of {list(IS_LEVELS)} or null (no IS weights)")
    upper, lower = parse_is_threshold(threshold)
    valid = mask != 0
    zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
    log_ratio = torch.where(valid, log_ratio.detach(), zero)
    if level == "token":
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        seq = masked_sum(log_ratio, mask, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # [B]
        raw = torch.exp(seq).unsqueeze(-1).expand_as(log_ratio)
    raw = torch.where(valid, raw, zero)
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, zero)
    if batch_normalize:
        if level == "token":
            mean = masked_mean(weights, mask)
        else:
            seq_valid = valid.any(dim=-1)
            seq_w = masked_mean(weights, mask, dim=-1)
            mean = torch.where(seq_valid, seq_w, zero).sum() / seq_valid.sum().clamp(min=1)
        weights = torch.where(mean > 1e-8, weights / mean.clamp(min=1e-8), weights)
    return weights.detach(), {"rollout_is_mean": masked_mean(weights, mask).detach()}


def rejection_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, *, options: str, threshold: float | str | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``mask`` [B, T] with the tokens (or sequences) that fail any ``options`` bound set to 0.

    Metrics: ``rollout_rs_masked_fraction`` (share of valid tokens dropped).
    """
    bounds = parse_rs(options, threshold)
    valid = mask != 0
    zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
    d = torch.where(valid, log_ratio.detach(), zero).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    estimates = {"k1": -d, "k2": 0.5 * d * d, "k3": torch.exp(d) - 1.0 - d}  # each [B, T]
    keep = torch.ones_like(valid)
    for name, (low, high) in bounds.items():
        level, est = name.rsplit("_", 1)
        value = estimates[est]
        if level == "seq_sum":
            value = masked_sum(value, mask, dim=-1).unsqueeze(-1)
        elif level == "seq_mean":
            value = masked_mean(value, mask, dim=-1).unsqueeze(-1)
        elif level == "seq_max":
            value = torch.where(valid, value, torch.full_like(value, -math.inf)).amax(dim=-1, keepdim=True)
            value = torch.where(torch.isinf(value), torch.zeros_like(value), value)
        ok = value <= high
        if low is not None:
            ok = ok & (value >= low)
        keep = keep & ok.expand_as(valid)
    new_mask = torch.where(keep, mask, torch.zeros_like(mask))
    dropped = masked_mean((~keep).to(log_ratio.dtype), mask)
    return new_mask, {"rollout_rs_masked_fraction": dropped.detach()}


def offpolicy_metrics(log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """``kl`` (masked mean of -log_ratio: KL(rollout || train) by k1) and ``k3_kl`` (by k3), detached."""
    valid = mask != 0
    d = torch.where(valid, log_ratio.detach(), torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device))
    return {"kl": masked_mean(-d, mask), "k3_kl": masked_mean(torch.exp(d.clamp(max=SAFETY_BOUND)) - 1.0 - d, mask)}
