"""The step as data: an ordered pipeline of operators, built from the config by one function.

Every algorithm's step is a :class:`StepPipeline`; :func:`build_step` makes the config's:

| config | operators |
| --- | --- |
| PPO/GAE, GRPO, RLOO, REINFORCE++, ReMax, ... (``algorithm.adv_estimator``) | ``RolloutOperator`` -> ``RewardOperator`` -> ``PPOUpdateOperator`` |
| DAPO's dynamic sampling (``algorithm.filter_groups.enable``) | ``DynamicSamplingOperator`` (draws rollout + reward until the batch is full) -> ``PPOUpdateOperator`` |
| DPO on preference pairs (``data.pairs``) | ``PreferenceOperator`` -> ``DPOUpdateOperator`` (``algorithm.dpo.*``) |
| the hybrid PPO/DPO step (``algorithm.hybrid.enable``) | ``RolloutOperator`` -> ``RewardOperator`` -> ``ConditionalUpdateOperator`` |
| on-policy distillation (``distillation.enabled``, with the RL or dynamic-sampling step) | ... -> ``DistillationOperator`` -> ``PPOUpdateOperator`` |
| ``trainer.rollout_mode=one_step_off|async`` (the first row's algorithms) | ``StreamRolloutOperator`` (``verl.trainer.step.stream``) -> ``RewardOperator`` -> ``PPOUpdateOperator`` |

The trainer's loop runs the pipeline (``PPOTrainer.fit``); ``verl.DataStream`` is the same
class with the user's operators in it, so ``main_ppo``, the Python API and the benchmarks all
run one kind of step. ReMax's greedy baseline is part of the rollout (``StepPieces.generate``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from verl.trainer.perf import prepare_step_perf, step_perf_metrics
from verl.trainer.step.base import Operator, declared, operator_name

if TYPE_CHECKING:
    from verl.config import PPOConfig
    from verl.protocol import Batch
    from verl.trainer.step.pieces import StepPieces

__all__ = ["StepPipeline", "build_step", "step_kind"]

logger = logging.getLogger(__name__)


class StepPipeline:
    """Operators run in order on one batch per step.

    Args:
        operators: the step's operators (each: ``inputs``/``outputs`` field tuples and
            ``process(batch)``; see :mod:`verl.trainer.step.base`); more with :meth:`add`.
        time_operators: add ``timing_s/op/<name>`` per operator to the step's metrics (the
            Python API's streams do; the config's own step reports its phases instead).
    """

    def __init__(self, operators: Iterable[Any] = (), *, time_operators: bool = False) -> None:
        self.operators: list[Any] = []
        self.names: list[str] = []
        self.fields: set[str] = set()
        self.time_operators = time_operators
        self.last_batch: "Batch | None" = None
        self.empty_steps = 0
        """Steps skipped because an operator left no sample in the batch (``training/empty_steps``)."""
        self._sync: Any = None  # the synchronous schedule, made on first use
        for op in operators:
            self.add(op)

    def add(self, op: Any) -> str:
        """Append ``op`` and return its name (:meth:`check` first)."""
        name = self.check(op)
        self.operators.append(op)
        self.names.append(name)
        self.fields.update(declared(op)[1])
        return name

    def check(self, op: Any) -> str:
        """The name ``op`` would get; ValueError when an input of it is produced by no earlier
        operator, TypeError when it is not an operator."""
        if not callable(getattr(op, "process", None)):
            raise TypeError(
                f"{type(op).__name__} is not an operator: it needs a process(batch) method "
                "and inputs/outputs tuples (verl.operator.Operator)"
            )
        inputs, _ = declared(op)
        name = operator_name(op, self.names)
        missing = [f for f in inputs if f not in self.fields]
        if missing:
            earlier = ", ".join(self.names) or "none"
            raise ValueError(
                f"operator {name} needs field {missing[0]!r}"
                + (f" (and {missing[1:]})" if len(missing) > 1 else "")
                + f", which no earlier operator produces (earlier operators: {earlier}; fields they "
                f"produce: {sorted(self.fields) or 'none'}); add the operator that produces it first"
            )
        return name

    def describe(self) -> str:
        """The operators' classes in order: ``RolloutOperator -> RewardOperator -> PPOUpdateOperator``."""
        return " -> ".join(type(op).__name__ for op in self.operators)

    def bind(self, trainer: "StepPieces") -> None:
        """Give every built-in operator the trainer whose roles it calls."""
        for op in self.operators:
            if isinstance(op, Operator):
                op.bind(trainer)

    def schedule(self, world: Any) -> Any:
        """The step's schedule (``verl.trainer.step.schedule``): the one an operator brings (the
        streaming rollout's, once bound), else the synchronous one."""
        for op in self.operators:
            if isinstance(op, Operator) and op.schedule is not None:
                return op.schedule
        if self._sync is None or self._sync.world is not world:
            from verl.trainer.step.schedule import SyncSchedule

            self._sync = SyncSchedule(world)
        return self._sync

    def run(self, trainer: "StepPieces") -> dict[str, float] | None:
        """One step: every operator in order on the step's batch; the step's metrics (the
        operators' and the trainer's phase timings, ``timing_s/step``, the phases' model FLOPs
        utilisation ``perf/mfu/<phase>``: ``verl.trainer.perf``), or None when the first
        operator found no more data. The trainer's ``global_step`` advances here, and only here,
        once the first operator has drawn the step's batch.

        An operator that leaves no sample in the batch (a filter that keeps none) ends the step
        there: the operators after it (the update) do not run, a warning names the step, and the
        step counts in ``training/empty_steps``; the run goes on with the next step."""
        if not self.operators:
            raise ValueError("the step has no operators: add_operator(RolloutOperator()) first")
        prepare_step_perf(trainer)  # the device's peak measured before the step and its threads start
        ctx = trainer.begin_step(self.schedule(trainer.world))
        try:
            metrics: dict[str, float] = {}
            batch: "Batch | None" = None
            for name, op in zip(self.names, self.operators):
                t0 = time.perf_counter()
                out = op.process(batch)
                if isinstance(out, tuple):
                    out, more = out
                    metrics.update(more)
                if self.time_operators:
                    metrics[f"timing_s/op/{name}"] = time.perf_counter() - t0
                if out is None:
                    if batch is None:  # the first operator found no more data
                        return None
                    raise ValueError(f"operator {name} returned None; process(batch) must return the batch")
                if batch is None:  # the step's batch is drawn: the step has begun
                    trainer.global_step = ctx.step
                before, batch = batch, out
                if len(batch) == 0:
                    self.empty_steps += 1
                    logger.warning(
                        "step %d: operator %s left no sample of %s in the batch; the step is skipped (no update) and "
                        "counted in training/empty_steps (%d so far)",
                        ctx.step, name, "the drawn batch" if before is None else len(before), self.empty_steps,
                    )
                    metrics["training/global_step"] = float(ctx.step)
                    break
            if self.empty_steps:
                metrics["training/empty_steps"] = float(self.empty_steps)
            ctx.timer.seconds["step"] = ctx.seconds()
            metrics.update(ctx.timer.metrics())
            # perf/tflops/<phase>, perf/mfu/<phase>: the phases' model FLOPs over their seconds (verl.trainer.perf)
            metrics.update(step_perf_metrics(trainer, batch, ctx.timer.seconds))
            self.last_batch = batch
            return metrics
        finally:
            trainer.end_step()


