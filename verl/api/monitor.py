"""``verl.monitor.VerlMonitor``: watch a run through the trainer's own logs and report.

A monitor is not a second logger. It points the trainer's loggers at ``log_dir``
(``trainer.log_dir``: ``metrics.jsonl``, ``scores.jsonl``) and its run report at
``report_interval`` (``trainer.report_freq``: ``report.html`` rewritten every that many steps),
then joins the trainer's metric fan-out (``Tracking.add_sink``), so it sees exactly what
``metrics.jsonl`` records. Every ``report_interval`` steps it logs one summary line
(logger ``verl.monitor``): the step's reward mean and spread, KL, step time and memory peak.
:meth:`VerlMonitor.generate_report` writes ``report.html`` (``verl.trainer.report``: reward
distribution per step, KL, memory peak per phase, time per phase and per operator) now.

Use it with ``DataStream(...).with_monitor(monitor)`` or ``verl.RLTrainer.fit(..., monitor=monitor)``.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from verl.trainer.ppo_trainer import PPOTrainer

logger = logging.getLogger(__name__)

__all__ = ["VerlMonitor"]

SINK_NAME = "monitor"


def _first(metrics: Mapping[str, float], *keys: str) -> float | None:
    for key in keys:
        value = metrics.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            return float(value)
    return None


class VerlMonitor:
    """Summaries every ``report_interval`` steps and the run report, from the trainer's logs.

    Args:
        log_dir: the run's log folder (``trainer.log_dir``); made absolute.
        report_interval: steps between summary lines and report rewrites (``trainer.report_freq``).
    """

    def __init__(self, log_dir: str = "./logs", report_interval: int = 10) -> None:
        if not isinstance(report_interval, int) or isinstance(report_interval, bool) or report_interval < 1:
            raise ValueError(f"VerlMonitor(report_interval={report_interval!r}): give a whole number of steps >= 1")
        self.log_dir = os.path.abspath(os.path.expanduser(os.fspath(log_dir)))
        self.report_interval = report_interval
        self.summaries: list[dict[str, float]] = []
        """The summary of every ``report_interval``-th step seen, oldest first."""
        self._trainer: "PPOTrainer | None" = None

    def config_overrides(self, logger: Sequence[str] = ("console", "jsonl")) -> dict[str, Any]:
        """The trainer settings the monitor needs (dotted keys): its log folder, its report
        interval, and the ``jsonl`` logger the report is built from, added to ``logger`` (the
        loggers the config has) when it is not there."""
        out: dict[str, Any] = {"trainer.log_dir": self.log_dir, "trainer.report_freq": self.report_interval}
        if "jsonl" not in logger:
            out["trainer.logger"] = "[" + ",".join([*logger, "jsonl"]) + "]"
        return out

    def attach(self, trainer: "PPOTrainer") -> None:
        """Join ``trainer``'s metric fan-out; its log folder and report frequency must be this
        monitor's (ValueError naming the setting otherwise)."""
        t = trainer.cfg.trainer
        if os.path.abspath(t.log_dir) != self.log_dir:
            raise ValueError(
                f"VerlMonitor(log_dir={self.log_dir!r}) watches another folder than the trainer's "
                f"trainer.log_dir={t.log_dir!r}; build the trainer with trainer.log_dir={self.log_dir} or give "
                "the monitor its log_dir"
            )
        if t.report_freq != self.report_interval:
            raise ValueError(
                f"VerlMonitor(report_interval={self.report_interval}) but the trainer has "
                f"trainer.report_freq={t.report_freq}; build it with trainer.report_freq={self.report_interval}"
            )
        if "jsonl" not in t.logger:
            raise ValueError(
                f"VerlMonitor reads the run's metrics.jsonl, but trainer.logger={list(t.logger)} has no jsonl "
                "logger; add jsonl to trainer.logger"
            )
        if self._trainer is trainer:
            return
        trainer.tracking.add_sink(SINK_NAME, self)
        self._trainer = trainer

    # -- the metric-sink protocol (verl.trainer.tracking.MetricSink) ---------------------------

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if step <= 0 or step % self.report_interval != 0 or "training/global_step" not in metrics:
            return  # validation-only records and steps between summaries
        summary = {"step": float(step)}
        for name, keys in (
            ("reward_mean", ("critic/score/mean", "reward_mean")),
            ("reward_min", ("critic/score/min",)),
            ("reward_max", ("critic/score/max",)),
            ("kl", ("actor/kl_loss", "actor/ppo_kl")),
            ("step_s", ("timing_s/step", "timing_s/stream_step")),
            ("memory_peak_gb", ("perf/max_memory_allocated_gb",)),
            ("cpu_memory_gb", ("perf/cpu_memory_used_gb",)),
        ):
            value = _first(metrics, *keys)
            if value is not None:
                summary[name] = value
        self.summaries.append(summary)
        logger.info(
            "step %d: %s",
            step,
            ", ".join(f"{k} {v:.4g}" for k, v in summary.items() if k != "step"),
        )

    def rewind(self, step: int) -> None:
        self.summaries = [s for s in self.summaries if s["step"] <= step]

    def close(self) -> None:
        self._trainer = None

    def location(self) -> None:
        return None  # its files are the trainer's (metrics.jsonl, report.html)

    # -- the report -----------------------------------------------------------------------------

    def generate_report(self, out: str | None = None) -> str:
        """Write the run report (``report.html`` in ``log_dir``, or ``out``) from what the run has
        logged so far; returns its path. While the trainer runs, it is the trainer's
        ``write_report`` (which also records the run's config)."""
        trainer = self._trainer
        if out is None and trainer is not None and not trainer.closed:
            path = trainer.write_report()
            if path is not None:
                return path
        from verl.trainer import report

        return report.build_report(self.log_dir, out=out)
