"""``RLTrainer``: PPO, GRPO and their relatives on the roles of ``verl.roles``; ``fit()`` is the one loop.

Every rank of the torchrun world runs the same code (SPMD). By default the roles are colocated
on all ranks (``verl.parallel.Topology``): actor, rollout and reference time-share them (the
hybrid engine), the critic and the reward model too, each with its own TP/PP/CP (DP derived) and
its own process groups. ``trainer.placement`` (``verl.parallel.placement``) puts the reference,
critic, reward model or rollout engine (or the actor) on ranks of their own, each role apart in a
world of its own (``verl.parallel.role_world``); a rollout engine apart from the actor is sent the
actor's weights before each generation (``verl.hybrid.DisaggregatedSync``). A step's batch is held whole on every rank; each
role takes its data-parallel share and hands its results back whole (``verl.roles.dispatch``); a
role on part of the world computes on its ranks and hands its columns and metrics to every rank
(the ``exchange`` phase), after the passes that can run side by side on disjoint ranks (old
log-probs, reference log-probs and values; then the critic's and the actor's updates).

One step (shared/DESIGN.md), each piece a method that takes and returns a ``Batch``, so a
caller can compose its own step (``verl.DataStream`` operators call these methods, and
:meth:`fit` runs their step in place of :meth:`train_step`; ``verl.RLTrainer`` builds a config and
calls :meth:`fit`):

1. :meth:`generate` — the actor's weights pushed into the engine, ``n`` samples per prompt;
   ReMax adds a greedy baseline; with ``algorithm.filter_groups`` (DAPO dynamic sampling)
   :meth:`collect_batch` keeps drawing until ``train_batch_size`` groups have a spread in the
   filter metric, at most ``max_num_gen_batches`` draws;
2. :meth:`compute_reward` — rule-based and/or reward-model scores (``token_level_scores``);
3. :meth:`compute_old_log_prob` — the actor's log-probabilities (``old_log_probs``) and their
   agreement with the engine's (``training/rollout_probs_diff_*``, ``token_mult_prob_error``).
   This pass is made only with ``actor.old_log_prob`` resolving to ``recompute``: when the batch
   is one optimizer step (``auto``/``current``) the update's own forward gives the same numbers
   (detached, as TRL does with one iteration), and with ``rollout`` the engine's are used; the
   update then measures the agreement itself, before it changes the weights;
4. :meth:`compute_ref_log_prob` (``ref_log_prob``), :meth:`compute_values` (``values``);
5. :meth:`compute_advantage` — the in-reward KL penalty (fixed or adaptive controller), then
   the estimator ``algorithm.adv_estimator`` (``advantages``, ``returns``);
6. :meth:`update_critic`, then :meth:`update_actor` (after ``trainer.critic_warmup`` steps);
7. metrics, a checkpoint every ``save_freq`` steps, validation every ``test_freq``.

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
(``verl.roles.engine_role``). ``report.html`` is rewritten every ``trainer.report_freq`` steps.

Departures from the reference verl: mini-batches are cut from the global batch before it is
split over data-parallel ranks (so DP=2 takes the same optimizer steps as DP=1); the actor
waits ``critic_warmup`` full steps (the reference starts it at step ``critic_warmup``); learning-
rate schedule lengths count trainer steps as in the reference, converted to the engine's
optimizer updates (``ppo_epochs x train_batch_size / ppo_mini_batch_size`` per step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from verl.algos import apply_kl_penalty, compute_advantage, make_kl_controller, masked_mean
from verl.config import PPOConfig, to_dict
from verl.config.schema import ModelConfig, OptimConfig
from verl.data.preference_dataset import PAIR_SIDES, PreferencePairDataset
from verl.data.rl_dataset import build_dataloader, create_rl_dataset
from verl.data.tokenizer import load_tokenizer
from verl.engine import lr_schedule_steps
from verl.hybrid import DisaggregatedSync
from verl.parallel import megatron_state
from verl.parallel.placement import role_ranks
from verl.parallel.topology import RoleLayout, Topology
from verl.protocol import Batch
from verl.rollout.base import merge_rollout_metrics
from verl.rewards import reward_manager_from_config
from verl.roles import Actor, Critic, Reference, RewardModel, Rollout
from verl.roles.dispatch import share_batch, share_columns, share_object
from verl.roles.engine_role import token_budget
from verl.roles.reward_model import DATA_SOURCE_COLUMN
from verl.trainer.checkpoint import CheckpointManager
from verl.trainer import report
from verl.trainer.ppo_checks import check_dataset_scorers, check_ppo_inputs
from verl.trainer.ppo_metrics import (
    data_metrics,
    rollout_agreement_metrics,
    throughput_metrics,
    validation_metrics,
)
from verl.trainer.resilience import (
    PhaseBoard,
    SkippedSteps,
    check_finite_rewards,
)
from verl.trainer.run_checks import as_file_list, show_files
from verl.trainer.loop import Loop
from verl.trainer.startup import run_outputs
from verl.trainer.step import build_step, step_kind
from verl.trainer.tracking import Tracking
from verl.utils.logging import log_rank0

logger = logging.getLogger(__name__)

__all__ = ["RLTrainer"]

ACTOR_SUBDIR = "actor"
CRITIC_SUBDIR = "critic"
# Per-call sampling seeds: rollout.seed + step * _STEP_STRIDE + draw; validation is offset by _VAL_OFFSET.
_STEP_STRIDE = 1000
_VAL_OFFSET = 10**9
_REMAX_OFFSET = 500
# Call i > 0 of a step's generation split into calls (RLTrainer.generate(call_sizes=...)) samples
# with seed + i * _CALL_STRIDE: its own stream, apart from the step's draws and ReMax's baseline.
_CALL_STRIDE = 100_003


class _Timer:
    """``with timer("gen"):`` adds the block's seconds to ``timing_s/gen`` (and tells ``on_enter``
    the phase's name)."""

    def __init__(self, on_enter: Callable[[str], None] | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self.on_enter = on_enter

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self.on_enter is not None:
            self.on_enter(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{k}": v for k, v in self.seconds.items()}


def _to_batch(data: dict[str, Any]) -> Batch:
    tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
    return Batch.from_dict(tensors, {k: v for k, v in data.items() if k not in tensors})


def _schedule(optim: OptimConfig, trainer_steps: int, updates_per_step: int) -> tuple[OptimConfig, int]:
    """``optim`` with its schedule lengths (trainer steps) converted to optimizer updates, and the
    run's number of updates."""
    steps = optim.total_training_steps if optim.total_training_steps > 0 else trainer_steps
    scaled = {}
    if optim.lr_warmup_steps is not None:
        scaled["lr_warmup_steps"] = optim.lr_warmup_steps * updates_per_step
    if optim.lr_decay_steps is not None:
        scaled["lr_decay_steps"] = optim.lr_decay_steps * updates_per_step
    converted = dataclasses.replace(optim, **scaled) if scaled else optim
    total = steps * updates_per_step
    lr_schedule_steps(converted, total)  # a bad warm-up fails before the model is built
    return converted, total


class RLTrainer:
    """The PPO/GRPO trainer on an initialised torch.distributed world (see the module docstring).

    Call :meth:`fit`; :meth:`close` (or ``with RLTrainer(cfg) as trainer``) frees the engines and
    Megatron's state.
    """

    def __init__(self, cfg: PPOConfig) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "RLTrainer needs torch.distributed initialised (python -m verl.trainer.main_ppo does it)"
            )
        self.world_size = dist.get_world_size()
        cfg.validate(world_size=self.world_size)
        check_ppo_inputs(cfg)
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
        try:
            self._build()
        except BaseException:
            self.tracking.close(list_outputs=False)
            raise

    def _build(self) -> None:
        cfg = self.cfg
        arr = cfg.actor_rollout_ref
        self.n = arr.rollout.n
        self.use_critic = cfg.use_critic
        self.use_reference = cfg.use_reference
        model_path = os.path.expanduser(arr.model.path)
        self.tokenizer = load_tokenizer(
            os.path.expanduser(cfg.data.tokenizer or arr.model.tokenizer_path or arr.model.path),
            trust_remote_code=arr.model.trust_remote_code,
        )
        if cfg.data.pairs:  # DPO's preference pairs (check_ppo_inputs refused validation files)
            self.train_dataset = PreferencePairDataset(
                as_file_list(cfg.data.train_files),
                self.tokenizer,
                max_prompt_length=cfg.data.max_prompt_length,
                max_response_length=cfg.data.max_response_length,
                prompt_key=cfg.data.prompt_key,
                apply_chat_template=cfg.data.apply_chat_template,
            )
        else:
            self.train_dataset = create_rl_dataset(cfg.data, self.tokenizer, as_file_list(cfg.data.train_files))
        self.val_dataset = (
            create_rl_dataset(cfg.data, self.tokenizer, as_file_list(cfg.data.val_files))
            if cfg.data.val_files
            else None
        )
        if cfg.data.custom_cls.path:  # check_ppo_inputs left the data sources to the user's class
            check_dataset_scorers(cfg, {"train_files": self.train_dataset, "val_files": self.val_dataset})
        self.loader = build_dataloader(self.train_dataset, cfg.data, train=True)
        self.val_loader = (
            build_dataloader(self.val_dataset, cfg.data, train=False) if self.val_dataset else None
        )
        self.steps_per_epoch = len(self.loader)
        t = cfg.trainer
        self.total_steps = t.total_training_steps or t.total_epochs * self.steps_per_epoch
        max_len = cfg.data.max_prompt_length + cfg.data.max_response_length
        actor_updates = arr.actor.ppo_epochs * (cfg.data.train_batch_size // arr.actor.ppo_mini_batch_size)
        actor_optim, actor_total = _schedule(arr.actor.optim, self.total_steps, actor_updates)
        critic_cfg = None
        if self.use_critic:
            c = cfg.critic
            critic_optim, critic_total = _schedule(
                c.optim, self.total_steps, c.ppo_epochs * (cfg.data.train_batch_size // c.ppo_mini_batch_size)
            )
            critic_cfg = dataclasses.replace(c, optim=critic_optim)

        # Placement: each role on its ranks (every rank unless trainer.placement says otherwise),
        # with its own layout and groups; this rank builds the roles it owns.
        self.topology = self._topology()
        groups = self.topology.build_groups(timeout=datetime.timedelta(seconds=t.collective_timeout_s))
        self._mine = frozenset(groups)
        self._source = {role: min(layout.ranks) for role, layout in self.topology.roles.items()}
        self._apart = frozenset(
            role for role, layout in self.topology.roles.items() if len(layout.ranks) != self.world_size
        )
        self.board = PhaseBoard()
        # The engine first (every rank of the actor at the same point: it creates process groups),
        # then the training RNG is seeded (vLLM seeds the global RNGs as it starts).
        self.rollout: Rollout | None = None
        if "rollout" in groups:
            self.rollout = Rollout(
                arr.rollout,
                model_path,
                self.tokenizer,
                dp_group=groups["rollout"].groups["dp"],
                trust_remote_code=arr.model.trust_remote_code,
                world=groups["rollout"].groups["all"] if "rollout" in self._apart else None,
            )
        # Generation disaggregated: the rollout engine on ranks apart from the actor's.
        self._rollout_apart = set(self.topology.roles["rollout"].ranks) != set(self.topology.roles["actor"].ranks)
        self._send: DisaggregatedSync | None = None
        self.closed = False
        self.actor: Actor | None = None
        self.reference: Reference | None = None
        self.critic: Critic | None = None
        try:
            first = next((role for role in ("actor", "ref", "critic", "reward_model") if role in groups), None)
            if first is not None:  # not on a rank that only generates (the rollout apart, alone)
                megatron_state.initialize_role(groups[first].pg_collection, seed=arr.actor.megatron.seed)
            torch.manual_seed(t.seed)
            balance = t.balance_batch
            temperature = arr.rollout.temperature
            self.actor = None if "actor" not in groups else Actor(
                dataclasses.replace(arr.actor, optim=actor_optim),
                arr.model,
                pg=groups["actor"].pg_collection,
                total_training_steps=actor_total,
                max_sequence_length=max_len,
                log_prob_micro_batch_size=arr.rollout.log_prob_micro_batch_size_per_gpu,
                log_prob_max_token_len=token_budget(
                    arr.rollout.log_prob_use_dynamic_bsz,
                    arr.rollout.log_prob_max_token_len_per_gpu,
                    flag="actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
                    key="actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
                ),
                temperature=temperature,
                balance=balance,
                old_log_prob=cfg.old_log_prob_source,
            )
            self.reference = (
                Reference(
                    arr.ref,
                    arr.model,
                    pg=groups["ref"].pg_collection,
                    max_sequence_length=max_len,
                    temperature=temperature,
                    balance=balance,
                )
                if "ref" in groups
                else None
            )
            self.critic = (
                Critic(
                    critic_cfg,
                    pg=groups["critic"].pg_collection,
                    total_training_steps=critic_total,
                    max_sequence_length=max_len,
                    balance=balance,
                )
                if critic_cfg is not None and "critic" in groups
                else None
            )
            self.reward = self._reward_model(groups, max_len, balance)
            if self._rollout_apart:  # every rank plans the transfer; the engine keeps its memory
                if self.rollout is not None:
                    self.rollout.attach_apart()
                self._send = DisaggregatedSync(
                    self.actor.engine if self.actor is not None else None,
                    self.rollout.engine if self.rollout is not None else None,
                    rollout_rank=groups["rollout"].coords.local_rank if self.rollout is not None else None,
                    bucket_bytes=arr.rollout.update_weights_bucket_megabytes * 2**20,
                    rollout_world=groups["rollout"].groups["all"] if self.rollout is not None else None,
                )
            elif self.rollout is not None:
                self.rollout.attach(self.actor.engine)
            a = cfg.algorithm
            self.kl_ctrl = make_kl_controller(
                type=a.kl_ctrl.type,
                kl_coef=a.kl_ctrl.kl_coef,
                target_kl=a.kl_ctrl.target_kl,
                horizon=a.kl_ctrl.horizon,
            )
            keep = [k for k in (t.max_actor_ckpt_to_keep, t.max_critic_ckpt_to_keep) if k is not None]
            self.checkpoints = CheckpointManager(t.default_local_dir, max_to_keep=min(keep) if keep else None)
            # The run report's inputs beside metrics.jsonl (rank 0 writes them).
            self.reporting = t.report_freq != 0 and "jsonl" in t.logger
            self._is_rank0 = dist.get_rank() == 0
            self.scores_file = report.StepRecords(os.path.join(t.log_dir, report.SCORES_FILE))
            self.samples_file = report.StepRecords(os.path.join(t.log_dir, report.SAMPLES_FILE))
        except BaseException:
            if self.rollout is not None:
                self.rollout.shutdown()
            megatron_state.destroy_model_parallel()
            raise
        self.global_step = 0
        self._iterator: Iterator[dict[str, Any]] | None = None
        self._last_saved_step: int | None = None
        self._last_checkpoint: str | None = None
        self._config_written = False
        self._resumed = False
        self.skipped = SkippedSteps(t.max_consecutive_skipped_steps)
        self.stopped_by: str | None = None  # the signal that stopped fit(), if one did
        self.step_timer: _Timer | None = None  # the current step's phases (begin_step)
        self.step_start = 0.0
        self.pipeline = build_step(cfg)  # the config's step; fit() runs it
        self.pipeline.bind(self)
        log_rank0(
            logger,
            logging.INFO,
            "RL trainer: %s on %s; training %s (%d prompts, %d steps per epoch of %d x n=%d, %d steps); "
            "%s; %s",
            _describe_step(cfg, self.pipeline),
            os.path.abspath(model_path),
            show_files(cfg.data.train_files),
            len(self.train_dataset),
            self.steps_per_epoch,
            cfg.data.train_batch_size,
            self.n,
            self.total_steps,
            f"validation {show_files(cfg.data.val_files)} ({len(self.val_dataset)} prompts)"
            if self.val_dataset is not None else "no validation",
            self.topology.describe(),
        )

    # -- construction ---------------------------------------------------------------------

    def _topology(self) -> Topology:
        cfg, world = self.cfg, self.world_size
        roles_built = ["actor"] + [
            role for role, on in (("ref", self.use_reference), ("critic", self.use_critic),
                                  ("reward_model", cfg.reward_model.enable)) if on
        ]
        placed = role_ranks(cfg.trainer.placement, world, roles_built)  # validated with the config

        def megatron(m, role: str) -> RoleLayout:
            return RoleLayout(
                ranks=placed[role],
                tensor_parallel=m.tensor_model_parallel_size,
                pipeline_parallel=m.pipeline_model_parallel_size,
                context_parallel=m.context_parallel_size,
            )

        arr = cfg.actor_rollout_ref
        roles = {
            "actor": megatron(arr.actor.megatron, "actor"),
            # With the actor (the hybrid engine) unless placed apart; in a world of its own when apart.
            "rollout": RoleLayout(ranks=placed["rollout"], tensor_parallel=arr.rollout.tensor_model_parallel_size),
        }
        if self.use_reference:
            roles["ref"] = megatron(arr.ref.megatron, "ref")
        if self.use_critic:
            roles["critic"] = megatron(cfg.critic.megatron, "critic")
        if cfg.reward_model.enable:
            roles["reward_model"] = megatron(cfg.reward_model.megatron, "reward_model")
        return Topology(world_size=world, roles=roles)

    # -- roles on part of the world -------------------------------------------------------

    def runs(self, role: str) -> bool:
        """Whether this rank holds ``role`` (``actor``, ``ref``, ``critic``, ``reward_model``)."""
        return role in self._mine

    def _exchange_phase(self, timer: _Timer) -> contextlib.AbstractContextManager:
        """The ``exchange`` phase's timer when some role is apart; nothing to time otherwise (no
        collective: :meth:`_exchange` only merges the metrics)."""
        return timer("exchange") if self._apart else contextlib.nullcontext()

    def _exchange(
        self, batch: Batch | None, shares: list[tuple[str, list[str], dict[str, float]]]
    ) -> tuple[Batch | None, dict[str, float]]:
        """Hand each role's new ``batch`` columns and metrics, computed on its ranks, to every rank
        (collective over the world, in ``shares`` order: (role, column names, metrics)). Roles on
        every rank computed them everywhere already."""
        metrics: dict[str, float] = {}
        for role, keys, found in shares:
            if role not in self._apart:
                metrics.update(found)
                continue
            src = self._source[role]
            if keys:
                columns = share_columns({k: batch[k] for k in keys} if self.runs(role) else None, src)
                for key, value in columns.items():
                    batch[key] = value
            metrics.update(share_object(found, src))
        return batch, metrics

    def _reward_model(self, groups, max_len: int, balance: bool) -> RewardModel:
        cfg = self.cfg
        rm = cfg.reward_model
        model_role = None
        if rm.enable and "reward_model" in groups:
            model_role = RewardModel.build_model_role(
                model=ModelConfig(
                    path=rm.model.path,
                    trust_remote_code=rm.model.trust_remote_code,
                    override_config=dict(rm.model.override_config),
                    use_remove_padding=rm.model.use_remove_padding,
                ),
                megatron=rm.megatron,
                pg=groups["reward_model"].pg_collection,
                max_sequence_length=max_len,
                balance=balance,
            )
        return RewardModel(
            reward_manager_from_config(cfg, self.tokenizer),
            custom_scorer=bool(cfg.custom_reward_function.path),
            model_role=model_role,
            micro_batch_size=rm.micro_batch_size_per_gpu,
            model_source=self._source["reward_model"] if "reward_model" in self._apart else None,
        )

    # -- data -----------------------------------------------------------------------------

    def _next_prompts(self) -> dict[str, Any] | None:
        """The next training batch of prompts, moving to the next epoch as needed; None when
        ``trainer.total_epochs`` epochs are used up."""
        while self.loader.epoch < self.cfg.trainer.total_epochs:
            if self._iterator is None:
                self._iterator = iter(self.loader)
            try:
                return next(self._iterator)
            except StopIteration:  # the loader has moved to the next epoch
                self._iterator = None
        return None

    def prompt_batch(self, draw: int = 0) -> Batch | None:
        """The next training batch of prompts with a ``uid`` per prompt (``step/draw/i``); None when
        ``trainer.total_epochs`` epochs are used up."""
        if self.cfg.data.pairs:
            raise ValueError("data.pairs=true: the loader yields preference pairs; take them with preference_batch()")
        data = self._next_prompts()
        if data is None:
            return None
        prompts = _to_batch(data)
        prompts["uid"] = [f"{self.global_step}/{draw}/{i}" for i in range(len(prompts))]
        return prompts

    def preference_batch(self) -> Batch | None:
        """The next B preference pairs (``data.pairs``) as 2B rollout-layout rows: pair i's chosen
        response at row 2i, its rejected one at 2i + 1 (``pair_side`` [2B]: 0, 1), each with
        ``input_ids``, ``attention_mask``, ``position_ids`` [2B, P+R], ``responses`` and
        ``response_mask`` [2B, R], and the pair's ``uid``; None when the epochs are used up."""
        if not self.cfg.data.pairs:
            raise ValueError("preference_batch needs preference pairs: set data.pairs=true (prompt, chosen, rejected files)")
        data = self._next_prompts()
        if data is None:
            return None
        b = len(data["uid"])
        # [B, 2, ...] -> [2B, ...]: chosen and rejected of one pair side by side.
        rows = {
            name: torch.stack([data[f"{side}_{name}"] for side in PAIR_SIDES], dim=1).flatten(0, 1)
            for name in ("input_ids", "attention_mask", "position_ids", "response_mask")
        }
        rows["response_mask"] = rows["response_mask"].to(torch.float32)
        rows["responses"] = rows["input_ids"][:, -self.cfg.data.max_response_length :]
        rows["pair_side"] = torch.arange(2).repeat(b)
        batch = Batch.from_dict(rows, {"uid": [f"{self.global_step}/{u}" for u in data["uid"] for _ in PAIR_SIDES]})
        return batch

    def update_preference(
        self,
        batch: Batch,
        *,
        beta: float,
        loss_type: str = "sigmoid",
        label_smoothing: float = 0.0,
        advance_step: bool = True,
    ) -> dict[str, float]:
        """DPO's step on :meth:`preference_batch`'s pairs: the reference's log-probs, then
        ``Actor.update_preference``; advances :attr:`global_step` (unless ``advance_step=False``: a
        second update within a step that already advanced it) and returns the step's metrics."""
        if not self.use_reference:
            raise ValueError(
                "DPO needs the frozen reference policy, which this trainer does not build: train on "
                "data.pairs=true, or turn on actor_rollout_ref.actor.use_kl_loss (e.g. PPOUpdateOperator(kl_coef=0.001))"
            )
        timer = _Timer(self._enter)
        start = time.perf_counter()
        if advance_step:
            self.global_step += 1
        with timer("ref"):
            if self.runs("ref"):
                batch["ref_log_prob"] = self.reference.compute_log_prob(batch, temperature=1.0)
        if "ref" in self._apart:
            with timer("exchange"):
                batch, _ = self._exchange(batch, [("ref", ["ref_log_prob"], {})])
        with timer("update_actor"):
            metrics = {}
            if self.runs("actor"):
                metrics = self.actor.update_preference(
                    batch, beta=beta, loss_type=loss_type, label_smoothing=label_smoothing
                )
        if "actor" in self._apart:
            with timer("exchange"):
                _, metrics = self._exchange(None, [("actor", [], metrics)])
        metrics.update(
            self.skipped.record(
                self.global_step, metrics.get("actor/num_skipped_updates", 0) > 0, last_checkpoint=self._last_checkpoint
            )
        )
        timer.seconds["step"] = time.perf_counter() - start
        metrics.update(timer.metrics())
        metrics["training/global_step"] = float(self.global_step)
        metrics["training/epoch"] = float(self.loader.epoch)
        return metrics

    def _seed(self, draw: int) -> int:
        return self.cfg.actor_rollout_ref.rollout.seed + self.global_step * _STEP_STRIDE + draw

    def sampling_seed(self, draw: int = 0) -> int:
        """The rollout seed of this step's ``draw``-th generation batch (what :meth:`train_step` uses)."""
        return self._seed(draw)

    @property
    def last_checkpoint(self) -> str | None:
        """The directory of the newest checkpoint this run saved or resumed from."""
        return self._last_checkpoint

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
        batch: Batch | None = None
        greedy: Batch | None = None
        metrics: dict[str, float] = {}
        remax = self.cfg.algorithm.adv_estimator == "remax"
        with self._rollout_phase() as push:
            if self.rollout is not None:  # the rollout's ranks
                if call_sizes is None:
                    batch = self.rollout.generate(prompts, seed=seed)
                    metrics = {**push, **self.rollout.last_metrics}
                else:
                    batch, calls = self._generate_in_calls(prompts, seed=seed, call_sizes=call_sizes)
                    metrics = {**push, **calls}
                if remax:
                    greedy = self.rollout.generate(prompts, seed=seed + _REMAX_OFFSET, greedy=True)
        if "rollout" in self._apart:  # the samples reach every rank
            src = self._source["rollout"]
            batch = share_batch(batch, src)
            metrics = share_object(metrics, src)
            if remax:
                greedy = share_batch(greedy, src)
        if remax:
            baseline = self.reward.score(greedy).scores  # [B]
            batch["reward_baselines"] = baseline.repeat_interleave(self.n)
        batch["response_mask"] = batch["response_mask"].to(torch.float32)
        return batch, metrics

    @contextlib.contextmanager
    def _rollout_phase(self) -> Iterator[dict[str, float]]:
        """The rollout phase on the rollout's ranks (``Rollout.phase``: the block runs in their
        world); with the engine apart from the actor, the actor's weights are sent to it first
        (collective over the world). Yields the push's metrics on the rollout's ranks."""
        sent: dict[str, float] = {}
        if self._send is not None:
            sent = self._send.push()
        if self.rollout is None:
            yield {}
            return
        with self.rollout.phase() as push:
            yield {**sent, **push}

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
        batch["token_level_scores"] = result.token_level_scores
        for key, values in result.extra.items():
            if key not in batch:
                batch[key] = values
        return batch, result.metrics

    def compute_old_log_prob(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """``old_log_probs`` [B, R] from the actor, ``actor/entropy`` and the rollout agreement metrics."""
        log_probs, entropy = self.actor.compute_log_prob(batch)
        batch["old_log_probs"] = log_probs
        mask = batch["response_mask"]
        metrics = {"actor/entropy": float(masked_mean(entropy, mask))}
        if "rollout_log_probs" in batch:
            metrics.update(rollout_agreement_metrics(batch["rollout_log_probs"], log_probs, mask))
        return batch, metrics

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """``ref_log_prob`` [B, R] from the frozen reference."""
        batch["ref_log_prob"] = self.reference.compute_log_prob(batch)
        return batch

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
        advantages, returns = compute_advantage(a.adv_estimator, **inputs)
        batch["advantages"], batch["returns"] = advantages.float(), returns.float()
        return batch, metrics

    def update_critic(self, batch: Batch) -> dict[str, float]:
        """One critic update on the step's batch; ``critic/*`` metrics."""
        return self.critic.update(batch, shuffle_seed=self._shuffle_seed(1), rollout_n=self.n)

    def update_actor(self, batch: Batch) -> dict[str, float]:
        """One actor update on the step's batch; ``actor/*`` metrics."""
        return self.actor.update(batch, shuffle_seed=self._shuffle_seed(0), rollout_n=self.n)

    def _shuffle_seed(self, role: int) -> int:
        return (self.cfg.trainer.seed * 1_000_003 + self.global_step) * 2 + role

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

    def _enter(self, phase: str) -> None:
        self.board.post(phase, self.global_step)

    def train_step(self) -> dict[str, float] | None:
        """One step of the config's pipeline (:attr:`pipeline`, ``verl.trainer.step.build_step``);
        its metrics, or None when the data is used up."""
        return self.pipeline.run(self)

    def begin_step(self) -> _Timer:
        """Start a step's clock and phase timer (the pipeline calls it first); returns the timer."""
        self.step_timer = _Timer(self._enter)
        self.step_start = time.perf_counter()
        return self.step_timer

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        """``with trainer.phase("gen"):`` adds the block's seconds to the step's ``timing_s/gen``
        (and posts the phase for failure reports); outside a step it only posts the phase."""
        if self.step_timer is None:
            self._enter(name)
            return contextlib.nullcontext()
        return self.step_timer(name)

    def update_step(self, batch: Batch, metrics: dict[str, float] | None = None) -> dict[str, float]:
        """The step after rollout and reward (``batch`` has ``token_level_scores``): old, reference
        log-probs and values, advantages, the critic and actor updates; returns ``metrics`` with the
        step's added. Advances :attr:`global_step`. Inside a step (:meth:`begin_step`) its phases
        and throughput count from the step's start."""
        timer = self.step_timer or _Timer(self._enter)
        start = self.step_start if self.step_timer is not None else time.perf_counter()
        metrics = dict(metrics or {})
        self.global_step += 1
        source = self.cfg.old_log_prob_source
        shares: list[tuple[str, list[str], dict[str, float]]] = []  # what roles apart hand to every rank
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
        if self.use_reference:
            with timer("ref"):
                if self.runs("ref"):
                    batch = self.compute_ref_log_prob(batch)
                shares.append(("ref", ["ref_log_prob"], {}))
        if self.use_critic:
            with timer("values"):
                if self.runs("critic"):
                    batch = self.compute_values(batch)
                shares.append(("critic", ["values"], {}))
        with self._exchange_phase(timer):
            batch, more = self._exchange(batch, shares)
            metrics.update(more)
        with timer("adv"):
            batch, more = self.compute_advantage(batch)
            metrics.update(more)
            check_finite_rewards(
                self.global_step,
                {"token_level_rewards": batch["token_level_rewards"], "advantages": batch["advantages"]},
                batch["response_mask"],
                batch.non_tensors.get(DATA_SOURCE_COLUMN, ["?"] * len(batch)),
            )
        updates: list[tuple[str, list[str], dict[str, float]]] = []
        if self.use_critic:
            with timer("update_critic"):
                updates.append(("critic", [], self.update_critic(batch) if self.runs("critic") else {}))
        if self.global_step > self.cfg.trainer.critic_warmup:
            with timer("update_actor"):
                updates.append(("actor", [], self.update_actor(batch) if self.runs("actor") else {}))
        with self._exchange_phase(timer):
            metrics.update(self._exchange(None, updates)[1])
        with timer("records"):  # the skip count, the run report's per-sample scores
            skipped = any(metrics.get(f"{role}/num_skipped_updates", 0) > 0 for role in ("actor", "critic"))
            metrics.update(self.skipped.record(self.global_step, skipped, last_checkpoint=self._last_checkpoint))
            if self.reporting and self._is_rank0:
                self.scores_file.append(
                    self.global_step, [{"scores": [round(float(v), 6) for v in batch["token_level_scores"].sum(-1)]}]
                )
        seconds = time.perf_counter() - start
        timer.seconds["step"] = seconds
        metrics.update(data_metrics(batch, use_critic=self.use_critic))
        metrics.update(throughput_metrics(batch, step_seconds=seconds, world_size=self.world_size))
        metrics.update(timer.metrics())
        metrics["training/global_step"] = float(self.global_step)
        metrics["training/epoch"] = float(self.loader.epoch)
        return metrics

    # -- validation -----------------------------------------------------------------------

    def validate(self) -> dict[str, float]:
        """Validation with ``rollout.val_kwargs``: ``val-core/{data_source}/reward/mean@{n}`` ...
        (the same on every rank)."""
        if self.val_loader is None:
            return {}
        self._enter("testing")
        start = time.perf_counter()
        samples: list[dict[str, Any]] = []  # one record per sample: data_source, prompt, reward, extras
        shown: list[dict[str, Any]] = []  # generations for the run report
        batches: list[Batch] = []
        offset = 0
        for data in self.val_loader:
            prompts = _to_batch(data)
            prompts["uid"] = [f"val/{offset + i}" for i in range(len(prompts))]
            offset += len(prompts)
            batches.append(prompts)
        outs: list[Batch | None] = [None] * len(batches)
        with self._rollout_phase():  # the rollout's ranks generate; the reward is every rank's
            if self.rollout is not None:
                for i, prompts in enumerate(batches):
                    outs[i] = self.rollout.generate(prompts, seed=_VAL_OFFSET + self._seed(0), validate=True)
        for out in outs:
            if "rollout" in self._apart:
                out = share_batch(out, self._source["rollout"])
            result = self.reward.score(out)
            for i, (source, uid) in enumerate(
                zip(out.non_tensors[DATA_SOURCE_COLUMN], out.non_tensors["uid"])
            ):
                record = {name: values[i] for name, values in result.extra.items()}
                samples.append(
                    {**record, "reward": float(result.scores[i]), "_source": str(source), "_uid": uid}
                )
            if self.reporting and self._is_rank0:
                shown.extend(self._generations(out, result.scores))
        names = list(dict.fromkeys(k for s in samples for k in s if not k.startswith("_")))
        metrics = validation_metrics(
            data_sources=[s["_source"] for s in samples],
            prompt_ids=[s["_uid"] for s in samples],
            variables={name: [s.get(name) for s in samples] for name in names},
        )
        metrics["timing_s/testing"] = time.perf_counter() - start
        if shown:
            self.samples_file.append(self.global_step, shown)
        return metrics

    def _generations(self, out: Batch, scores: torch.Tensor) -> list[dict[str, Any]]:
        """(data_source, prompt, response, reward) of each validation sample, as text."""
        r = out["responses"].shape[1]
        prompt_mask = out["attention_mask"][:, :-r].bool()
        response_mask = out["response_mask"].bool() if "response_mask" in out else out["attention_mask"][:, -r:].bool()
        records = []
        for i, source in enumerate(out.non_tensors[DATA_SOURCE_COLUMN]):
            records.append(
                {
                    "data_source": str(source),
                    "prompt": self.tokenizer.decode(out["prompts"][i][prompt_mask[i]].tolist(), skip_special_tokens=True),
                    "response": self.tokenizer.decode(
                        out["responses"][i][response_mask[i]].tolist(), skip_special_tokens=True
                    ),
                    "reward": round(float(scores[i]), 6),
                }
            )
        return records

    def write_report(self) -> str | None:
        """Rewrite ``report.html`` in ``trainer.log_dir`` from what the run logged (rank 0); its path."""
        if not (self.reporting and self._is_rank0):
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

    def save_checkpoint(self) -> str:
        """Checkpoint the actor, the critic and the trainer state at the current step (collective)."""

        def write(tmp: str) -> None:  # each role on its ranks; roles apart write at the same time
            if self.actor is not None:
                self.actor.role.save(os.path.join(tmp, ACTOR_SUBDIR))
            if self.critic is not None:
                self.critic.role.save(os.path.join(tmp, CRITIC_SUBDIR))

        state = {
            "dataloader": self.loader.state_dict(),
            "kl_ctrl": self.kl_ctrl.state_dict(),
            "total_steps": self.total_steps,
        }
        self._enter("save_checkpoint")
        path = self.checkpoints.save(self.global_step, write, state)
        self._last_saved_step = self.global_step
        self._last_checkpoint = path
        return path

    def resume(self) -> int:
        """Load the checkpoint ``trainer.resume_mode`` selects (if any); returns the step to continue
        from. Runs once (``fit`` calls it)."""
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
            self.loader.load_state_dict(state["dataloader"])
            self._iterator = None
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])
            self.global_step = int(state["global_step"])
            self._last_saved_step = self.global_step
            self._last_checkpoint = found.path
            log_rank0(logger, logging.INFO, "resumed from %s (step %d)", found.path, self.global_step)
        self.tracking.rewind(self.global_step)
        if self._is_rank0:
            self.scores_file.rewind(self.global_step)
            self.samples_file.rewind(self.global_step)
        return self.global_step

    # -- the loop -------------------------------------------------------------------------

    def fit(
        self, *, stop_after: int | None = None, step_fn: Callable[[], dict[str, float] | None] | None = None
    ) -> dict[str, float]:
        """Train to ``total_steps`` (resuming first) in the one loop (``verl.trainer.loop.Loop``:
        validation, checkpoints, loggers, report, export, stop signals); returns the last step's
        and the latest validation's metrics.

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

    @property
    def last_saved_step(self) -> int | None:
        """The step of the newest checkpoint this run saved or resumed from."""
        return self._last_saved_step

    def export_actor_hf(self, out_dir: str) -> None:
        """Write the actor's weights as a Hugging Face checkpoint in ``out_dir`` (collective: the
        actor's ranks write it, every rank returns once it is complete)."""
        if self.actor is not None:
            with self.actor.role.active():
                self.actor.engine.export_hf(out_dir)
        if "actor" in self._apart:
            dist.barrier()

    def close(self) -> None:
        """Free the rollout engine, the reward workers, the loggers and Megatron's state."""
        if self.closed:
            return
        self.closed = True
        self.tracking.close()
        if self.reward.manager is not None:
            self.reward.manager.close()
        if self.rollout is not None:
            self.rollout.shutdown()
        megatron_state.destroy_model_parallel()

    def __enter__(self) -> "RLTrainer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _describe_step(cfg: PPOConfig, pipeline: Any) -> str:
    """The startup line's algorithm and step: ``grpo (RolloutOperator -> RewardOperator -> PPOUpdateOperator)``."""
    kind = step_kind(cfg)
    what = {
        "dpo": f"dpo (preference pairs, data.pairs; beta={cfg.algorithm.dpo.beta})",
        "hybrid": f"hybrid {cfg.algorithm.adv_estimator}/dpo (reward >= {cfg.algorithm.hybrid.reward_threshold}: PPO update)",
        "dynamic_sampling": f"{cfg.algorithm.adv_estimator} with dynamic sampling (algorithm.filter_groups)",
        "rl": cfg.algorithm.adv_estimator,
    }[kind]
    return f"{what}; step {pipeline.describe()}"
