"""The one RL loop: a thin driver of the step with callbacks (validation, checkpoint, loggers,
report, export) and stop signals.

``PPOTrainer.fit`` runs it to the end; ``verl.DataStream.step`` advances it one step at a time,
so a stream stepped by hand gets what ``fit`` gets:

- before the first step: resume from the checkpoint ``trainer.resume_mode`` selects, and
  validation when ``trainer.val_before_train``;
- after each step: validation every ``trainer.test_freq`` steps, a checkpoint every
  ``trainer.save_freq``, the metrics to the loggers, ``report.html`` every ``trainer.report_freq``;
  a stop signal (SIGTERM/SIGINT/SIGUSR1, agreed by every rank) checkpoints and ends the run;
- when the data or ``total_training_steps`` are used up: the last validation, the final
  checkpoint, the Hugging Face export (``trainer.save_hf``) and the report; then
  :meth:`Loop.step` returns None.

A collective that fails because another rank died or hung raises ``RankFailure`` naming it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from verl.parallel.bootstrap import end_startup
from verl.trainer.resilience import StopSignals, is_collective_failure, log_stop, rank_failure
from verl.trainer.run_checks import hf_export_dir
from verl.trainer.tracking import progress_bar
from verl.utils.logging import log_rank0

if TYPE_CHECKING:
    from verl.trainer.ppo_trainer import PPOTrainer

logger = logging.getLogger(__name__)

__all__ = ["Callback", "CheckpointCallback", "ExportCallback", "LoggerCallback", "Loop", "ReportCallback", "ValidationCallback"]


class Callback:
    """Hooks of :class:`Loop`; a callback overrides the ones it needs (each a no-op here)."""

    def on_train_begin(self, loop: "Loop") -> None:
        """Once, before the first step (after resuming)."""

    def on_step_end(self, loop: "Loop", metrics: dict[str, float]) -> None:
        """After each step; may add to the step's ``metrics`` (in callback order)."""

    def on_stop(self, loop: "Loop") -> None:
        """When a stop signal ends the run after a step."""

    def on_train_end(self, loop: "Loop") -> None:
        """When the data or the step count are used up (not after a stop or ``stop_after``)."""


def _due(freq: int, step: int) -> bool:
    return freq > 0 and step % freq == 0


def core_metrics(metrics: dict[str, float]) -> str:
    """The ``val-core/*`` metrics as one log line's text."""
    return ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items()) if k.startswith("val-core/")) or "none"


class ValidationCallback(Callback):
    """Validation before training (``val_before_train``), every ``test_freq`` steps, and at the end
    unless the last step was validated."""

    def on_train_begin(self, loop: "Loop") -> None:
        trainer, t = loop.trainer, loop.trainer.cfg.trainer
        if t.val_before_train and trainer.global_step == 0 and trainer.data.val_loader is not None:
            loop.val = trainer.validate()
            trainer.tracking.log(loop.val, trainer.global_step)
            log_rank0(logger, logging.INFO, "validation before training: %s", core_metrics(loop.val))

    def on_step_end(self, loop: "Loop", metrics: dict[str, float]) -> None:
        if _due(loop.trainer.cfg.trainer.test_freq, loop.trainer.global_step):
            loop.val = loop.trainer.validate()
            metrics.update(loop.val)

    def on_train_end(self, loop: "Loop") -> None:
        trainer, t = loop.trainer, loop.trainer.cfg.trainer
        if t.test_freq > 0 and trainer.data.val_loader is not None and not (loop.last and _due(t.test_freq, trainer.global_step)):
            loop.val = trainer.validate()
            trainer.tracking.log(loop.val, trainer.global_step)
        if loop.val:
            log_rank0(logger, logging.INFO, "validation after training: %s", core_metrics(loop.val))


class CheckpointCallback(Callback):
    """A checkpoint every ``save_freq`` steps, at a stop and at the end (``save_freq > 0`` for the
    end; a stop always saves the step it ends at)."""

    def on_step_end(self, loop: "Loop", metrics: dict[str, float]) -> None:
        if _due(loop.trainer.cfg.trainer.save_freq, loop.trainer.global_step):
            start = time.perf_counter()
            loop.trainer.save_checkpoint()
            metrics["timing_s/save_checkpoint"] = time.perf_counter() - start

    def on_stop(self, loop: "Loop") -> None:
        if loop.trainer.last_saved_step != loop.trainer.global_step:
            loop.trainer.save_checkpoint()

    def on_train_end(self, loop: "Loop") -> None:
        trainer = loop.trainer
        if trainer.cfg.trainer.save_freq > 0 and trainer.last_saved_step != trainer.global_step:
            trainer.save_checkpoint()


class ExportCallback(Callback):
    """The actor as a Hugging Face checkpoint at the end (``trainer.save_hf``)."""

    def on_train_end(self, loop: "Loop") -> None:
        trainer = loop.trainer
        if trainer.cfg.trainer.save_hf:
            trainer.post_phase("export_hf")
            trainer.export_actor_hf(hf_export_dir(trainer.cfg.trainer))


