"""The RL trainer's per-step and validation metrics, under the reference verl's key names.

- :func:`data_metrics`: ``critic/score|rewards|advantages|returns|values/{mean,max,min}``,
  ``critic/vf_explained_var``, ``response_length/*`` and ``prompt_length/*`` (``clip_ratio``: the
  share at the length limit);
- :func:`throughput_metrics`: ``perf/total_num_tokens``, ``perf/time_per_step``,
  ``perf/throughput`` (tokens per second per rank), ``perf/max_memory_allocated_gb``,
  ``perf/cpu_memory_used_gb``;
- :func:`rollout_agreement_metrics`: the trainer's old log-probabilities against the rollout
  engine's on the same samples: ``training/rollout_probs_diff_{max,mean,std}`` (of the token
  probabilities, as the reference verl) and ``training/token_mult_prob_error`` (NeMo-RL);
- :func:`validation_metrics`: ``val-core/{data_source}/{var}/mean@{n}`` for the core variable
  (``acc`` when the scorer reports it, else ``reward``) and ``val-aux/...`` for the others and
  for ``std@n``, ``best@n/mean`` and ``worst@n/mean`` when ``n > 1``. Departure: best/worst are
  the exact extremes over each prompt's ``n`` samples, where the reference bootstraps them.
"""

from __future__ import annotations

import math
import resource
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from verl.protocol import Batch
from verl.rollout.checks import logprob_agreement

__all__ = ["data_metrics", "rollout_agreement_metrics", "throughput_metrics", "validation_metrics"]


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {f"{prefix}/mean": 0.0, f"{prefix}/max": 0.0, f"{prefix}/min": 0.0}
    v = values.double()
    return {
        f"{prefix}/mean": float(v.mean()),
        f"{prefix}/max": float(v.max()),
        f"{prefix}/min": float(v.min()),
    }


def data_metrics(batch: Batch, *, use_critic: bool) -> dict[str, float]:
    """Statistics of a finished step's batch (``token_level_scores``/``token_level_rewards``,
    ``advantages``, ``returns``, ``values`` [B, R], ``response_mask`` [B, R], ``attention_mask`` [B, P+R])."""
    mask = batch["response_mask"].bool()  # [B, R]
    r = mask.shape[1]
    prompt_mask = batch["attention_mask"][:, :-r]  # [B, P]
    out = {
        **_stats("critic/score", batch["token_level_scores"].sum(-1)),
        **_stats("critic/rewards", batch["token_level_rewards"].sum(-1)),
        **_stats("critic/advantages", batch["advantages"][mask]),
        **_stats("critic/returns", batch["returns"][mask]),
    }
    if use_critic:
        values, returns = batch["values"][mask].double(), batch["returns"][mask].double()
        out.update(_stats("critic/values", values))
        if values.numel() > 1:
            out["critic/vf_explained_var"] = float(1.0 - (returns - values).var() / (returns.var() + 1e-5))
    response_length = mask.sum(-1).float()
    prompt_length = prompt_mask.sum(-1).float()
    out.update(_stats("response_length", response_length))
    out["response_length/clip_ratio"] = float((response_length == r).float().mean())
    out.update(_stats("prompt_length", prompt_length))
    out["prompt_length/clip_ratio"] = float((prompt_length == prompt_mask.shape[1]).float().mean())
    return out


def throughput_metrics(batch: Batch, *, step_seconds: float, world_size: int) -> dict[str, float]:
    """Tokens processed per step and per second per rank, and memory peaks."""
    tokens = float(batch["attention_mask"].sum())
    if torch.cuda.is_available():
        peak_gb = torch.cuda.max_memory_allocated() / 2**30
    else:
        # No device allocator on CPU: the process's peak resident memory (ru_maxrss is in KiB on Linux).
        peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    out = {
        "perf/total_num_tokens": tokens,
        "perf/time_per_step": step_seconds,
        "perf/throughput": tokens / max(step_seconds, 1e-9) / world_size,
        "perf/max_memory_allocated_gb": peak_gb,
    }
    try:
        import psutil

        out["perf/cpu_memory_used_gb"] = psutil.virtual_memory().used / 2**30
    except ImportError:  # psutil comes with vLLM; without it the metric is left out
        pass
    return out


def rollout_agreement_metrics(
    rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """The engine's log-probabilities of its samples against the trainer's, all [B, R]."""
    mask = response_mask.bool()
    diff = (rollout_log_probs.double().exp() - old_log_probs.double().exp()).abs()[mask]
    agreement = logprob_agreement(rollout_log_probs, old_log_probs, response_mask)
    return {
        "training/rollout_probs_diff_max": float(diff.max()) if diff.numel() else 0.0,
        "training/rollout_probs_diff_mean": float(diff.mean()) if diff.numel() else 0.0,
        "training/rollout_probs_diff_std": float(diff.std()) if diff.numel() > 1 else 0.0,
        "training/rollout_logprob_diff_max": agreement["logprob_max_abs_diff"],
        "training/token_mult_prob_error": agreement["token_mult_prob_error"],
    }


def _numeric(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float, np.integer, np.floating)) and math.isfinite(float(value)):
        return float(value)
    return None


def validation_metrics(
    *, data_sources: Sequence[str], prompt_ids: Sequence[Any], variables: Mapping[str, Sequence[Any]]
) -> dict[str, float]:
    """Per-``data_source`` validation scores (see the module docstring).

    ``data_sources`` and ``prompt_ids`` have one entry per sample (the samples of one prompt
    share its id); ``variables`` maps a name (``reward``, ``acc``, ...) to one value per sample
    (non-numeric values are skipped).
    """
    # data_source -> var -> prompt -> values
    table: dict[str, dict[str, dict[Any, list[float]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list))
    )
    for name, values in variables.items():
        for source, prompt, value in zip(data_sources, prompt_ids, values):
            number = _numeric(value)
            if number is not None:
                table[str(source)][name][prompt].append(number)
    out: dict[str, float] = {}
    for source, per_var in table.items():
        core = "acc" if "acc" in per_var else "reward"
        for name, per_prompt in per_var.items():
            groups = list(per_prompt.values())
            n = max(len(g) for g in groups)
            mean = float(np.mean([np.mean(g) for g in groups]))
            section = "val-core" if name == core else "val-aux"
            out[f"{section}/{source}/{name}/mean@{n}"] = mean
            if n > 1:
                out[f"val-aux/{source}/{name}/std@{n}"] = float(np.mean([np.std(g) for g in groups]))
                out[f"val-aux/{source}/{name}/best@{n}/mean"] = float(np.mean([max(g) for g in groups]))
                out[f"val-aux/{source}/{name}/worst@{n}/mean"] = float(np.mean([min(g) for g in groups]))
    return out
