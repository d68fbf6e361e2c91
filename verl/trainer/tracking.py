"""Metric sinks for the trainers (``trainer.logger``): console, jsonl, tensorboard, wandb, mlflow.

``Tracking(backends=[...], ...)`` fans ``log(metrics, step)`` out to every selected sink; each
sink is a plain factory function in ``LOGGERS`` (``@register_logger("name")``) returning an
object with ``log(metrics, step)``, ``rewind(step)``, ``close()`` and ``location()``. Only global
rank 0 creates sinks; on other ranks ``Tracking`` is a no-op, so trainers call it unconditionally.

Where each sink writes (all under ``log_dir`` unless the user points elsewhere):

- ``jsonl``: ``metrics.jsonl``, one JSON object per step (``{"step": N, "train/loss": ...}``);
- ``tensorboard``: event files in ``tensorboard/``;
- ``wandb``: a W&B run, its files in ``wandb/`` (``WANDB_MODE=offline``: files only, uploaded
  later with ``wandb sync``; online it needs ``WANDB_API_KEY`` or ``wandb login``);
- ``mlflow``: an MLflow run in experiment ``project_name``, at ``MLFLOW_TRACKING_URI`` when set,
  else in the SQLite store ``mlflow.db`` (``mlflow ui --backend-store-uri sqlite:///.../mlflow.db``).

``rewind(step)`` drops what the file sinks hold after a step, so a resumed run's re-done steps
appear once. Selecting W&B or MLflow without its package is a ValueError naming the package;
one that cannot start is a ValueError saying what to set. ``progress_bar`` (from
:mod:`verl.utils.progress`) is the loop's progress: a bar on a terminal, a periodic log line in
a log file or pipe, nothing on ranks other than 0.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from verl.utils.logging import global_rank
from verl.utils.outputs import OutputLocation, log_output_locations
from verl.utils.progress import progress_bar

logger = logging.getLogger(__name__)
_outputs_logger = logging.getLogger("verl.outputs")

__all__ = ["LOGGERS", "MetricSink", "Tracking", "format_metrics", "progress_bar", "register_logger", "rewind_jsonl"]


class MetricSink(Protocol):
    """What a logger factory returns."""

    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def rewind(self, step: int) -> None:
        """Forget what was logged after ``step`` (a resumed run re-does those steps)."""
        ...

    def close(self) -> None: ...

    def location(self) -> OutputLocation | None:
        """Where the sink writes, for the run's list of outputs (None: nowhere to point at)."""
        ...


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

    def location(self) -> None:
        return None


def rewind_jsonl(path: str, step: int) -> int:
    """Keep the ``{"step": N, ...}`` lines of ``path`` with N <= ``step`` (a line a killed run did
    not finish goes too), replacing the file atomically; returns how many lines went."""
    if not os.path.isfile(path):
        return 0
    kept, dropped = [], 0
    with open(path, encoding="utf-8") as f:
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
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return dropped


class _JsonlSink:
    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        # Append: a resumed run continues the same file (after rewind drops the re-done steps).
        self._f = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        # The call's step is the record's: a metric named "step" (a DataStream step logs one, as a
        # float) must not replace it, or the run report's reader skips the record.
        values = {k: (v if math.isfinite(v) else str(v)) for k, v in metrics.items() if k != "step"}
        record = {"step": step, **values}
        self._f.write(json.dumps(record, sort_keys=True) + "\n")
        self._f.flush()

    def rewind(self, step: int) -> None:
        """Keep the records of steps <= ``step`` (and drop a line cut short by a kill), atomically."""
        self._f.close()
        dropped = rewind_jsonl(self.path, step)
        if dropped:
            logger.warning("%s: dropped %d records after step %d (this run continues from step %d)",
                           self.path, dropped, step, step)
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def close(self) -> None:
        self._f.close()

    def location(self) -> OutputLocation:
        return OutputLocation("metrics (jsonl)", self.path)


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

    def location(self) -> OutputLocation:
        return OutputLocation("TensorBoard", self._log_dir, use=f"tensorboard --logdir {os.path.abspath(self._log_dir)}")


