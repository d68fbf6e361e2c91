"""Exact mode (``trainer.deterministic``): the same config and seed give the same run bit for bit.

What verl seeds in every mode (exact or not): the data order (``trainer.seed``), every rollout
engine call (``rollout.seed`` + step, draw and call offsets: ``verl.trainer.step.pieces``), the
actor's shuffles per step, Megatron's RNG tracker per rank, the global RNGs after the engine starts;
dropout is refused (``verl.models.hf_config``). A checkpoint holds the data position, the queue of
batches generated ahead and every RNG state, so a resumed run continues the uninterrupted one.

What exact mode adds, for the process it runs in (:class:`ExactMode`, entered by ``PPOTrainer``):

- torch's deterministic algorithms (``torch.use_deterministic_algorithms``; an op that has no
  deterministic implementation is named in a warning, the run goes on), cuDNN's deterministic
  kernels and no autotuning, and cuBLAS's fixed workspace (``CUBLAS_WORKSPACE_CONFIG``, read when
  CUDA starts; a value the user set is kept);
- the async schedules whose samples depend on timing run step-paced (``pinned_async``):
  ``async_training.free_running`` and ``fill_update_window`` become the plain async schedule,
  where the batch of step ``t`` is begun with version ``max(0, t - 1 - max_staleness)`` in the
  step's fixed window and, with partial rollout, each later window runs exactly one segment of it.

Wall-clock and memory metrics (``timing_s/*``, ``perf/*``, ``memory/*``, and any key whose last part
ends in ``_s``: seconds or a rate per second, e.g. ``rollout/tokens_per_s``) differ between any two
runs; :func:`comparable` drops them.
docs/reproducibility.md has the measured cost and what an engine cannot promise.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from verl.utils.logging import log_rank0

__all__ = ["ExactMode", "comparable", "pinned_async", "wall_clock"]

logger = logging.getLogger(__name__)

# Metric prefixes of wall-clock times, speeds and memory (perf/ holds the memory peaks too).
_WALL_CLOCK_PREFIXES = ("timing_s/", "perf/", "memory/")


def wall_clock(key: str) -> bool:
    """Whether metric ``key`` measures time, speed or memory (differs between any two runs)."""
    return key.startswith(_WALL_CLOCK_PREFIXES) or key.rsplit("/", 1)[-1].endswith("_s")


def comparable(metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` without its wall-clock keys: what two exact runs give equal (``==``)."""
    return {k: v for k, v in metrics.items() if not wall_clock(k)}


def pinned_async(fill_update_window: bool, free_running: bool, *, deterministic: bool) -> tuple[bool, bool]:
    """The (fill_update_window, free_running) a run uses: both off in exact mode (their amount of
    work per window is paced by the clock), logged once when that changes the config's."""
    if deterministic and (fill_update_window or free_running):
        log_rank0(
            logger, logging.WARNING,
            "trainer.deterministic=true: trainer.async_training.%s=true generates as much as time allows, so which "
            "policy version samples which token would depend on timing; this run uses the step-paced async schedule "
            "(the same bound, a fixed amount of generation per step: docs/reproducibility.md)",
            "free_running" if free_running else "fill_update_window",
        )
        return False, False
    return fill_update_window, free_running


class ExactMode:
    """Turn on torch's deterministic settings for a run, and put back what was there when it ends
    (the settings are process-wide; a test or notebook may run more after the run)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._saved: tuple | None = None

    def __enter__(self) -> "ExactMode":
        if not self.enabled:
            return self
        self._saved = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.backends.cudnn.deterministic,
            torch.backends.cudnn.benchmark,
            os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        )
        # Before CUDA starts where it has not yet (cuBLAS reads it then); harmless without CUDA.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # warn_only: an op with no deterministic kernel is named in a warning instead of ending a long run.
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        log_rank0(logger, logging.INFO, "trainer.deterministic=true: torch's deterministic algorithms on for this run (docs/reproducibility.md)")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Put back the settings found on entry (idempotent)."""
        if self._saved is None:
            return
        algorithms, warn_only, cudnn_deterministic, cudnn_benchmark, workspace = self._saved
        self._saved = None
        torch.use_deterministic_algorithms(algorithms, warn_only=warn_only)
        torch.backends.cudnn.deterministic = cudnn_deterministic
        torch.backends.cudnn.benchmark = cudnn_benchmark
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = workspace