def step_kind(cfg: "PPOConfig") -> str:
    """Which step the config trains: ``dpo``, ``hybrid``, ``dynamic_sampling`` or ``rl``."""
    if cfg.data.pairs:
        return "dpo"
    if cfg.algorithm.hybrid.enable:
        return "hybrid"
    if cfg.algorithm.filter_groups.enable:
        return "dynamic_sampling"
    return "rl"


def build_step(cfg: "PPOConfig", *, hybrid_condition: Any = None) -> StepPipeline:
    """The config's step (module docstring's table); bind it to the trainer before running it.
    ``hybrid_condition`` (``f(sample) -> bool``; ``verl.RLTrainer``'s): the hybrid PPO/DPO step,
    routing each sample by it instead of ``algorithm.hybrid.reward_threshold``."""
    from verl.trainer.step import ops

    kind = "hybrid" if hybrid_condition is not None else step_kind(cfg)
    if kind == "dpo":
        d = cfg.algorithm.dpo
        return StepPipeline(
            [ops.PreferenceOperator(), ops.DPOUpdateOperator(beta=d.beta, loss_type=d.loss_type, label_smoothing=d.label_smoothing)]
        )
    if kind == "hybrid":
        d, h = cfg.algorithm.dpo, cfg.algorithm.hybrid
        threshold = h.reward_threshold
        hybrid = ops.ConditionalUpdateOperator(
            condition=hybrid_condition or (lambda sample: sample["reward"] >= threshold),
            true_branch=ops.PPOUpdateOperator(),
            false_branch=ops.DPOUpdateOperator(beta=d.beta, loss_type=d.loss_type, label_smoothing=d.label_smoothing),
        )
        return StepPipeline([ops.RolloutOperator(), ops.RewardOperator(summary=False), hybrid])
    # on-policy distillation: the teacher scores the samples before the update (distillation.enabled)
    teacher = [ops.DistillationOperator()] if cfg.use_teacher else []
    if kind == "dynamic_sampling":
        fg = cfg.algorithm.filter_groups
        return StepPipeline(
            [ops.DynamicSamplingOperator(metric=fg.metric, max_num_gen_batches=fg.max_num_gen_batches), *teacher,
             ops.PPOUpdateOperator()]
        )
    if cfg.trainer.rollout_mode != "sync":  # generation ahead of training (verl.trainer.step.stream)
        from verl.trainer.exact import pinned_async
        from verl.trainer.step.stream import StreamRolloutOperator

        at = cfg.trainer.async_training
        fill_window, free_running = pinned_async(at.fill_update_window, at.free_running, deterministic=cfg.trainer.deterministic)
        head: Operator = StreamRolloutOperator(
            depth=cfg.staleness_bound,
            partial_tokens=at.partial_rollout_tokens if at.partial_rollout else None,
            stale_samples=at.stale_samples,
            fill_window=fill_window,
            free_running=free_running,
        )
        _warn_uncorrected(cfg)
    else:
        head = ops.RolloutOperator()
    return StepPipeline([head, ops.RewardOperator(summary=False), *teacher, ops.PPOUpdateOperator()])


def _warn_uncorrected(cfg: "PPOConfig") -> None:
    """A streaming mode that trains stale samples with no rollout correction: say what it costs."""
    rc = cfg.algorithm.rollout_correction
    corrected = (
        rc.bypass_mode or rc.rollout_is is not None or rc.rollout_rs is not None
        or cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "bypass_mode"
    )
    if cfg.staleness_bound > 0 and not corrected:
        logger.warning(
            "trainer.rollout_mode=%s trains samples up to %d policy versions stale with no rollout "
            "correction: measured on the main job's task, the reward then fell where the synchronous run's "
            "rose (docs/async.md); set algorithm.rollout_correction.rollout_is=token and "
            "rollout_is_threshold=2.0 (or another preset, docs/algorithms.md)",
            cfg.trainer.rollout_mode, cfg.staleness_bound,
        )
