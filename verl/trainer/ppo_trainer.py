"""``PPOTrainer``: PPO, GRPO, DAPO, DPO and their relatives on the roles of ``verl.roles``.

Every rank of the torchrun world runs the same code (SPMD). The trainer is composed of parts,
each with one job and a module of its own:

| part | module |
| --- | --- |
| the placement and the roles this rank holds, built in one ordered pass | ``verl.trainer.world`` (``build_rl_world``) |
| the tokenizer, datasets, loaders and each step's batch | ``verl.trainer.rl_data`` (``RLData``) |
| the step's pieces (rollout, reward, log-probs, advantages, updates) on the run's parts | ``verl.trainer.step.pieces`` (``StepPieces``, held as :attr:`PPOTrainer.pieces`; the operators bind to it) |
| the step as operators, one per algorithm, built from the config | ``verl.trainer.step`` (``build_step``) |
| the loop and its callbacks (validation, checkpoint, export, loggers, report, signals) | ``verl.trainer.loop`` (``Loop``) |
| validation | ``verl.trainer.validation`` |
| checkpoint folders (atomic, kept, resolved for resume) | ``verl.utils.checkpoint`` (``CheckpointManager``) |

This class holds the run's state (the step, the KL controller, the loggers, the checkpoints) and
saves and restores it. ``main_ppo``, ``verl.RLTrainer`` (the Python facade) and ``verl.DataStream``
all train through :meth:`PPOTrainer.fit`'s loop.

Checkpoints (``global_step_N/``): the actor and critic engines (model, optimizer, scheduler,
every rank's RNG states; reshardable), and in ``trainer_state.json`` the data loader's position,
the KL controller and the step. Sampling is seeded per step, so a resumed run samples what the
uninterrupted one did. At the end the actor is exported as a Hugging Face checkpoint.

Reliability (``verl.trainer.resilience``): SIGTERM/SIGINT/SIGUSR1 finish the step, checkpoint
and stop (every rank agrees after each step); a step whose update was skipped for a non-finite
loss or gradient norm is counted and ``trainer.max_consecutive_skipped_steps`` in a row stop the
run; a non-finite reward or advantage stops it before the update, naming the sample; each rank
posts its phase, so a collective that fails or times out (``trainer.collective_timeout_s``)
names the rank that stopped answering. An out-of-memory micro-batch is halved and redone
(``verl.roles.engine_role``). Learning-rate schedule lengths count trainer steps as in the
reference verl, converted to the engine's optimizer updates.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from verl.algos import make_kl_controller
from verl.config import PPOConfig, to_dict
from verl.trainer import report
from verl.trainer.exact import ExactMode
from verl.trainer.loop import Loop
from verl.trainer.ppo_checks import preflight
from verl.trainer.resilience import PhaseBoard, SkippedSteps
from verl.trainer.rl_data import RLData
from verl.trainer.run_checks import release_run_outputs, show_files
from verl.trainer.startup import run_outputs
from verl.trainer.step import build_step, step_kind
from verl.trainer.step.pieces import StepPieces
from verl.trainer.tracking import Tracking
from verl.trainer.validation import validate
from verl.trainer.world import build_rl_world
from verl.utils.checkpoint import ACTOR_SUBDIR, CRITIC_SUBDIR, CheckpointManager
from verl.utils.logging import log_rank0

logger = logging.getLogger(__name__)

__all__ = ["PPOTrainer"]


class PPOTrainer:
    """The RL trainer on an initialised torch.distributed world (see the module docstring).

    Call :meth:`fit`; :meth:`close` (or ``with PPOTrainer(cfg) as trainer``) frees the engines and
    Megatron's state.
    """

    def __init__(self, cfg: PPOConfig) -> None:
        if not dist.is_initialized():
            raise RuntimeError("PPOTrainer needs torch.distributed initialised (python -m verl.trainer.main_ppo does it)")
        self.world_size = dist.get_world_size()
        preflight(cfg, self.world_size)  # done already when main_ppo checked this config
        self.cfg = cfg
        t = cfg.trainer
        # Loggers first: one that cannot start fails before any model is built.
        self.tracking = Tracking(
            backends=t.logger,
            project_name=t.project_name,
            experiment_name=t.experiment_name,
            log_dir=t.log_dir,
            config=to_dict(cfg),
            outputs=run_outputs(t, model="actor", report_freq=t.report_freq),
        )
        # Exact mode's process-wide settings, before any model or engine is built (put back by close()).
        self.exact = ExactMode(t.deterministic).__enter__()
        try:
            self.data = RLData(cfg)
            self.world = build_rl_world(cfg, self.data.tokenizer, world_size=self.world_size, total_steps=self.data.total_steps)
        except BaseException:
            self.tracking.close(list_outputs=False)
            self.exact.close()
            raise
        w = self.world
        self.tokenizer, self.total_steps = self.data.tokenizer, self.data.total_steps
        self.topology, self.rollout, self.actor, self.reference, self.critic, self.reward = (
            w.topology, w.rollout, w.actor, w.reference, w.critic, w.reward,
        )
        self.n = cfg.actor_rollout_ref.rollout.n
        self.use_critic, self.use_reference = cfg.use_critic, cfg.use_reference
        a = cfg.algorithm
        self.kl_ctrl = make_kl_controller(
            type=a.kl_ctrl.type, kl_coef=a.kl_ctrl.kl_coef, target_kl=a.kl_ctrl.target_kl, horizon=a.kl_ctrl.horizon
        )
        keep = [k for k in (t.max_actor_ckpt_to_keep, t.max_critic_ckpt_to_keep) if k is not None]
        self.checkpoints = CheckpointManager(t.default_local_dir, max_to_keep=min(keep) if keep else None)
        # The run report's inputs beside metrics.jsonl (rank 0 writes them).
        self.reporting = t.report_freq != 0 and "jsonl" in t.logger
        self.is_rank0 = dist.get_rank() == 0
        self.scores_file = report.StepRecords(os.path.join(t.log_dir, report.SCORES_FILE))
        self.samples_file = report.StepRecords(os.path.join(t.log_dir, report.SAMPLES_FILE))
        self.board = PhaseBoard()
        self.closed = False
        self._last_saved_step: int | None = None
        self._config_written = False
        self._resumed = False
        self.skipped = SkippedSteps(t.max_consecutive_skipped_steps)
        self.stopped_by: str | None = None  # the signal that stopped fit(), if one did
        # The step's pieces on this run's parts: what the step's operators bind to (never the trainer).
        self.pieces = StepPieces(
            cfg=cfg, world=w, data=self.data, kl_ctrl=self.kl_ctrl, skipped=self.skipped, board=self.board,
            scores_file=self.scores_file, reporting=self.reporting, is_rank0=self.is_rank0,
        )
        self.pipeline = build_step(cfg)  # the config's step; fit() runs it (use_pipeline replaces it)
        self.pipeline.bind(self.pieces)
        available = t.total_epochs * self.data.steps_per_epoch
        if t.total_training_steps and t.total_training_steps > available:
            log_rank0(
                logger, logging.WARNING,
                "trainer.total_training_steps=%d but the data gives %d steps (trainer.total_epochs=%d x %d steps per "
                "epoch): the run stops at step %d; raise trainer.total_epochs to %d to train %d steps",
                t.total_training_steps, available, t.total_epochs, self.data.steps_per_epoch, available,
                -(-t.total_training_steps // self.data.steps_per_epoch), t.total_training_steps,
            )
        log_rank0(
            logger,
            logging.INFO,
            "RL trainer: %s on %s; training %s (%d prompts, %d steps per epoch of %d x n=%d, %d steps); %s; %s",
            _describe_step(cfg, self.pipeline),
            os.path.abspath(os.path.expanduser(cfg.actor_rollout_ref.model.path)),
            show_files(cfg.data.train_files),
            len(self.data.train_dataset),
            self.data.steps_per_epoch,
            cfg.data.train_batch_size,
            self.n,
            self.total_steps,
            f"validation {show_files(cfg.data.val_files)} ({len(self.data.val_dataset)} prompts)"
            if self.data.val_dataset is not None else "no validation",
            self.topology.describe(),
        )

    @property
    def global_step(self) -> int:
        """The steps begun (``StepPipeline.run`` advances the count; a resume sets it)."""
        pieces = getattr(self, "pieces", None)
        return pieces.global_step if pieces is not None else 0

    @global_step.setter
    def global_step(self, value: int) -> None:
        self.pieces.global_step = value

    @property
    def _last_checkpoint(self) -> str | None:
        pieces = getattr(self, "pieces", None)
        return pieces.last_checkpoint if pieces is not None else None

    @_last_checkpoint.setter
    def _last_checkpoint(self, path: str | None) -> None:
        self.pieces.last_checkpoint = path  # the skip count names it in its messages

    def train_step(self) -> dict[str, float] | None:
        """One step of the trainer's pipeline (the config's, ``verl.trainer.step.build_step``, or the one
        :meth:`use_pipeline` gave it) on its pieces; its metrics, or None when the data is used up."""
        return self.pipeline.run(self.pieces)

    def post_phase(self, phase: str) -> None:
        """Post the phase this rank enters (failure reports name it; ``StepPieces.post_phase``)."""
        self.pieces.post_phase(phase)

    @property
    def stream(self) -> Any:
        """The step's streaming rollout (``trainer.rollout_mode``: its queue is checkpointed), or None."""
        from verl.trainer.step.stream import StreamRolloutOperator

        pipeline = getattr(self, "pipeline", None)
        ops = pipeline.operators if pipeline is not None else ()
        return next((op for op in ops if isinstance(op, StreamRolloutOperator)), None)

    def use_pipeline(self, pipeline: Any) -> None:
        """Train with ``pipeline`` (a ``verl.trainer.step.StepPipeline``: a ``DataStream``'s, the facade's
        hybrid step) instead of the config's: one pipeline per run. The step replaced gives up its
        schedule (a free-running generator stops) before any step of the new one runs."""
        if pipeline is self.pipeline:
            return
        stream = self.stream
        if stream is not None and stream.queue:
            raise ValueError(
                f"the trainer's streaming rollout holds {len(stream.queue)} batches generated ahead, which another "
                "step would drop: give the DataStream its trainer before the trainer runs or resumes a step"
            )
        self.pipeline.schedule(self.world).close()
        pipeline.bind(self.pieces)
        self.pipeline = pipeline

    # -- validation and report ------------------------------------------------------------

    def validate(self) -> dict[str, float]:
        """Validation with ``rollout.val_kwargs`` (``verl.trainer.validation``): ``val-core/{data_source}/...``."""
        with self._engine_held():
            return validate(self)

    def _engine_held(self) -> contextlib.AbstractContextManager:
        """A block in which nothing runs beside the main thread: the step's schedule's hold (the
        free-running generator holds the engine and the queue otherwise; ``verl.trainer.step.schedule``)."""
        pipeline = getattr(self, "pipeline", None)
        return pipeline.schedule(self.world).hold() if pipeline is not None else contextlib.nullcontext()

    def write_report(self) -> str | None:
        """Rewrite ``report.html`` in ``trainer.log_dir`` from what the run logged (rank 0); its path."""
        if not (self.reporting and self.is_rank0):
            return None
        t = self.cfg.trainer
        config_path = os.path.join(t.log_dir, report.CONFIG_FILE)
        if not self._config_written:  # this run's config (a resumed run's overrides may differ)
            self._config_written = True
            tmp = f"{config_path}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(to_dict(self.cfg), f, indent=2, sort_keys=True, default=str)
            os.replace(tmp, config_path)
        return report.build_report(t.log_dir, title=f"{t.project_name} / {t.experiment_name}")

    # -- checkpoints ----------------------------------------------------------------------

    @property
    def last_checkpoint(self) -> str | None:
        """The directory of the newest checkpoint this run saved or resumed from."""
        return self._last_checkpoint

    @property
    def last_saved_step(self) -> int | None:
        """The step of the newest checkpoint this run saved or resumed from."""
        return self._last_saved_step

    def save_checkpoint(self) -> str:
        """Checkpoint the actor, the critic and the trainer state at the current step (collective)."""

        def write(tmp: str) -> None:  # each role on its ranks; roles apart write at the same time
            if self.actor is not None:
                self.actor.role.save(os.path.join(tmp, ACTOR_SUBDIR))
            if self.critic is not None:
                self.critic.role.save(os.path.join(tmp, CRITIC_SUBDIR))
            if self.stream is not None:  # the batches generated ahead (trainer.rollout_mode)
                self.stream.save_state(tmp)

        with self._engine_held():  # the queue and the data position as one picture
            state = {"dataloader": self.data.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict(), "total_steps": self.total_steps}
            self.post_phase("save_checkpoint")
            path = self.checkpoints.save(self.global_step, write, state)
        self._last_saved_step, self._last_checkpoint = self.global_step, path
        return path

    def resume(self) -> int:
        """Load the checkpoint ``trainer.resume_mode`` selects (if any); returns the step to continue
        from. Runs once (the loop calls it before its first step)."""
        if self._resumed:
            return self.global_step
        self._resumed = True
        t = self.cfg.trainer
        found = self.checkpoints.resolve_resume(t.resume_mode, t.resume_from_path)
        if found is not None:
            state = self.checkpoints.read_trainer_state(found.path)
            if self.actor is not None:
                self.actor.role.load(os.path.join(found.path, ACTOR_SUBDIR))
            if self.use_critic:
                critic_dir = os.path.join(found.path, CRITIC_SUBDIR)
                if not os.path.isdir(critic_dir):
                    raise ValueError(
                        f"{found.path} has no {CRITIC_SUBDIR}/ checkpoint but this run trains a critic; "
                        "resume from a checkpoint of a run with a critic, or start without resuming "
                        "(trainer.resume_mode=disable)"
                    )
                if self.critic is not None:
                    self.critic.role.load(critic_dir)
            self._load_stream(found.path)
            self.data.load_state_dict(state["dataloader"])
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])
            self.global_step = int(state["global_step"])
            self._last_saved_step, self._last_checkpoint = self.global_step, found.path
            log_rank0(logger, logging.INFO, "resumed from %s (step %d)", found.path, self.global_step)
        self.tracking.rewind(self.global_step)
        if self.is_rank0:
            self.scores_file.rewind(self.global_step)
            self.samples_file.rewind(self.global_step)
        return self.global_step

    def _load_stream(self, path: str) -> None:
        """The streaming rollout's queue from checkpoint ``path`` (refused into a synchronous run:
        its data loader position counts the batches generated ahead)."""
        from verl.trainer.step.stream import QUEUE_DIR

        if self.stream is not None:
            self.stream.load_state(path)
        elif os.path.exists(os.path.join(path, QUEUE_DIR, "index.json")):
            with open(os.path.join(path, QUEUE_DIR, "index.json"), encoding="utf-8") as f:
                ahead = len(json.load(f)["batches"])
            if ahead:
                raise ValueError(
                    f"{path} holds {ahead} batches generated ahead by a streaming rollout; resume it with the "
                    "trainer.rollout_mode (and trainer.async_training.max_staleness) it was saved with"
                )

    # -- the loop -------------------------------------------------------------------------

    def fit(
        self, *, stop_after: int | None = None, step_fn: Callable[[], dict[str, float] | None] | None = None
    ) -> dict[str, float]:
        """Train to ``total_steps`` (resuming first) in the one loop (``verl.trainer.loop.Loop``);
        returns the last step's and the latest validation's metrics.

        ``step_fn`` replaces :meth:`train_step` as one step of the loop (``verl.DataStream.fit``
        passes its operators); it returns the step's metrics or None when the data is used up.
        ``stop_after`` ends the loop after that global step without the end-of-run actions
        (validation, save, export), as if the run were interrupted there. A stop signal ends it
        after the current step with a checkpoint (:attr:`stopped_by` names the signal). A
        collective that fails because another rank died or hung raises ``RankFailure`` naming it.
        """
        loop = Loop(self, step_fn or self.train_step)
        try:
            while loop.step() is not None:
                if stop_after is not None and self.global_step >= stop_after and not loop.finished:
                    break
            return loop.result
        finally:
            loop.close()

    def export_actor_hf(self, out_dir: str) -> None:
        """Write the actor's weights as a Hugging Face checkpoint in ``out_dir`` (collective: the
        actor's ranks write it, every rank returns once it is complete)."""
        if self.actor is not None:
            with self.actor.role.active():
                self.actor.engine.export_hf(out_dir)
        if "actor" in self.world.apart:
            dist.barrier()

    def close(self) -> None:
        """Free the rollout engine, the reward workers, the loggers and Megatron's state."""
        if self.closed:
            return
        self.closed = True
        try:
            if getattr(self, "pipeline", None) is not None:  # (an __init__ that failed early has none)
                self.pipeline.schedule(self.world).close()
        finally:
            self.tracking.close()
            self.world.close()
            self.exact.close()
            release_run_outputs(self.cfg.trainer)  # the next run into these folders may start

    def __enter__(self) -> "PPOTrainer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _describe_step(cfg: PPOConfig, pipeline: Any) -> str:
    """The startup line's algorithm and step: ``grpo; step RolloutOperator -> RewardOperator -> PPOUpdateOperator``."""
    what = {
        "dpo": f"dpo (preference pairs, data.pairs; beta={cfg.algorithm.dpo.beta})",
        "hybrid": f"hybrid {cfg.algorithm.adv_estimator}/dpo (reward >= {cfg.algorithm.hybrid.reward_threshold}: PPO update)",
        "dynamic_sampling": f"{cfg.algorithm.adv_estimator} with dynamic sampling (algorithm.filter_groups)",
        "rl": cfg.algorithm.adv_estimator,
    }[step_kind(cfg)]
    return f"{what}; step {pipeline.describe()}"
