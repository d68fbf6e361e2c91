"""Scoring one sample safely: the part of the reward manager that runs in pool workers.

Kept free of torch so that spawned workers start in about a second (importing torch costs
several seconds per worker on a loaded machine).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from verl.rewards.timeout import time_limit


@dataclass(frozen=True)
class SampleScore:
    """One sample's result: its score, the scorer's extra fields, and the error if it failed."""

    score: float
    extra: dict[str, Any]
    error: str | None = None


def _as_sample_score(result: Any) -> SampleScore:
    """Validate a scorer's return value: a real number, or a dict with a real ``"score"``."""
    extra: dict[str, Any] = {}
    if isinstance(result, Mapping):
        if "score" not in result:
            return SampleScore(0.0, {}, f"scorer returned a dict without 'score' (keys {sorted(result)[:10]})")
        extra = {k: v for k, v in result.items() if k != "score"}
        result = result["score"]
    if hasattr(result, "item") and getattr(result, "size", None) in (1, ()):
        result = result.item()  # a one-element numpy array or scalar
    try:
        value = float(result)
    except (TypeError, ValueError):
        return SampleScore(0.0, extra, f"scorer returned {type(result).__name__}, not a number")
    if not math.isfinite(value):
        return SampleScore(0.0, extra, f"scorer returned {value}")
    return SampleScore(value, extra)


def score_one(
    compute_score: Callable[..., Any],
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: Any,
    timeout_s: float | None,
) -> SampleScore:
    """Score one response under ``timeout_s``; failures become score 0.0 with the error recorded."""
    try:
        with time_limit(timeout_s) as limit:
            result = compute_score(
                data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info
            )
    except Exception as exc:  # a user's scorer may raise anything; it must not stop training
        return SampleScore(0.0, {}, f"{type(exc).__name__}: {exc}"[:500])
    if limit.expired:
        return SampleScore(0.0, {}, f"timed out after {timeout_s} s")
    return _as_sample_score(result)


def score_chunk(
    compute_score: Callable[..., Any], items: list[tuple[str, str, Any, Any]], timeout_s: float | None
) -> list[SampleScore]:
    """Score ``(data_source, solution_str, ground_truth, extra_info)`` items in order (one pool task)."""
    return [score_one(compute_score, ds, sol, gt, ei, timeout_s) for ds, sol, gt, ei in items]