class LoggerCallback(Callback):
    """The step's metrics to the trainer's loggers (console, JSONL, TensorBoard, ...) every
    ``trainer.log_freq`` steps (and at a step that validates, the last step and a stop), and the
    progress bar (on a terminal) every step."""

    def __init__(self) -> None:
        self.bar: Any = None
        self.logged_step = -1

    def on_train_begin(self, loop: "Loop") -> None:
        t = loop.trainer
        self.bar = progress_bar(total=t.total_steps, initial=t.global_step, desc="rl", enabled=t.cfg.trainer.progress_bar)

    def _log(self, loop: "Loop", metrics: dict[str, float]) -> None:
        loop.trainer.tracking.log(metrics, loop.trainer.global_step)
        self.logged_step = loop.trainer.global_step

    def on_step_end(self, loop: "Loop", metrics: dict[str, float]) -> None:
        trainer, t = loop.trainer, loop.trainer.cfg.trainer
        step = trainer.global_step
        if _due(t.log_freq, step) or _due(t.test_freq, step) or step >= trainer.total_steps:
            self._log(loop, metrics)
        if self.bar is not None:
            if "critic/score/mean" in metrics:  # DPO's steps have no reward
                self.bar.set_postfix(reward=f"{metrics['critic/score/mean']:.3f}")
            self.bar.update(1)

    def on_stop(self, loop: "Loop") -> None:
        self._log_last(loop)

    def on_train_end(self, loop: "Loop") -> None:  # the data used up between two logged steps
        self._log_last(loop)

    def _log_last(self, loop: "Loop") -> None:
        if loop.last and self.logged_step != loop.trainer.global_step:
            self._log(loop, loop.last)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class ReportCallback(Callback):
    """``report.html`` every ``report_freq`` steps, at a stop and at the end."""

    def on_step_end(self, loop: "Loop", metrics: dict[str, float]) -> None:
        if _due(loop.trainer.cfg.trainer.report_freq, loop.trainer.global_step):
            loop.trainer.write_report()

    def on_stop(self, loop: "Loop") -> None:
        loop.trainer.write_report()

    def on_train_end(self, loop: "Loop") -> None:
        loop.trainer.write_report()  # named in the run's list of outputs that closing the trainer logs


def default_callbacks() -> list[Callback]:
    """The loop's callbacks, in the order they run after a step."""
    return [ValidationCallback(), CheckpointCallback(), ExportCallback(), LoggerCallback(), ReportCallback()]


class Loop:
    """Runs ``step_fn`` (one step's metrics, or None when the data is used up) on ``trainer``
    with ``callbacks`` (module docstring). :meth:`step` advances one step; :meth:`close` removes
    the signal handlers and the progress bar (``PPOTrainer.fit`` and ``DataStream.close`` call it).
    """

    def __init__(
        self,
        trainer: "PPOTrainer",
        step_fn: Callable[[], dict[str, float] | None],
        callbacks: Sequence[Callback] | None = None,
    ) -> None:
        self.trainer = trainer
        self.step_fn = step_fn
        self.callbacks = list(default_callbacks() if callbacks is None else callbacks)
        self.last: dict[str, float] = {}  # the last step's metrics
        self.val: dict[str, float] = {}  # the latest validation's
        self.started = False
        self.finished = False
        self._signals: StopSignals | None = None

    @property
    def result(self) -> dict[str, float]:
        """The last step's metrics with the latest validation's."""
        return {**self.last, **self.val}

    def _run(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(self, *args)

    def step(self) -> dict[str, float] | None:
        """One step and its callbacks; its metrics, or None once the run is over (the end-of-run
        callbacks run when the data or ``total_steps`` are used up, before the first None)."""
        try:
            return self._step()
        except Exception as exc:
            if is_collective_failure(exc):
                t = self.trainer
                raise rank_failure(t.board, exc, timeout_s=t.cfg.trainer.collective_timeout_s) from exc
            raise

    def _step(self) -> dict[str, float] | None:
        if self.finished:
            return None
        trainer = self.trainer
        if not self.started:
            self.started = True
            self._signals = StopSignals().__enter__()
            trainer.resume()
            self._run("on_train_begin")
            end_startup()  # from here collectives wait trainer.collective_timeout_s (verl.parallel.bootstrap)
        if trainer.global_step >= trainer.total_steps:
            return self._finish()
        metrics = self.step_fn()
        if metrics is None:
            log_rank0(
                logger, logging.INFO, "the data is used up after step %d (trainer.total_epochs=%d); ending the run",
                trainer.global_step, trainer.cfg.trainer.total_epochs,
            )
            return self._finish()
        self._run("on_step_end", metrics)
        self.last = metrics
        trainer.post_phase("end_of_step")
        stop = self._signals.agreed()
        if stop is not None:
            self._run("on_stop")
            trainer.stopped_by = stop.name
            log_stop(stop.name, trainer.global_step, trainer.last_checkpoint)
            self.finished = True
            self.close()
        return metrics

    def _finish(self) -> None:
        self._run("on_train_end")
        self.finished = True
        self.close()
        return None

    def close(self) -> None:
        """Remove the signal handlers and close the progress bar (idempotent)."""
        for callback in self.callbacks:
            if callable(getattr(callback, "close", None)):
                callback.close()
        if self._signals is not None:
            self._signals.__exit__()
            self._signals = None