class _WandbSink:
    """A W&B run in ``log_dir/wandb/`` (``WANDB_MODE=offline``: files only, ``wandb sync`` them later)."""

    def __init__(
        self, *, project_name: str, experiment_name: str, log_dir: str, config: Mapping[str, Any]
    ) -> None:
        import wandb

        os.makedirs(log_dir, exist_ok=True)
        try:
            self.run = wandb.init(project=project_name, name=experiment_name, config=dict(config), dir=log_dir)
        except Exception as exc:  # UsageError (no API key), CommError (no network), ...
            raise ValueError(
                f"trainer.logger includes 'wandb' but W&B could not start ({_first_line(exc)}); set WANDB_API_KEY "
                f"(or run `wandb login`), or WANDB_MODE=offline to keep the run in {os.path.abspath(log_dir)}/wandb "
                "and `wandb sync` it later"
            ) from None

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def rewind(self, step: int) -> None:
        pass  # a W&B run is append-only; re-logged steps are shown as logged

    def close(self) -> None:
        self.run.finish()

    def location(self) -> OutputLocation:
        sync_dir = self.run.settings.sync_dir
        if self.run.url:
            return OutputLocation("W&B run", self.run.url, use=f"files in {sync_dir}")
        return OutputLocation("W&B run", sync_dir, use=f"offline; upload with `wandb sync {sync_dir}`")


