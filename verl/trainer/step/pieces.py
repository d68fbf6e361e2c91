"""The step's pieces on the trainer's roles: rollout, reward, log-probs, values, advantages and
the updates, each a method that takes and returns a ``Batch`` (and metrics).

The operators of :mod:`verl.trainer.step.ops` bind to a :class:`StepPieces` and call these. The
trainer (``verl.trainer.ppo_trainer.PPOTrainer``) builds the run's parts it is made of (``cfg``,
``world``, ``data``, the roles ``rollout``/``actor``/``reference``/``critic``/``reward``,
``kl_ctrl``, ``skipped``, ``board``, the run report's files) and holds it as ``trainer.pieces``.

One step (shared/DESIGN.md), as ``verl.trainer.step.build_step`` composes it:

1. :meth:`StepPieces.generate` — the actor's weights pushed into the engine, ``n`` samples per
   prompt; ReMax adds a greedy baseline (DAPO's dynamic sampling redraws: ``DynamicSamplingOperator``);
2. the reward (``RewardOperator``: :meth:`compute_reward`) — rule-based and/or reward-model scores;
3. :meth:`update_step`: the actor's old log-probabilities (only with ``actor.old_log_prob``
   resolving to ``recompute``: when the batch is one optimizer step the update's own forward
   gives the same numbers, and with ``rollout`` the engine's are used), the reference's, the
   critic's values; the rollout correction (:meth:`apply_rollout_correction`: IS weights,
   rejection, ``rollout_corr/*``); the in-reward KL penalty and the advantages; the critic's and the actor's
   updates (after ``trainer.critic_warmup`` steps); the step's metrics;
4. or DPO's :meth:`update_preference` on preference pairs.

Departures from the reference verl: mini-batches are cut from the global batch before it is
split over data-parallel ranks (so DP=2 takes the same optimizer steps as DP=1); the actor
waits ``critic_warmup`` full steps (the reference starts it at step ``critic_warmup``).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
import torch.distributed as dist

from verl.algos import apply_kl_penalty, compute_advantage, masked_mean
from verl.algos.checks import group_ids
from verl.algos.distill import teacher_topk
from verl.protocol import Batch
from verl.roles.dispatch import share_batch, share_object
from verl.roles.reward_model import DATA_SOURCE_COLUMN
from verl.roles.teacher import TEACHER_TOPK_IDS, TEACHER_TOPK_LOG_PROB
from verl.rollout.base import merge_rollout_metrics
from verl.trainer.ppo_metrics import data_metrics, rollout_agreement_metrics, throughput_metrics
from verl.trainer.resilience import check_finite_rewards
from verl.trainer.step.context import PhaseTimer, StepContext

__all__ = ["PhaseTimer", "StepContext", "StepPieces"]

# Per-call sampling seeds: rollout.seed + step * _STEP_STRIDE + draw; validation is offset by VAL_SEED_OFFSET.
_STEP_STRIDE = 1000
VAL_SEED_OFFSET = 10**9
_REMAX_OFFSET = 500
# Call i > 0 of a step's generation split into calls (generate(call_sizes=...)) samples with
# seed + i * _CALL_STRIDE: its own stream, apart from the step's draws and ReMax's baseline.
_CALL_STRIDE = 100_003


def baseline_per_row(baseline: torch.Tensor, uids: Any) -> torch.Tensor:
    """ReMax's greedy baseline [B] (one per prompt, in prompt order) spread over the samples' rows:
    each row gets its prompt group's value (``uid``, groups in first-appearance order, as the rollout
    lays rows out prompt-major). A group may have more than ``n`` rows (a split agent-program
    episode gives a row per trajectory), so this is not ``repeat_interleave(n)``."""
    gid, num_groups, _ = group_ids(uids, len(uids))
    if num_groups != baseline.shape[0]:
        raise ValueError(f"ReMax: {baseline.shape[0]} greedy baselines for {num_groups} prompt groups in the samples")
    return baseline[gid.to(baseline.device)]


def _step_being_made(host: Any) -> int:
    """:meth:`StepPieces.step_in_progress` of ``host`` (a trainer, or a test's stand-in with only
    ``global_step``)."""
    ctx = getattr(host, "step_ctx", None)
    return ctx.step if ctx is not None else host.global_step + 1


class StepPieces:
    """The step's pieces on one run's state: what the operators of this folder bind to and call.

    The trainer (``verl.trainer.ppo_trainer.PPOTrainer``) builds the run's parts and holds one of
    these; the operators never see the trainer. ``global_step`` counts the steps begun
    (``StepPipeline.run`` advances it; the trainer sets it on resume) and ``last_checkpoint`` is the
    newest checkpoint (the trainer sets it when it saves or resumes)."""

    step_ctx: StepContext | None = None  # the step in progress (begin_step .. end_step)

    def __init__(
        self,
        *,
        cfg: Any,
        world: Any,
        data: Any,
        kl_ctrl: Any,
        skipped: Any,
        board: Any,
        scores_file: Any,
        reporting: bool,
        is_rank0: bool,
    ) -> None:
        self.cfg = cfg  # verl.config.PPOConfig
        self.world = world  # verl.trainer.world.RLWorld: the placement, this rank's roles, the exchanges
        self.data = data  # verl.trainer.rl_data.RLData: the tokenizer, loaders and each step's prompts
        self.tokenizer, self.total_steps = data.tokenizer, data.total_steps
        # this rank's roles (None where it holds none)
        self.rollout, self.actor, self.reference, self.critic, self.reward = (
            world.rollout, world.actor, world.reference, world.critic, world.reward,
        )
        self.world_size = world.world_size
        self.n = cfg.actor_rollout_ref.rollout.n  # samples per prompt
        self.use_critic, self.use_reference = cfg.use_critic, cfg.use_reference
        self.kl_ctrl = kl_ctrl  # verl.algos's KL controller
        self.skipped = skipped  # verl.trainer.resilience.SkippedSteps
        self.board = board  # verl.trainer.resilience.PhaseBoard
        self.scores_file = scores_file  # verl.trainer.report.StepRecords (the run report's per-sample scores)
        self.reporting, self.is_rank0 = reporting, is_rank0
        self.global_step = 0
        self.last_checkpoint: str | None = None

    def runs(self, role: str) -> bool:
        """Whether this rank holds ``role`` (``actor``, ``ref``, ``critic``, ``reward_model``)."""
        return self.world.runs(role)

    def prompt_batch(self, draw: int = 0) -> Batch | None:
        """The step's next prompts (``uid`` ``step/draw/i``); None when the epochs are used up."""
        return self.data.prompt_batch(self.step_in_progress() - 1, draw)

    def preference_batch(self) -> Batch | None:
        """The step's next preference pairs (``verl.trainer.rl_data.RLData.preference_batch``)."""
        return self.data.preference_batch(self.step_in_progress() - 1)

    def _exchange_phase(self, timer: PhaseTimer) -> contextlib.AbstractContextManager:
        """The ``exchange`` phase's timer when some role is apart; nothing to time otherwise (no
        collective: :meth:`_exchange` only merges the metrics)."""
        return timer("exchange") if self.world.apart else contextlib.nullcontext()

    def update_preference(
        self,
        batch: Batch,
        *,
        beta: float,
        loss_type: str = "sigmoid",
        label_smoothing: float = 0.0,
    ) -> dict[str, float]:
        """DPO's step on :meth:`preference_batch`'s pairs: the reference's log-probs, then
        ``Actor.update_preference``; returns the step's metrics."""
        if not self.use_reference:
            raise ValueError(
                "DPO needs the frozen reference policy, which this trainer does not build: train on "
                "data.pairs=true, or turn on actor_rollout_ref.actor.use_kl_loss (e.g. PPOUpdateOperator(kl_coef=0.001))"
            )
        timer = PhaseTimer(self.post_phase)
        start = time.perf_counter()
        with timer("ref"):
            if self.runs("ref"):
                batch["ref_log_prob"] = self.reference.compute_log_prob(batch, temperature=1.0)
        if "ref" in self.world.apart:
            with timer("exchange"):
                batch, _ = self.world.exchange(batch, [("ref", ["ref_log_prob"], {})])
        with timer("update_actor"):
            metrics = {}
            if self.runs("actor"):
                metrics = self.actor.update_preference(
                    batch, beta=beta, loss_type=loss_type, label_smoothing=label_smoothing
                )
        if "actor" in self.world.apart:
            with timer("exchange"):
                _, metrics = self.world.exchange(None, [("actor", [], metrics)])
        metrics.update(
            self.skipped.record(
                self.step_in_progress(), metrics.get("actor/num_skipped_updates", 0) > 0,
                last_checkpoint=self.last_checkpoint,
            )
        )
        timer.seconds["step"] = time.perf_counter() - start
        metrics.update(timer.metrics())
        metrics["training/global_step"] = float(self.step_in_progress())
        metrics["training/epoch"] = float(self.data.epoch)
        return metrics

    def step_in_progress(self) -> int:
        """The step being made (1-based): the step context's inside a step, the next one between steps."""
        return _step_being_made(self)

    def _seed(self, draw: int, step: int | None = None) -> int:
        done = (self.step_in_progress() if step is None else step) - 1  # steps finished before the one sampled for
        return self.cfg.actor_rollout_ref.rollout.seed + done * _STEP_STRIDE + draw

    def sampling_seed(self, draw: int = 0, step: int | None = None) -> int:
        """The rollout seed of the ``draw``-th generation batch of this step, or of step ``step``
        (1-based: a batch generated ahead, ``verl.trainer.step.stream``, samples what the
        synchronous step would)."""
        return self._seed(draw, step)

    # -- the step's pieces ----------------------------------------------------------------

    def generate(
        self, prompts: Batch, *, seed: int, call_sizes: tuple[int, int] | None = None
    ) -> tuple[Batch, dict[str, float]]:
        """Rollout (weights pushed first): ``n`` samples per prompt; ReMax adds ``reward_baselines`` [B*n].

        ``call_sizes=(min, max)`` splits the generation into engine calls of whole prompts, each of
        ``min .. max`` sequences (prompt x sample rows), as many as the memory the engine reports
        holds (:meth:`_call_size`); call ``i > 0`` samples with ``seed + i * _CALL_STRIDE``, so with
        one call the samples are those of an unsplit call, and greedy samples never change. Adds
        ``rollout/batch_size`` (sequences per call), ``rollout/num_calls`` and ``rollout/kv_token_budget``.
        """
        with self.world.rollout_phase() as push:
            generated = self.generate_here(prompts, seed=seed, call_sizes=call_sizes)
            generated[2].update(push)
        return self.share_generated(generated)

    def generate_here(
        self, prompts: Batch, *, seed: int, call_sizes: tuple[int, int] | None = None
    ) -> tuple[Batch | None, Batch | None, dict[str, float]]:
        """:meth:`generate`'s engine calls on this rank, inside a rollout phase: (samples, ReMax's
        greedy samples or None, metrics) on the rollout's ranks, (None, None, {}) elsewhere."""
        if self.rollout is None:
            return None, None, {}
        greedy = None
        if call_sizes is None:
            batch = self.rollout.generate(prompts, seed=seed)
            metrics = dict(self.rollout.last_metrics)
        else:
            batch, metrics = self._generate_in_calls(prompts, seed=seed, call_sizes=call_sizes)
        if self.cfg.algorithm.adv_estimator == "remax":
            greedy = self.rollout.generate(prompts, seed=seed + _REMAX_OFFSET, greedy=True)
        return batch, greedy, metrics

    def share_generated(
        self, generated: tuple[Batch | None, Batch | None, dict[str, float]]
    ) -> tuple[Batch, dict[str, float]]:
        """:meth:`generate_here`'s result on every rank (collective when the rollout is apart), with
        ReMax's ``reward_baselines`` and a float ``response_mask``."""
        batch, greedy, metrics = generated
        remax = self.cfg.algorithm.adv_estimator == "remax"
        if "rollout" in self.world.apart:  # the samples reach every rank
            src = self.world.source["rollout"]
            batch = share_batch(batch, src)
            metrics = share_object(metrics, src)
            if remax:
                greedy = share_batch(greedy, src)
        if remax:
            baseline = self.reward.score(greedy).scores  # [B]
            batch["reward_baselines"] = baseline_per_row(baseline, batch.non_tensors["uid"])
        batch["response_mask"] = batch["response_mask"].to(torch.float32)
        return batch, metrics

    def _call_size(self, prompts: Batch, call_sizes: tuple[int, int]) -> tuple[int, int]:
        """(prompts per engine call, at most all of them; the KV token budget it came from). The engine's budget (the least
        over the world's ranks, so that every rank makes the same calls) over the tokens of one
        sequence (prompt width + the engine's ``response_length``) is the sequences a rank can hold; times
        the rollout's data-parallel size, clamped to ``call_sizes``, whole prompts (``n`` sequences each)."""
        low, high = call_sizes
        if high < self.n:
            raise ValueError(
                f"RolloutOperator(max_batch_size={high}) is below actor_rollout_ref.rollout.n={self.n}: an engine "
                f"call holds every sample of its prompts; raise max_batch_size to at least {self.n}"
            )
        budget = self.rollout.engine.kv_token_budget()
        if budget is None:
            from verl.rollout.module_engine import ModuleRollout

            if isinstance(self.rollout.engine, ModuleRollout):
                raise ValueError(
                    "dynamic_batch_size: a plain nn.Module generates with its own generate(), whose memory verl "
                    "cannot see (no kv_token_budget); use dynamic_batch_size=False"
                )
            raise ValueError(
                f"dynamic_batch_size: the {self.cfg.actor_rollout_ref.rollout.name!r} rollout engine reports no "
                "memory to size its calls by (kv_token_budget); use the 'hf' or 'vllm' engine, or "
                "dynamic_batch_size=False"
            )
        if dist.get_world_size() > 1:
            from verl.protocol.collectives import comm_device

            least = torch.tensor([budget], dtype=torch.int64, device=comm_device(None))
            dist.all_reduce(least, op=dist.ReduceOp.MIN)
            budget = int(least.item())
        tokens = prompts["input_ids"].shape[1] + self.rollout.engine.cfg.response_length
        dp = dist.get_world_size(self.rollout.dp_group) if self.rollout.dp_group is not None else 1
        sequences = min(max(budget // tokens * dp, low), high)
        return min(max(sequences // self.n, 1), len(prompts)), budget

    def _generate_in_calls(
        self, prompts: Batch, *, seed: int, call_sizes: tuple[int, int]
    ) -> tuple[Batch, dict[str, float]]:
        per_call, budget = self._call_size(prompts, call_sizes)
        pieces, calls, seconds = [], [], 0.0
        for i, start in enumerate(range(0, len(prompts), per_call)):
            pieces.append(self.rollout.generate(prompts[start : start + per_call], seed=seed + i * _CALL_STRIDE))
            calls.append(self.rollout.last_metrics)
            seconds += self.rollout.last_metrics["timing_s/gen"]
        metrics = merge_rollout_metrics(calls)
        metrics.update({
            "timing_s/gen": seconds,
            "rollout/batch_size": float(per_call * self.n),
            "rollout/num_calls": float(len(pieces)),
            "rollout/kv_token_budget": float(budget),
        })
        return Batch.concat(pieces), metrics

    def compute_reward(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """``token_level_scores`` [B, R] and the scorers' per-sample extras (``acc`` ...) as columns."""
        result = self.reward.score(batch)
        batch, more = self.place_scores(batch, result.token_level_scores)
        for key, values in result.extra.items():
            if key not in batch:
                batch[key] = values
        return batch, {**result.metrics, **more}

    def place_scores(self, batch: Batch, scores: torch.Tensor) -> tuple[Batch, dict[str, float]]:
        """``scores`` [B, R] plus an agent rollout's interaction rewards into ``token_level_scores``
        (every reward step's last act); returns the batch and the folding's metrics. A non-finite
        score on a response token (a reward model's, an interaction's, a user operator's) is refused
        here, on every rank alike, since each holds the same scores: with the rollout on ranks of its
        own it was refused on those ranks only after the update they generate through."""
        from verl.rollout.agent.interaction import fold_turn_scores

        scores, more = fold_turn_scores(batch, scores)
        check_finite_rewards(
            _step_being_made(self),
            {"token_level_scores": scores},
            batch["response_mask"],
            batch.non_tensors.get(DATA_SOURCE_COLUMN, ["?"] * len(batch)),
        )
        batch["token_level_scores"] = scores
        return batch, more

    def compute_old_log_prob(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """``old_log_probs`` [B, R] from the actor, ``actor/entropy`` and the rollout agreement metrics."""
        log_probs, entropy = self.actor.compute_log_prob(batch)
        batch["old_log_probs"] = log_probs
        mask = batch["response_mask"]
        metrics = {"actor/entropy": float(masked_mean(entropy, mask))}
        if "rollout_log_probs" in batch:
            metrics.update(rollout_agreement_metrics(batch["rollout_log_probs"], log_probs, mask))
        metrics.update(getattr(self.actor, "log_prob_metrics", {}))  # R3 router replay's agreement
        return batch, metrics

    def apply_rollout_correction(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """Decoupled rollout correction (``algorithm.rollout_correction``, ``verl.algos.rollout_correction``):
        ``rollout_is_weights`` [B, R] into the batch when ``rollout_is`` is set, rejected tokens out of
        ``response_mask`` when ``rollout_rs`` is, and the ``rollout_corr/*`` metrics whenever the batch
        has both the old and the engine's log-probs (every rank computes the same numbers)."""
        rc = self.cfg.algorithm.rollout_correction
        if "rollout_log_probs" not in batch or "old_log_probs" not in batch:
            if rc.active:
                raise ValueError(
                    "algorithm.rollout_correction.rollout_is/rollout_rs need the rollout engine's log-probs "
                    "(rollout_log_probs), which this engine did not return; turn rollout correction off"
                )
            return batch, {}
        from verl.algos.rollout_correction import compute_rollout_correction

        weights, mask, metrics = compute_rollout_correction(
            batch["old_log_probs"].float(),
            batch["rollout_log_probs"].float(),
            batch["response_mask"],
            rollout_is=rc.rollout_is if rc.active else None,
            rollout_is_threshold=rc.rollout_is_threshold,
            rollout_is_batch_normalize=rc.rollout_is_batch_normalize,
            rollout_rs=rc.rollout_rs if rc.active else None,
            rollout_rs_threshold=rc.rollout_rs_threshold,
        )
        if weights is not None:
            batch["rollout_is_weights"] = weights.float()
        batch["response_mask"] = mask
        return batch, metrics

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """``ref_log_prob`` [B, R] from the frozen reference."""
        batch["ref_log_prob"] = self.reference.compute_log_prob(batch)
        return batch

    def teacher_fields(self) -> list[str]:
        """The batch fields on-policy distillation's teacher adds: ``teacher_log_prob``, and with a top-k
        loss (``distillation.distillation_loss.loss_mode=forward_kl_topk``) its top-k ids and log-probs."""
        loss = self.cfg.distillation.distillation_loss
        topk = teacher_topk(loss.loss_mode, loss.topk) is not None
        return ["teacher_log_prob", *([TEACHER_TOPK_IDS, TEACHER_TOPK_LOG_PROB] if topk else [])]

    def compute_teacher_log_prob(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """``teacher_log_prob`` [B, R] from on-policy distillation's teacher, with a top-k loss also
        ``teacher_topk_ids``/``teacher_topk_log_prob`` [B, R, k] (its ranks compute them, every rank
        gets them), and ``distillation/teacher_log_prob_mean`` over the response tokens."""
        fields = self.teacher_fields()
        with self.phase("teacher"):
            if self.runs("teacher"):
                found = self.world.teacher.compute(batch)
                for key in fields:
                    batch[key] = found[key]
        if "teacher" in self.world.apart:
            with self.phase("exchange"):
                batch, _ = self.world.exchange(batch, [("teacher", fields, {})])
        mean = float(masked_mean(batch["teacher_log_prob"], batch["response_mask"]))
        return batch, {"distillation/teacher_log_prob_mean": mean}

    def compute_values(self, batch: Batch) -> Batch:
        """``values`` [B, R] from the critic."""
        batch["values"] = self.critic.compute_values(batch)
        return batch

    def compute_advantage(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """``token_level_rewards`` (minus the in-reward KL penalty), then ``advantages`` and
        ``returns`` [B, R]."""
        a = self.cfg.algorithm
        mask = batch["response_mask"]
        metrics: dict[str, float] = {}
        if a.use_kl_in_reward:
            rewards, kl = apply_kl_penalty(
                token_level_scores=batch["token_level_scores"],
                old_log_prob=batch["old_log_probs"],
                ref_log_prob=batch["ref_log_prob"],
                response_mask=mask,
                kl_ctrl=self.kl_ctrl,
                kl_penalty=a.kl_penalty,
            )
            metrics = {
                "actor/reward_kl_penalty": kl["reward_kl_penalty"],
                "actor/reward_kl_penalty_coeff": kl["reward_kl_penalty_coeff"],
            }
        else:
            rewards = batch["token_level_scores"]
        batch["token_level_rewards"] = rewards
        inputs: dict[str, Any] = dict(
            token_level_rewards=rewards,
            response_mask=mask,
            index=batch.non_tensors["uid"],
            gamma=a.gamma,
            lam=a.lam,
            norm_adv_by_std_in_grpo=a.norm_adv_by_std_in_grpo,
        )
        if "values" in batch:
            inputs["values"] = batch["values"]
        if "reward_baselines" in batch:
            inputs["reward_baselines"] = batch["reward_baselines"]
        if "rollout_is_weights" in batch:  # the estimators that take them (optimal token baselines)
            inputs["rollout_is_weights"] = batch["rollout_is_weights"]
        advantages, returns = compute_advantage(a.adv_estimator, **inputs)
        batch["advantages"], batch["returns"] = advantages.float(), returns.float()
        return batch, metrics

    def staleness_metrics(self, batch: Batch) -> dict[str, float]:
        """``staleness/{mean,max,min}`` of the batch's samples: the policy versions between the one
        that sampled each (``rollout_version``: the actor updates done before its generation) and
        the one this update starts from; a sample beyond the mode's bound (``trainer.rollout_mode``,
        ``trainer.async_training.max_staleness``) is an internal error, raised before the update."""
        step = self.step_in_progress()
        staleness = (step - 1) - batch["rollout_version"].long()  # [B]
        bound = self.cfg.staleness_bound
        if int(staleness.max()) > bound or int(staleness.min()) < 0:
            worst = int(staleness.argmax()) if int(staleness.max()) > bound else int(staleness.argmin())
            raise RuntimeError(
                f"step {step}: sample {batch.non_tensors['uid'][worst]} was generated by policy version "
                f"{int(batch['rollout_version'][worst])} and would train from version {step - 1} "
                f"(staleness {int(staleness[worst])}; trainer.rollout_mode={self.cfg.trainer.rollout_mode} allows 0.."
                f"{bound}): the streaming rollout broke its bound"
            )
        s = staleness.double()
        return {"staleness/mean": float(s.mean()), "staleness/max": float(s.max()), "staleness/min": float(s.min())}

    def update_critic(self, batch: Batch) -> dict[str, float]:
        """One critic update on the step's batch; ``critic/*`` metrics."""
        return self.critic.update(batch, shuffle_seed=self._shuffle_seed(1), rollout_n=self.n)

    def update_actor(self, batch: Batch) -> dict[str, float]:
        """One actor update on the step's batch; ``actor/*`` metrics."""
        return self.actor.update(batch, shuffle_seed=self._shuffle_seed(0), rollout_n=self.n)

    def _shuffle_seed(self, role: int) -> int:
        return (self.cfg.trainer.seed * 1_000_003 + self.step_in_progress()) * 2 + role

    # -- a whole step ---------------------------------------------------------------------

    def filter_metric(self, batch: Batch, name: str) -> Any:
        """The per-sample values [B] that DAPO's group filter compares (``algorithm.filter_groups.metric``)."""
        if name == "seq_reward":
            return batch["token_level_scores"].sum(-1)
        if name == "seq_final_reward":
            return (
                batch["token_level_rewards"].sum(-1)
                if "token_level_rewards" in batch
                else batch["token_level_scores"].sum(-1)
            )
        if name == "score":
            return batch["token_level_scores"].sum(-1)
        if name in batch:
            return batch[name]
        raise ValueError(
            f"algorithm.filter_groups.metric={name!r} is neither seq_reward, seq_final_reward, score "
            f"nor a field the reward function returns (the batch has {sorted(batch.non_tensors)})"
        )

    def post_phase(self, phase: str) -> None:
        """Post the phase this rank enters (``verl.trainer.resilience.PhaseBoard``): a failed
        collective's report names the phase each rank was in."""
        self.board.post(phase, self.global_step)

    def begin_step(self, schedule: Any) -> StepContext:
        """Begin the step after :attr:`global_step` (the pipeline calls it first) under ``schedule``
        (``verl.trainer.step.schedule``); returns its context."""
        self.step_ctx = StepContext(step=self.global_step + 1, timer=PhaseTimer(self.post_phase), schedule=schedule)
        return self.step_ctx

    def end_step(self) -> None:
        """The step's context is over (the pipeline calls it last, also when an operator raised)."""
        self.step_ctx = None

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        """``with trainer.phase("gen"):`` adds the block's seconds to the step's ``timing_s/gen``
        (and posts the phase for failure reports); outside a step it only posts the phase."""
        if self.step_ctx is None:
            self.post_phase(name)
            return contextlib.nullcontext()
        return self.step_ctx.timer(name)

    def _advantages(self, batch: Batch, timer: PhaseTimer, metrics: dict[str, float]) -> Batch:
        """:meth:`update_step`'s rollout correction and advantages (their metrics into ``metrics``)."""
        if self.cfg.old_log_prob_source == "recompute":
            with timer("rollout_corr"):
                batch, more = self.apply_rollout_correction(batch)
                metrics.update(more)
        with timer("adv"):
            batch, more = self.compute_advantage(batch)
            metrics.update(more)
            check_finite_rewards(
                self.step_in_progress(),
                {"token_level_rewards": batch["token_level_rewards"], "advantages": batch["advantages"]},
                batch["response_mask"],
                batch.non_tensors.get(DATA_SOURCE_COLUMN, ["?"] * len(batch)),
            )
        return batch

    def _passes(self, batch: Batch, timer: PhaseTimer) -> tuple[Batch, list[tuple[str, list[str], dict[str, float]]]]:
        """The old and reference log-probs and the values, each on its role's ranks; returns the
        batch and what each role hands to the other ranks (``RLWorld.exchange``'s shares)."""
        source = self.cfg.old_log_prob_source
        shares: list[tuple[str, list[str], dict[str, float]]] = []
        if source == "recompute":
            with timer("old_log_prob"):
                more = {}
                if self.runs("actor"):
                    batch, more = self.compute_old_log_prob(batch)
                shares.append(("actor", ["old_log_probs"], more))
        elif source == "rollout":
            if "rollout_log_probs" not in batch:
                raise ValueError(
                    "actor_rollout_ref.actor.old_log_prob=rollout, but the batch has no rollout_log_probs "
                    "(the rollout engine did not return them); use old_log_prob=recompute"
                )
            batch["old_log_probs"] = batch["rollout_log_probs"].float()
        # source == "current": the actor's update takes them from its own forward
        if self.use_reference and self.world.ref_ahead:  # the rollout's ranks computed them with the batch
            if "ref_log_prob" not in batch:
                raise ValueError(
                    "the reference is placed on the rollout's ranks (trainer.placement), so the streaming rollout "
                    "computes each batch's ref_log_prob as it generates it, but this batch has none: its first "
                    "operator must be the config's streaming rollout (StreamRolloutOperator), or place the "
                    "reference with the actor"
                )
        elif self.use_reference:
            with timer("ref"):
                if self.runs("ref"):
                    batch = self.compute_ref_log_prob(batch)
                shares.append(("ref", ["ref_log_prob"], {}))
        if self.use_critic:
            with timer("values"):
                if self.runs("critic"):
                    batch = self.compute_values(batch)
                shares.append(("critic", ["values"], {}))
        return batch, shares

    def _updates(self, batch: Batch, timer: PhaseTimer) -> list[tuple[str, list[str], dict[str, float]]]:
        """The critic's and (after ``trainer.critic_warmup`` steps) the actor's update on their ranks;
        their metrics as shares."""
        updates: list[tuple[str, list[str], dict[str, float]]] = []
        if self.use_critic:
            with timer("update_critic"):
                updates.append(("critic", [], self.update_critic(batch) if self.runs("critic") else {}))
        if self.step_in_progress() > self.cfg.trainer.critic_warmup:
            with timer("update_actor"):
                updates.append(("actor", [], self.update_actor(batch) if self.runs("actor") else {}))
        return updates

    def _records(self, batch: Batch, metrics: dict[str, float]) -> None:
        """The skip count and the run report's per-sample scores."""
        step = self.step_in_progress()
        skipped = any(metrics.get(f"{role}/num_skipped_updates", 0) > 0 for role in ("actor", "critic"))
        metrics.update(self.skipped.record(step, skipped, last_checkpoint=self.last_checkpoint))
        if self.reporting and self.is_rank0:
            self.scores_file.append(step, [{"scores": [round(float(v), 6) for v in batch["token_level_scores"].sum(-1)]}])

    def update_step(self, batch: Batch, metrics: dict[str, float] | None = None) -> dict[str, float]:
        """The step after rollout and reward (``batch`` has ``token_level_scores``): old, reference
        log-probs and values, advantages, the critic and actor updates; returns ``metrics`` with the
        step's added. Runs inside a step (:meth:`begin_step`); what runs beside it is the step's
        schedule's (``verl.trainer.step.schedule``), at the points named below."""
        ctx = self.step_ctx
        if ctx is None:
            raise RuntimeError("update_step runs inside a step: run it from the step's pipeline (StepPipeline.run)")
        timer, schedule, metrics = ctx.timer, ctx.schedule, dict(metrics or {})
        missing = [key for key in self.teacher_fields() if key not in batch] if self.cfg.use_teacher else []
        if missing:
            raise ValueError(
                f"distillation.enabled=true, but the batch has no {' / '.join(missing)}: put a DistillationOperator "
                "before the PPOUpdateOperator (the config's own step has one)"
            )
        if "rollout_version" in batch:
            metrics.update(self.staleness_metrics(batch))
        metrics.update(schedule.before_passes(ctx, batch))
        batch, shares = self._passes(batch, timer)
        with self._exchange_phase(timer):
            batch, more, have_columns = schedule.share_passes(ctx, batch, shares)
        metrics.update(more)
        if have_columns:
            batch = self._advantages(batch, timer, metrics)
        metrics.update(schedule.before_updates(ctx, batch))
        updates = self._updates(batch, timer)
        schedule.after_updates(ctx)
        with self._exchange_phase(timer):
            batch, more = schedule.share_updates(ctx, batch, shares, updates)
        metrics.update(more)
        if not have_columns:  # the schedule handed the columns over with the updates' metrics
            batch = self._advantages(batch, timer, metrics)
        with timer("records"):
            self._records(batch, metrics)
        seconds = ctx.seconds()
        timer.seconds["step"] = seconds
        metrics.update(data_metrics(batch, use_critic=self.use_critic))
        metrics.update(throughput_metrics(batch, step_seconds=seconds, world_size=self.world_size))
        metrics.update(timer.metrics())
        metrics["training/global_step"] = float(ctx.step)
        metrics["training/epoch"] = float(self.data.epoch)
        return metrics
