"""``DataStream``: one PPO/GRPO step composed of operators, run by the one trainer loop.

A stream holds a :class:`verl.trainer.ppo_trainer.PPOTrainer` (its roles, data loader, checkpoints
and loggers) and a list of operators. :meth:`DataStream.step` passes one batch through the
operators in order; :meth:`DataStream.fit` hands that step to ``PPOTrainer.fit(step_fn=...)``, so
validation, checkpoints every ``save_freq``, stop signals and the run report are the trainer's.

Where the trainer comes from:

- ``DataStream(trainer=t)``: an ``PPOTrainer`` the caller built (and closes); the operators' own
  settings (``PPOUpdateOperator(estimator=...)``, ``RolloutOperator(n=...)``) must agree with its
  config, or :meth:`add_operator` fails naming the key;
- ``DataStream(model=PATH, train_files=FILE, config="ppo_trainer", overrides=[...])``: the stream
  builds the config (the YAML file, then ``overrides``, then the operators' settings) and the
  trainer on its first :meth:`step`/:meth:`fit`, starting a world of one process when
  torch.distributed is not initialised; :meth:`close` frees both.

``device_map={"actor": [0, 1], "rollout_sampler": [0, 1]}`` places the roles
(``verl.parallel.device_map``) on the devices ``0 .. N-1`` of one node, one rank each, with a
launched world of N processes: the same devices for every role (colocated, the hybrid engine), or
roles on devices of their own (``{"actor": [0], "reward_model": [1]}``: ``trainer.placement``),
the rollout engine with the actor unless it is given devices of its own. It is checked when the stream is made and sets
``trainer.device``, ``trainer.n_gpus_per_node``, ``trainer.nnodes`` and ``trainer.placement`` (a
given trainer must already agree).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from verl.config.schema import DataConfig
from verl.trainer.model_objects import is_model_object
from verl.trainer.step.base import Operator
from verl.trainer.step.pipeline import StepPipeline

if TYPE_CHECKING:
    from verl.api.monitor import VerlMonitor
    from verl.config import PPOConfig
    from verl.trainer.ppo_trainer import PPOTrainer

logger = logging.getLogger(__name__)

__all__ = ["DataStream", "build_config", "build_trainer"]


def build_config(
    *,
    model: str | None = None,
    train_files: str | Sequence[str] | None = None,
    config: str = "ppo_trainer",
    overrides: Sequence[str] = (),
    validate: bool = True,
) -> "PPOConfig":
    """A ``PPOConfig`` from a YAML file under configs/ (or a path), the model and data paths, then
    ``key=value`` ``overrides`` (later ones win); checked against the launched world size
    (``validate=False``: a draft to read settings from, not checked)."""
    from verl.config import PPOConfig, load_config
    from verl.config.validation import deferred_validation

    args: list[str] = []
    if model is not None:
        args.append(f"actor_rollout_ref.model.path={os.fspath(model)}")
    if train_files is not None:
        files = [train_files] if isinstance(train_files, (str, os.PathLike)) else list(train_files)
        args.append(f"data.train_files=[{','.join(os.fspath(f) for f in files)}]")
    if not validate:
        with deferred_validation():
            return load_config(PPOConfig, config_file=config, overrides=[*args, *overrides])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return load_config(PPOConfig, config_file=config, overrides=[*args, *overrides], world_size=world)


def prepare_start(cfg: "PPOConfig") -> None:
    """The command line's quiet start for a run from Python: verl's log lines (what is built, where the
    outputs go), the dependencies' chatter filtered, progress bars on a terminal only; before the
    trainer's imports (``verl.trainer.startup.prepare_run``)."""
    from verl.trainer.startup import prepare_run
    from verl.utils.logging import ensure_logging

    ensure_logging()
    prepare_run(cfg.trainer)


def build_trainer(cfg: "PPOConfig") -> tuple["PPOTrainer", bool]:
    """``PPOTrainer(cfg)`` on the current torch.distributed world, or on the world of one that this
    call starts (``verl.parallel.bootstrap.start_world``: ``trainer.device``, the collective
    timeout); returns the trainer and whether the world was started here."""
    from verl.parallel.bootstrap import destroy_distributed, start_world

    prepare_start(cfg)
    from verl.trainer.ppo_trainer import PPOTrainer

    started = start_world(cfg.trainer)
    try:
        return PPOTrainer(cfg), started
    except BaseException:
        if started:
            destroy_distributed()
        raise