class _MlflowSink:
    """An MLflow run in experiment ``project_name``: at ``MLFLOW_TRACKING_URI`` when set, else in a
    SQLite store ``log_dir/mlflow.db`` (artifacts in ``log_dir/mlartifacts``), which MLflow 3 needs
    for a local store (its ./mlruns file store refuses to start)."""

    def __init__(
        self, *, project_name: str, experiment_name: str, log_dir: str, config: Mapping[str, Any]
    ) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        given = os.environ.get("MLFLOW_TRACKING_URI")
        log_dir = os.path.abspath(log_dir)
        self.uri = given or f"sqlite:///{os.path.join(log_dir, 'mlflow.db')}"
        try:
            if not given:
                os.makedirs(log_dir, exist_ok=True)
            self.client = MlflowClient(tracking_uri=self.uri)
            experiment = self.client.get_experiment_by_name(project_name)
            if experiment is not None:
                experiment_id = experiment.experiment_id
            else:
                artifacts = None if given else "file://" + os.path.join(log_dir, "mlartifacts")
                experiment_id = self.client.create_experiment(project_name, artifact_location=artifacts)
            self.run_id = self.client.create_run(experiment_id, run_name=experiment_name).info.run_id
        except Exception as exc:  # MlflowException (file store, bad URI), ImportError (no SQLAlchemy), ...
            where = "MLFLOW_TRACKING_URI" if given else "the local store"
            raise ValueError(
                f"trainer.logger includes 'mlflow' but MLflow could not start with {where} {self.uri} "
                f"({_first_line(exc)}); set MLFLOW_TRACKING_URI to a database (sqlite:///PATH/mlflow.db) or a "
                f"server (http://HOST:5000), or unset it to use {log_dir}/mlflow.db (needs `pip install mlflow`)"
            ) from None
        self.experiment = project_name
        # MLflow caps parameter values (a few hundred characters in older servers) and batch sizes.
        params = [Param(k, str(v)[:250]) for k, v in _flatten(config).items()]
        for i in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        # MLflow stores no NaN/inf; '/' is a valid character of a metric name.
        batch = [Metric(k, v, now, step) for k, v in metrics.items() if math.isfinite(v)]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def rewind(self, step: int) -> None:
        pass  # MLflow keeps every logged value; re-logged steps get a second point

    def close(self) -> None:
        self.client.set_terminated(self.run_id)

    def location(self) -> OutputLocation:
        view = f"mlflow ui --backend-store-uri {self.uri}" if self.uri.startswith("sqlite:") else "its web UI"
        return OutputLocation("MLflow run", self.uri, use=f"experiment {self.experiment!r}, run {self.run_id}; {view}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


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
def _mlflow(*, project_name: str, experiment_name: str, log_dir: str, config: Mapping[str, Any]) -> MetricSink:
    _require("mlflow", "mlflow")
    return _MlflowSink(project_name=project_name, experiment_name=experiment_name, log_dir=log_dir, config=config)


# ----------------------------------------------------------------------------------------------
# front end


class Tracking:
    """Send metrics to every selected sink, on global rank 0 only; list the run's outputs.

    Create it before any model is built: a logger that cannot start (a missing package, W&B
    without an API key, an MLflow store that refuses) is a ValueError naming what to set, raised
    on every rank when torch.distributed is initialised (rank 0 decides), so none is left waiting.
    Once the sinks are up, rank 0 logs every output location of the run (``outputs`` plus the
    sinks' files and runs), absolute; :meth:`close` logs them again, marking what was not written.

    Args:
        backends: names from ``LOGGERS`` (``trainer.logger``).
        project_name, experiment_name: run identity for W&B/MLflow.
        log_dir: folder for ``metrics.jsonl``, ``tensorboard/``, ``wandb/`` and ``mlflow.db``.
        config: the resolved config as a nested dict (recorded by W&B/MLflow).
        outputs: the trainer's own outputs (checkpoints, Hugging Face export, report), listed first.
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
        outputs: Sequence[OutputLocation] = (),
        rank: int | None = None,
    ) -> None:
        backends = list(dict.fromkeys(backends))
        unknown = [b for b in backends if b not in LOGGERS]
        if unknown:
            raise ValueError(f"trainer.logger: unknown logger(s) {unknown}; available: {sorted(LOGGERS)}")
        self.rank = global_rank() if rank is None else rank
        self.log_dir = log_dir
        self.sinks: dict[str, MetricSink] = {}
        self.outputs: list[OutputLocation] = []
        error = None
        if self.rank == 0:
            try:
                for name in backends:
                    self.sinks[name] = LOGGERS[name](
                        project_name=project_name,
                        experiment_name=experiment_name,
                        log_dir=log_dir,
                        config=dict(config or {}),
                    )
            except ValueError as exc:
                error = str(exc)
                self.close(list_outputs=False)
        error = _same_on_every_rank(error)
        if error is not None:
            raise ValueError(error)
        if self.rank == 0:
            sink_outputs = [getattr(sink, "location", lambda: None)() for sink in self.sinks.values()]
            self.outputs = [*outputs, *(loc for loc in sink_outputs if loc is not None)]
            log_output_locations("outputs of this run", self.outputs, logger=_outputs_logger)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record scalar ``metrics`` (floats, ints, one-element tensors) for ``step``; others are ignored."""
        if not self.sinks:
            return
        values = _scalars(metrics)
        for sink in self.sinks.values():
            sink.log(values, step)

    def add_sink(self, name: str, sink: MetricSink) -> None:
        """Send every later :meth:`log` to ``sink`` too (``verl.monitor.VerlMonitor`` watches a run
        this way); a no-op on ranks other than 0, which log nothing. A taken name is a ValueError."""
        if self.rank != 0:
            return
        if name in self.sinks:
            raise ValueError(f"the run already has a metric sink named {name!r} ({sorted(self.sinks)})")
        self.sinks[name] = sink

    def rewind(self, step: int) -> None:
        """Drop what the file sinks hold after ``step``: a run resumed at ``step`` (0: from scratch)
        re-does the later steps, so ``metrics.jsonl`` and TensorBoard show each step once."""
        for sink in self.sinks.values():
            sink.rewind(step)

    def close(self, *, list_outputs: bool = True) -> None:
        """Flush and close every sink, then list the run's outputs once more (idempotent).
        ``list_outputs=False``: a run that failed before its first step has nothing to point at."""
        for sink in self.sinks.values():
            sink.close()
        self.sinks = {}
        outputs, self.outputs = self.outputs, []
        if list_outputs:
            log_output_locations("outputs of this run", outputs, logger=_outputs_logger, at_end=True)

    def __enter__(self) -> "Tracking":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _same_on_every_rank(error: str | None) -> str | None:
    """Rank 0's ``error`` on every rank of an initialised torch.distributed world (else as given)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return error
    if torch.distributed.get_world_size() == 1:
        return error
    box = [error]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]
