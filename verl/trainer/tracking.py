"""Metric sinks for the trainers (``trainer.logger``): console, jsonl, tensorboard, wandb, mlflow.

``Tracking(backends=[...], ...)`` fans ``log(metrics, step)`` out to every selected sink; each
sink is a plain factory function in ``LOGGERS`` (``@register_logger("name")``) returning an
object with ``log(metrics, step)`` and ``close()``. Only global rank 0 creates sinks; on other
ranks ``Tracking`` is a no-op, so trainers call it unconditionally.

Files go under ``log_dir``: ``metrics.jsonl`` (one JSON object per step: ``{"step": N,
"train/loss": ...}``) and ``tensorboard/`` (event files); ``rewind(step)`` drops what they hold
after a step, so a resumed run's re-done steps appear once. W&B and MLflow are used when their
packages are installed; selecting one that is missing is a ValueError that names the
package to install. ``progress_bar`` (from :mod:`verl.utils.progress`) is the loop's progress: a bar
on a terminal, a periodic log line in a log file or pipe, nothing on ranks other than 0.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from verl.utils.logging import global_rank
from verl.utils.progress import progress_bar

logger = logging.getLogger(__name__)

__all__ = ["LOGGERS", "MetricSink", "Tracking", "format_metrics", "progress_bar", "register_logger"]


class MetricSink(Protocol):
    """What a logger factory returns."""

    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def rewind(self, step: int) -> None:
        """Forget what was logged after ``step`` (a resumed run re-does those steps)."""
        ...

    def close(self) -> None: ...


SinkFactory = Callable[..., MetricSink]
LOGGERS: dict[str, SinkFactory] = {}


def register_logger(name: str) -> Callable[[SinkFactory], SinkFactory]:
    """Register a sink factory ``fn(*, project_name, experiment_name, log_dir, config) -> MetricSink``."""

    def deco(fn: SinkFactory) -> SinkFactory:
        if name in LOGGERS:
            raise ValueError(f"logger {name!r} is registered twice")
        LOGGERS[name] = fn
        return fn

    return deco


def _scalar(value: Any) -> float | None:
    """A plain float for a metric value (tensor, numpy or Python number); None for non-scalars."""
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        value = value.item()
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    return None


def _scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        v = _scalar(value)
        if v is not None:
            out[key] = v
    return out


def _fmt(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
        return f"{value:.3e}"
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.4f}"


def format_metrics(metrics: Mapping[str, float], step: int) -> str:
    """One readable line: ``step 12 | train/loss 1.2345 | train/lr 1.000e-05 | ...`` (sorted by name)."""
    parts = [f"step {step}"] + [f"{k} {_fmt(v)}" for k, v in sorted(metrics.items())]
    return " | ".join(parts)


# ----------------------------------------------------------------------------------------------
# sinks


class _ConsoleSink:
    def __init__(self) -> None:
        self._logger = logging.getLogger("verl.metrics")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self._logger.info("%s", format_metrics(metrics, step))

    def rewind(self, step: int) -> None:
        pass  # lines already printed stay printed

    def close(self) -> None:
        pass


class _JsonlSink:
    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        # Append: a resumed run continues the same file (after rewind drops the re-done steps).
        self._f = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        record = {"step": step, **{k: (v if math.isfinite(v) else str(v)) for k, v in metrics.items()}}
        self._f.write(json.dumps(record, sort_keys=True) + "\n")
        self._f.flush()

    def rewind(self, step: int) -> None:
        """Keep the records of steps <= ``step`` (and drop a line cut short by a kill), atomically."""
        self._f.close()
        kept, dropped = [], 0
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                try:
                    record_step = int(json.loads(line)["step"])
                except (ValueError, KeyError, TypeError):  # a line a killed run did not finish
                    dropped += 1
                    continue
                if record_step <= step:
                    kept.append(line if line.endswith("\n") else line + "\n")
                else:
                    dropped += 1
        if dropped:
            tmp = f"{self.path}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(kept)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            logger.warning("%s: dropped %d records after step %d (this run continues from step %d)",
                           self.path, dropped, step, step)
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def close(self) -> None:
        self._f.close()


class _TensorboardSink:
    def __init__(self, log_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._log_dir = log_dir
        self._writer_cls = SummaryWriter
        self.writer = SummaryWriter(log_dir=log_dir)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def rewind(self, step: int) -> None:
        # TensorBoard's own mechanism: events at or after purge_step are discarded when read.
        self.writer.close()
        self.writer = self._writer_cls(log_dir=self._log_dir, purge_step=step + 1)

    def close(self) -> None:
        self.writer.close()


class _WandbSink:
    def __init__(
        self, *, project_name: str, experiment_name: str, log_dir: str, config: Mapping[str, Any]
    ) -> None:
        import wandb

        self._wandb = wandb
        self.run = wandb.init(project=project_name, name=experiment_name, config=dict(config), dir=log_dir)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def rewind(self, step: int) -> None:
        pass  # a W&B run is append-only; re-logged steps are shown as logged

    def close(self) -> None:
        self.run.finish()


class _MlflowSink:
    def __init__(self, *, project_name: str, experiment_name: str, config: Mapping[str, Any]) -> None:
        import mlflow

        self._mlflow = mlflow
        mlflow.set_experiment(project_name)
        self.run = mlflow.start_run(run_name=experiment_name)
        flat = _flatten(config)
        # MLflow caps parameter values at a few hundred characters.
        mlflow.log_params({k: str(v)[:250] for k, v in flat.items()})

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        # MLflow metric names may not contain some characters W&B accepts ('@', ...); '/' is fine.
        self._mlflow.log_metrics({k: v for k, v in metrics.items() if math.isfinite(v)}, step=step)

    def rewind(self, step: int) -> None:
        pass  # MLflow keeps every logged value; re-logged steps get a second point

    def close(self) -> None:
        self._mlflow.end_run()


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, path + "."))
        else:
            out[path] = value
    return out


def _require(package: str, backend: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise ValueError(
            f"trainer.logger includes {backend!r} but the '{package}' package is not installed; "
            f"`pip install {package}` or remove {backend!r} from trainer.logger"
        )


@register_logger("console")
def _console(**_: Any) -> MetricSink:
    return _ConsoleSink()


@register_logger("jsonl")
def _jsonl(*, log_dir: str, **_: Any) -> MetricSink:
    return _JsonlSink(os.path.join(log_dir, "metrics.jsonl"))


@register_logger("tensorboard")
def _tensorboard(*, log_dir: str, **_: Any) -> MetricSink:
    _require("tensorboard", "tensorboard")
    return _TensorboardSink(os.path.join(log_dir, "tensorboard"))


@register_logger("wandb")
def _wandb(*, project_name: str, experiment_name: str, log_dir: str, config: Mapping[str, Any]) -> MetricSink:
    _require("wandb", "wandb")
    return _WandbSink(
        project_name=project_name, experiment_name=experiment_name, log_dir=log_dir, config=config
    )


@register_logger("mlflow")
def _mlflow(*, project_name: str, experiment_name: str, config: Mapping[str, Any], **_: Any) -> MetricSink:
    _require("mlflow", "mlflow")
    return _MlflowSink(project_name=project_name, experiment_name=experiment_name, config=config)


# ----------------------------------------------------------------------------------------------
# front end


class Tracking:
    """Send metrics to every selected sink, on global rank 0 only.

    Args:
        backends: names from ``LOGGERS`` (``trainer.logger``).
        project_name, experiment_name: run identity for W&B/MLflow.
        log_dir: folder for ``metrics.jsonl`` and ``tensorboard/``.
        config: the resolved config as a nested dict (recorded by W&B/MLflow).
        rank: the global rank; None reads torch.distributed (0 when not initialised).
    """

    def __init__(
        self,
        *,
        backends: Iterable[str],
        project_name: str,
        experiment_name: str,
        log_dir: str,
        config: Mapping[str, Any] | None = None,
        rank: int | None = None,
    ) -> None:
        backends = list(dict.fromkeys(backends))
        unknown = [b for b in backends if b not in LOGGERS]
        if unknown:
            raise ValueError(f"trainer.logger: unknown logger(s) {unknown}; available: {sorted(LOGGERS)}")
        self.rank = global_rank() if rank is None else rank
        self.log_dir = log_dir
        self.sinks: dict[str, MetricSink] = {}
        if self.rank != 0:
            return
        for name in backends:
            self.sinks[name] = LOGGERS[name](
                project_name=project_name,
                experiment_name=experiment_name,
                log_dir=log_dir,
                config=dict(config or {}),
            )

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record scalar ``metrics`` (floats, ints, one-element tensors) for ``step``; others are ignored."""
        if not self.sinks:
            return
        values = _scalars(metrics)
        for sink in self.sinks.values():
            sink.log(values, step)

    def rewind(self, step: int) -> None:
        """Drop what the file sinks hold after ``step``: a run resumed at ``step`` (0: from scratch)
        re-does the later steps, so ``metrics.jsonl`` and TensorBoard show each step once."""
        for sink in self.sinks.values():
            sink.rewind(step)

    def close(self) -> None:
        """Flush and close every sink (idempotent)."""
        for sink in self.sinks.values():
            sink.close()
        self.sinks = {}

    def __enter__(self) -> "Tracking":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