def _sets(overrides: Sequence[str], key: str) -> bool:
    """Whether ``key=value`` is among ``overrides``."""
    return any(o.split("=", 1)[0].strip() == key for o in overrides)


def _files_setting(files: Any) -> str:
    if isinstance(files, (str, os.PathLike)):
        return os.fspath(files)
    return "[" + ",".join(os.fspath(f) for f in files) + "]"


def _config_value(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


class DataStream:
    """Operators run in order on one batch per step (see the module docstring).

    Args:
        trainer: an ``PPOTrainer`` to run on; or None to build one from the arguments below.
        model: the actor (``actor_rollout_ref.model.path``): a Hugging Face checkpoint directory or
            a model object (``verl.trainer.model_objects``: a ``...ForCausalLM`` of a supported family
            for Megatron, another ``nn.Module`` with ``generate()`` for the plain PyTorch engine); None when an operator names
            it (``RolloutOperator(model=)``, ``PPOUpdateOperator(actor=)``). The trained weights
            are loaded back into a model object by :meth:`close`.
        tokenizer: the tokenizer of a ``model`` object (an object or its directory).
        train_files: parquet/jsonl/json prompt files (``data.train_files``).
        val_files: validation prompt files (``data.val_files``); without them (and without a
            ``data.val_files=`` override or a validation file in ``config``) the stream does not validate.
        config: the YAML config the trainer starts from (a name under configs/ or a path).
        overrides: ``key=value`` settings applied after ``config`` (``data.train_batch_size=8``).
        device_map: role -> devices (``{"actor": [0, 1], "rollout_sampler": [0, 1]}``; roles left
            out run on the same devices); see the module docstring and ``verl.parallel.device_map``.
    """

    def __init__(
        self,
        trainer: "PPOTrainer | None" = None,
        *,
        model: Any = None,
        tokenizer: Any = None,
        train_files: str | Sequence[str] | None = None,
        val_files: str | Sequence[str] | None = None,
        config: str = "ppo_trainer",
        overrides: Sequence[str] = (),
        device_map: Mapping[str, Any] | None = None,
    ) -> None:
        from verl.trainer.model_objects import is_model_object, model_directory

        if trainer is not None and (model is not None or train_files is not None or val_files is not None or overrides):
            raise ValueError("DataStream: pass either trainer= or model=/train_files=/val_files=/overrides=, not both")
        # Model objects whose trained weights close() loads back (the stream's, its operators').
        self._model_objects: list[Any] = []
        if is_model_object(model):
            self._model_objects.append(model)
            model = model_directory(model, what="DataStream(model=...)", tokenizer=tokenizer, head="lm")
        elif tokenizer is not None:
            raise ValueError("DataStream(tokenizer=...) goes with a model object (model=<...ForCausalLM>)")
        self._trainer = trainer
        self._owns_trainer = trainer is None
        self._started_world = False
        self._build_args = dict(
            model=model, train_files=train_files, val_files=val_files, config=config, overrides=tuple(overrides)
        )
        # The stream's step: the trainer's kind of pipeline, with the user's operators in it.
        self._pipeline = StepPipeline(time_operators=True)
        if trainer is not None:  # one pipeline per run: the stream's replaces the trainer's own
            trainer.use_pipeline(self._pipeline)
        self._loop: Any = None  # the trainer's loop that step() advances (verl.trainer.loop.Loop)
        self.monitor: "VerlMonitor | None" = None
        self.placement = None if device_map is None else self._place(device_map, trainer, tuple(overrides))

    @property
    def operators(self) -> list[Any]:
        """The stream's operators, in order."""
        return self._pipeline.operators

    @property
    def _names(self) -> list[str]:
        return self._pipeline.names

    # -- building -------------------------------------------------------------------------

    def add_operator(self, op: Any) -> "DataStream":
        """Append ``op``; fails (ValueError) when one of its inputs is produced by no earlier
        operator, or when its settings disagree with the given trainer's config. Returns the stream."""
        name = self._pipeline.check(op)  # first: nothing is recorded for an operator it refuses
        if self._trainer is not None and isinstance(op, Operator):
            self._check_settings(name, op, self._trainer.cfg)
        if isinstance(op, Operator):
            self._check_agreement(name, op)
            for attr in ("model", "actor"):
                given = getattr(op, attr, None)
                if is_model_object(given) and not any(given is m for m in self._model_objects):
                    self._model_objects.append(given)
        self._pipeline.add(op)
        if self._trainer is not None and isinstance(op, Operator):
            op.bind(self._trainer.pieces)
        return self

    def with_monitor(self, monitor: "VerlMonitor") -> "DataStream":
        """Watch the run with ``monitor`` (``verl.monitor.VerlMonitor``): the trainer logs to its
        ``log_dir`` and rewrites ``report.html`` every ``report_interval`` steps. A stream that builds
        its trainer configures it so; a given trainer must already agree. Returns the stream."""
        from verl.api.monitor import VerlMonitor

        if not isinstance(monitor, VerlMonitor):
            raise TypeError(f"with_monitor takes a verl.monitor.VerlMonitor, got {type(monitor).__name__}")
        if self.monitor is not None and self.monitor is not monitor:
            raise ValueError("this DataStream already has a monitor; one stream logs to one folder")
        if self._trainer is not None:
            monitor.attach(self._trainer)
        self.monitor = monitor
        return self

    @staticmethod
    def _place(device_map: Mapping[str, Any], trainer: "PPOTrainer | None", overrides: Sequence[str]) -> Any:
        """``device_map`` checked against the launched world, the devices here and the trainer's config
        (a given trainer's, or the ``overrides`` of one the stream builds)."""
        import torch
        import torch.distributed as dist

        from verl.parallel.device_map import override_value, placement_conflicts, resolve_device_map

        cuda = torch.cuda.device_count()
        if trainer is not None:
            t = trainer.cfg.trainer
            device = t.device if t.device != "auto" else ("cuda" if cuda > 0 else "cpu")
            placement = resolve_device_map(device_map, world_size=trainer.world_size, cuda_devices=cuda, device=device)
            if (t.nnodes, t.n_gpus_per_node) != (1, len(placement.devices)):
                raise ValueError(
                    f"device_map places the roles on {len(placement.devices)} device(s) of one node, but the trainer "
                    f"was built with trainer.nnodes={t.nnodes} trainer.n_gpus_per_node={t.n_gpus_per_node}; build it "
                    f"with trainer.nnodes=1 trainer.n_gpus_per_node={len(placement.devices)}, or leave device_map out"
                )
            if {k: list(v) for k, v in t.placement.items()} != placement.role_devices:
                raise ValueError(
                    f"device_map puts roles apart as {placement.role_devices or 'nowhere (all colocated)'}, but the "
                    f"trainer was built with trainer.placement={dict(t.placement)}; build it with the same placement, "
                    "or leave device_map out"
                )
            return placement
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        placement = resolve_device_map(
            device_map, world_size=world, cuda_devices=cuda, device=override_value(overrides, "trainer.device")
        )
        conflicts = placement_conflicts(placement, overrides)
        if conflicts:
            wanted = " ".join(f"{k}={v}" for k, v in placement.config_overrides().items())
            raise ValueError(
                f"device_map sets {wanted}, but overrides set {' '.join(conflicts)}; drop those overrides "
                "(device_map sets them) or leave device_map out"
            )
        return placement

    def _check_agreement(self, name: str, op: Operator) -> None:
        """Two operators (or an operator and the stream's ``model=``) that set one key differently
        cannot both hold: the stream has one trainer, one actor."""
        mine = op.config_overrides()
        model = self._build_args["model"]
        if model is not None and "actor_rollout_ref.model.path" in mine:
            if mine["actor_rollout_ref.model.path"] != model:
                raise ValueError(
                    f"operator {name} names the actor {mine['actor_rollout_ref.model.path']} but the stream's model= is "
                    f"{model}; one stream trains one actor: give the same model (or only one of them)"
                )
        for other_name, other in zip(self._names, self.operators):
            if not isinstance(other, Operator):
                continue
            theirs = other.config_overrides()
            for key in mine.keys() & theirs.keys():
                if mine[key] != theirs[key]:
                    raise ValueError(
                        f"operator {name} sets {key}={mine[key]!r} but operator {other_name} set {key}={theirs[key]!r}; "
                        "the stream builds one trainer: make them agree"
                        + (" (one actor generates and trains: give RolloutOperator(model=) and "
                           "PPOUpdateOperator(actor=) the same model)" if key == "actor_rollout_ref.model.path" else "")
                    )

    def _check_settings(self, name: str, op: Operator, cfg: "PPOConfig") -> None:
        for key, wanted in op.config_overrides().items():
            have = _config_value(cfg, key)
            if have != wanted:
                raise ValueError(
                    f"operator {name} sets {key}={wanted!r} but the trainer was built with {key}={have!r}; "
                    f"build the trainer with {key}={wanted!r}, or build the stream from model=/train_files= "
                    "so that its operators configure the trainer"
                )

    def config(self) -> "PPOConfig":
        """The config a stream that builds its trainer builds it from: the YAML file, ``overrides``,
        the ``device_map``'s settings, the operators' settings, the monitor's; checked against the
        launched world size. A given trainer's config for ``DataStream(trainer=...)``."""
        if self._trainer is not None:
            return self._trainer.cfg
        overrides = list(self._build_args["overrides"])
        if self.placement is not None:
            overrides += [f"{k}={v}" for k, v in self.placement.config_overrides().items()]
        for op in self.operators:
            if isinstance(op, Operator):
                overrides += [f"{k}={v}" for k, v in op.config_overrides().items()]
        if self._build_args["model"] is None and not _sets(overrides, "actor_rollout_ref.model.path"):
            raise ValueError(
                "DataStream has no actor model: give DataStream(model=...), RolloutOperator(model=...) or "
                "PPOUpdateOperator(actor=...) (a Hugging Face model directory or object)"
            )
        if self._build_args["val_files"] is not None:
            overrides.append(f"data.val_files={_files_setting(self._build_args['val_files'])}")
        build = dict(model=self._build_args["model"], train_files=self._build_args["train_files"], config=self._build_args["config"])
        # A draft, read and not validated, decides the last settings; the config is then built and validated once.
        draft = build_config(**build, overrides=overrides, validate=False)
        unset = DataConfig()  # the schema's defaults: example paths, not this user's files
        if draft.data.train_files == unset.train_files and not os.path.exists(os.path.expanduser(unset.train_files)):
            raise ValueError(
                "DataStream has no prompts: give DataStream(train_files=...) (parquet, jsonl or json files with a "
                "prompt column), or DataStream(trainer=...) built on your config"
            )
        if draft.data.val_files == unset.val_files and not _sets(overrides, "data.val_files"):
            overrides.append("data.val_files=null")  # given training files only, a stream does not validate
        if self.monitor is not None:  # its settings, with the jsonl logger the report reads added to the config's
            overrides += [f"{k}={v}" for k, v in self.monitor.config_overrides(draft.trainer.logger).items()]
        cfg = build_config(**build, overrides=overrides)
        for op in self.operators:  # what an operator cannot train with, before any model is built
            if isinstance(op, Operator):
                op.check_config(cfg)
        return cfg

    @property
    def trainer(self) -> "PPOTrainer":
        """The trainer, built now if the stream builds its own."""
        if self._trainer is None:
            cfg = self.config()
            self._trainer, self._started_world = build_trainer(cfg)
            self._trainer.use_pipeline(self._pipeline)  # binds the operators
            if self.monitor is not None:
                self.monitor.attach(self._trainer)
        return self._trainer

    # -- running --------------------------------------------------------------------------

    def run_operators(self) -> dict[str, float] | None:
        """One step through every operator; its metrics, or None when the data is used up.

        Besides the operators' own metrics: ``reward_mean`` (mean sequence score of the step's
        samples as the reward operator scored them, before any filter), ``loss`` (``actor/pg_loss``, or
        ``dpo/loss`` for DPO),
        ``kl`` (``actor/kl_loss``, the KL to the reference, when the actor uses a KL loss, else
        ``actor/ppo_kl``, old vs updated policy), ``timing_s/op/<name>`` per operator, ``step``.
        """
        if not self.operators:
            raise ValueError("DataStream has no operators: add_operator(RolloutOperator()) first")
        trainer = self.trainer
        metrics = self._pipeline.run(trainer.pieces)
        if metrics is None:
            return None
        metrics["timing_s/stream_step"] = metrics["timing_s/step"]
        if "actor/pg_loss" in metrics:
            metrics["loss"] = metrics["actor/pg_loss"]
        elif "dpo/loss" in metrics:
            metrics["loss"] = metrics["dpo/loss"]
        kl_key = "actor/kl_loss" if "actor/kl_loss" in metrics else "actor/ppo_kl"
        if kl_key in metrics:
            metrics["kl"] = metrics[kl_key]
        metrics["step"] = float(trainer.global_step)
        self.last_batch = self._pipeline.last_batch
        return metrics

    def step(self) -> dict[str, float] | None:
        """One step of the trainer's loop (``verl.trainer.loop.Loop``) with this stream's operators:
        the same as a step of :meth:`fit`. The first call resumes from the checkpoint
        ``trainer.resume_mode`` selects (and validates first with ``trainer.val_before_train``); each
        call then validates every ``trainer.test_freq`` steps, checkpoints every
        ``trainer.save_freq``, logs the metrics and rewrites ``report.html`` every
        ``trainer.report_freq``; a stop signal (SIGTERM, SIGINT, SIGUSR1) checkpoints the step and
        ends the run (:attr:`stopped_by`). Returns the step's metrics (:meth:`run_operators`), or
        None once the run is over: the data or ``trainer.total_training_steps`` used up (after the
        last validation, checkpoint, export and report, as :meth:`fit` ends) or a stop signal.
        :meth:`run_operators` runs the operators alone, without the loop."""
        if self._loop is None:
            from verl.trainer.loop import Loop

            self._loop = Loop(self.trainer, self.run_operators)
        return self._loop.step()

    @property
    def stopped_by(self) -> str | None:
        """The signal that ended the run (``SIGTERM`` ...), or None."""
        return None if self._trainer is None else self._trainer.stopped_by

    def fit(self, *, stop_after: int | None = None) -> dict[str, float]:
        """Train to the config's step count with this stream's step in the trainer's loop
        (``PPOTrainer.fit(step_fn=...)``: resume, validation, checkpoints, stop signals, report);
        ``stop_after`` ends it after that global step, as ``PPOTrainer.fit`` does."""
        return self.trainer.fit(stop_after=stop_after, step_fn=self.run_operators)

    def save_checkpoint(self) -> str:
        """The trainer's checkpoint at the current step (``global_step_N/`` under ``default_local_dir``)."""
        return self.trainer.save_checkpoint()

    def export_as_api(self, out_dir: str | None = None, **app_kwargs: Any) -> Any:
        """The actor's current weights as a Hugging Face checkpoint, served: a FastAPI app with the
        OpenAI-compatible routes (``verl.api.export.export_as_api``; docs/serving.md)."""
        from verl.api.export import export_as_api

        return export_as_api(self, out_dir, **app_kwargs)

    def write_back(self) -> None:
        """Load the actor's current weights into the model objects the stream was given (its
        ``model=``, ``RolloutOperator(model=)``, ``PPOUpdateOperator(actor=)``), through the
        trainer's Hugging Face export to ``<trainer.default_local_dir>/model_objects/global_step_N``
        (collective: every rank calls it; each rank loads its own objects). :meth:`close` does this."""
        from verl.api.export import export_policy
        from verl.trainer.model_objects import write_back

        if not self._model_objects:
            return
        trainer = self.trainer
        out_dir = os.path.join(trainer.cfg.trainer.default_local_dir, "model_objects", f"global_step_{trainer.global_step}")
        export_policy(self, out_dir)
        if os.path.isdir(out_dir):  # not on a node without the exporting rank's disk
            for model in self._model_objects:
                write_back(model, out_dir)
        else:
            logger.warning("DataStream: the actor's weights are in %s on the first node; not loaded into the model here", out_dir)

    def close(self) -> None:
        """Close the operators that hold resources (``close()``: the review page), then the trainer
        (and the world of one) if the stream built them."""
        if self._loop is not None:
            self._loop.close()
            self._loop = None
        for op in self.operators:
            if callable(getattr(op, "close", None)):
                op.close()
        if self._model_objects and self._trainer is not None and not self._trainer.closed:
            self.write_back()
        if self._owns_trainer and self._trainer is not None:
            self._trainer.close()
            self._trainer = None
            if self._started_world:
                from verl.parallel.bootstrap import destroy_distributed

                destroy_distributed()
                self._started_world = False

    def __enter__(self) -> "DataStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
