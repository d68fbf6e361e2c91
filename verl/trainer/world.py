"""The RL world: one ordered build of the placement and the roles this rank holds.

:func:`build_rl_world` does, in this order (each step logged on rank 0):

1. the placement: a :class:`verl.parallel.Topology` from ``trainer.placement`` (every role on
   every rank unless placed apart) and each role's process groups, made inside its own world
   when it is apart (``verl.parallel.role_world``);
2. the rollout engine, on the rollout's ranks, every one of them at the same point (it creates
   process groups);
3. Megatron's parallel state for the first trained role this rank holds, then the training RNG
   seeded (vLLM seeds the global RNGs as it starts);
4. the actor, reference and critic (learning-rate schedule lengths converted from trainer steps to
   optimizer updates), on-policy distillation's teacher, the reward (rule-based scorers and a
   reward model);
5. the weight path into the engine: the actor's engine attached to a colocated rollout (the
   hybrid engine), or a :class:`verl.hybrid.DisaggregatedSync` to a rollout apart.

A role on part of the world computes on its ranks and hands its columns and metrics to every
rank (:meth:`RLWorld.exchange`) after the passes that can run side by side on disjoint ranks. In
the streaming modes, ranks that hold the rollout alone get them after the updates instead (they
generate meanwhile), and the others exchange over :attr:`RLWorld.trainer_group`
(``verl.trainer.step.stream``); a reference on those ranks computes each batch's log-probs with
the batch (:attr:`RLWorld.ref_ahead`), so they still count as ranks that only generate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

from verl.algos.distill import teacher_topk
from verl.config import PPOConfig
from verl.config.schema import ModelConfig, OptimConfig
from verl.engine import lr_schedule_steps
from verl.hybrid import DisaggregatedSync
from verl.hybrid.weight_sync import push_totals
from verl.models.vocab_parallel import SamplingTruncation
from verl.parallel import megatron_state
from verl.parallel.bootstrap import new_group
from verl.parallel.placement import role_ranks
from verl.parallel.topology import RoleLayout, Topology
from verl.protocol import Batch
from verl.rewards import reward_manager_from_config
from verl.roles import Actor, Critic, Reference, RewardModel, Rollout
from verl.roles.dispatch import share_columns, share_object
from verl.roles.engine_role import token_budget
from verl.rollout.base import sampling_spec
from verl.roles.teacher import Teacher

logger = logging.getLogger(__name__)

__all__ = ["RLWorld", "build_rl_world", "schedule"]


def schedule(optim: OptimConfig, trainer_steps: int, updates_per_step: int) -> tuple[OptimConfig, int]:
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


@dataclasses.dataclass
class RLWorld:
    """The roles this rank holds (None where it holds none) and where every role lives."""

    cfg: PPOConfig
    world_size: int
    topology: Topology
    mine: frozenset[str]  # the roles this rank holds
    source: dict[str, int]  # role -> the rank that hands its results to every rank
    apart: frozenset[str]  # roles on part of the world
    rollout: Rollout | None = None
    actor: Actor | None = None
    reference: Reference | None = None
    critic: Critic | None = None
    reward: RewardModel | None = None
    teacher: Teacher | None = None  # on-policy distillation's frozen teacher (distillation.enabled)
    send: Any = None  # the weight push to a rollout engine apart from the actor (DisaggregatedSync; GatheredSend for FSDP2)
    # A streaming rollout (trainer.rollout_mode one_step_off|async) on ranks that hold no role of
    # the passes before the updates (actor, ref, critic): those ranks generate ahead from the start
    # of the update step, and the other ranks hand each other the passes' columns over this group
    # (verl.trainer.step.stream). None: no such ranks, or the synchronous mode.
    trainer_group: Any = None
    generates_only: bool = False  # this rank is one of those (it holds the rollout and none of the three)
    # A streaming rollout with the reference on the rollout's ranks apart from the actor (its ranks
    # among the rollout's, the rollout's first included): the rollout's ranks compute each batch's
    # reference log-probs as they generate it (the reference never changes), and the batch brings
    # them to every rank; the update step computes none (verl.trainer.step.stream). Same on every rank.
    ref_ahead: bool = False

    def runs(self, role: str) -> bool:
        """Whether this rank holds ``role`` (``actor``, ``ref``, ``critic``, ``reward_model``)."""
        return role in self.mine

    def exchange(
        self, batch: Batch | None, shares: list[tuple[str, list[str], dict[str, float]]]
    ) -> tuple[Batch | None, dict[str, float]]:
        """Hand each role's new ``batch`` columns and metrics, computed on its ranks, to every rank
        (collective over the world, in ``shares`` order: (role, column names, metrics)). Roles on
        every rank computed them everywhere already."""
        metrics: dict[str, float] = {}
        for role, keys, found in shares:
            if role not in self.apart:
                metrics.update(found)
                continue
            src = self.source[role]
            if keys:
                columns = share_columns({k: batch[k] for k in keys} if self.runs(role) else None, src)
                for key, value in columns.items():
                    batch[key] = value
            metrics.update(share_object(found, src))
        return batch, metrics

    def exchange_among_trainers(
        self, batch: Batch, shares: list[tuple[str, list[str], dict[str, float]]]
    ) -> tuple[Batch, dict[str, float]]:
        """:meth:`exchange` over :attr:`trainer_group` only (every rank but those that only
        generate; called on those ranks alone): a role on all of them computed its results there
        already."""
        import torch.distributed as dist

        group = self.trainer_group
        members = set(dist.get_process_group_ranks(group))
        metrics: dict[str, float] = {}
        for role, keys, found in shares:
            if members <= set(self.topology.roles[role].ranks):
                metrics.update(found)
                continue
            src = self.source[role]
            if keys:
                columns = share_columns({k: batch[k] for k in keys} if self.runs(role) else None, src, group)
                for key, value in columns.items():
                    batch[key] = value
            metrics.update(share_object(found, src, group))
        return batch, metrics

    @contextlib.contextmanager
    def rollout_phase(self) -> Iterator[dict[str, float]]:
        """The rollout phase on the rollout's ranks (``Rollout.phase``: the block runs in their
        world); with the engine apart from the actor, the actor's weights are sent to it first
        (collective over the world). Yields the push's metrics on the rollout's ranks (a push to an
        engine apart: its totals over every rank, the actor's sent bytes with the engine's received)."""
        sent: dict[str, float] = {}
        if self.send is not None:
            sent = push_totals(self.send.push())
        if self.rollout is None:
            yield {}
            return
        with self.rollout.phase() as push:
            yield {**sent, **push}

    def close(self) -> None:
        """Free the reward workers, the rollout engine and Megatron's state."""
        if self.reward is not None and self.reward.manager is not None:
            self.reward.manager.close()
        if self.rollout is not None:
            self.rollout.shutdown()
        megatron_state.destroy_model_parallel()


def _topology(cfg: PPOConfig, world_size: int) -> Topology:
    roles_built = ["actor"] + [
        role for role, on in (("ref", cfg.use_reference), ("critic", cfg.use_critic),
                              ("reward_model", cfg.reward_model.enable), ("teacher", cfg.use_teacher)) if on
    ]
    placed = role_ranks(cfg.trainer.placement, world_size, roles_built)  # validated with the config

    def megatron(m: Any, role: str) -> RoleLayout:
        return RoleLayout(
            ranks=placed[role],
            tensor_parallel=m.tensor_model_parallel_size,
            pipeline_parallel=m.pipeline_model_parallel_size,
            context_parallel=m.context_parallel_size,
            expert_parallel=m.expert_model_parallel_size,
        )

    arr = cfg.actor_rollout_ref
    roles = {
        "actor": megatron(arr.actor.megatron, "actor"),
        # With the actor (the hybrid engine) unless placed apart; in a world of its own when apart.
        "rollout": RoleLayout(ranks=placed["rollout"], tensor_parallel=arr.rollout.tensor_model_parallel_size),
    }
    if cfg.use_reference:
        roles["ref"] = megatron(arr.ref.megatron, "ref")
        if arr.model.lora_rank > 0:  # the reference is the actor with its adapters off (roles.reference)
            _check_lora_reference(roles["ref"], roles["actor"])
    if cfg.use_critic:
        roles["critic"] = megatron(cfg.critic.megatron, "critic")
    if cfg.reward_model.enable:
        roles["reward_model"] = megatron(cfg.reward_model.megatron, "reward_model")
    if cfg.use_teacher:
        roles["teacher"] = megatron(cfg.distillation.teacher_model.megatron, "teacher")
    return Topology(world_size=world_size, roles=roles)


def _check_lora_reference(ref: RoleLayout, actor: RoleLayout) -> None:
    """With LoRA the reference runs on the actor's model: same ranks and degrees, or ValueError."""
    mine = (tuple(ref.ranks), ref.tensor_parallel, ref.pipeline_parallel, ref.context_parallel)
    theirs = (tuple(actor.ranks), actor.tensor_parallel, actor.pipeline_parallel, actor.context_parallel)
    if mine != theirs:
        raise ValueError(
            "actor_rollout_ref.model.lora_rank > 0: the reference is the actor with its adapters switched off, "
            f"so it runs on the actor's ranks and layout (ranks, TP, PP, CP) {theirs}, not {mine}; leave "
            "actor_rollout_ref.ref.megatron's degrees and the reference's placement at the actor's"
        )


def _reward(cfg: PPOConfig, world: RLWorld, groups: dict[str, Any], tokenizer: Any, max_len: int) -> RewardModel:
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
            balance=cfg.trainer.balance_batch,
            strategy=rm.strategy,
            fsdp=rm.fsdp_config,
        )
    return RewardModel(
        reward_manager_from_config(cfg, tokenizer),
        custom_scorer=bool(cfg.custom_reward_function.path),
        model_role=model_role,
        micro_batch_size=rm.micro_batch_size_per_gpu,
        model_source=world.source["reward_model"] if "reward_model" in world.apart else None,
    )


def _ref_with_rollout(roles: dict[str, RoleLayout]) -> bool:
    """Whether the reference lives on the rollout's ranks apart from the actor: its ranks among the
    rollout's, the rollout's first (the one that hands the batch over) included, none of them the
    actor's (:attr:`RLWorld.ref_ahead`)."""
    if "ref" not in roles:
        return False
    ref, rollout, actor = (set(roles[role].ranks) for role in ("ref", "rollout", "actor"))
    return ref <= rollout and min(rollout) in ref and not rollout & actor


def _trainer_group(cfg: PPOConfig, world: RLWorld) -> None:
    """:attr:`RLWorld.trainer_group` and :attr:`RLWorld.generates_only` (streaming modes only)."""
    import torch.distributed as dist

    if cfg.trainer.rollout_mode == "sync" or world.world_size == 1:
        return
    roles = world.topology.roles
    world.ref_ahead = _ref_with_rollout(roles)
    passes = ("actor", "critic") if world.ref_ahead else ("actor", "ref", "critic")
    busy = {r for role in passes if role in roles for r in roles[role].ranks}
    only = set(roles["rollout"].ranks) - busy
    if not only:
        return
    # Through bootstrap.new_group, like the role groups: its members have a connect's time to join
    # and its collectives wait the collective timeout only once the start-up is over.
    world.trainer_group = new_group(
        sorted(set(range(world.world_size)) - only),
        timeout=datetime.timedelta(seconds=cfg.trainer.collective_timeout_s),
    )
    world.generates_only = dist.get_rank() in only


def replayed_truncation(cfg: PPOConfig) -> SamplingTruncation | None:
    """The rollout sampler's top-k / top-p that the actor's and reference's log-prob passes replay
    (``actor_rollout_ref.actor.replay_sampling_mask``); None when off, or when training samples are
    drawn greedily or untruncated."""
    if not cfg.actor_rollout_ref.actor.replay_sampling_mask:
        return None
    spec = sampling_spec(cfg.actor_rollout_ref.rollout, validate=False)
    truncation = SamplingTruncation(top_k=spec.top_k, top_p=spec.top_p)
    return truncation if not spec.greedy and truncation.active else None


def build_rl_world(cfg: PPOConfig, tokenizer: Any, *, world_size: int, total_steps: int) -> RLWorld:
    """The placement and this rank's roles for ``cfg`` (module docstring's order); the
    learning-rate schedules span ``total_steps`` trainer steps. What was built is freed when a
    later part fails."""
    t, arr = cfg.trainer, cfg.actor_rollout_ref
    max_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    batch = cfg.data.train_batch_size
    actor_optim, actor_total = schedule(
        arr.actor.optim, total_steps, arr.actor.ppo_epochs * (batch // arr.actor.ppo_mini_batch_size)
    )
    critic_cfg, critic_total = None, 0
    if cfg.use_critic:
        c = cfg.critic
        critic_optim, critic_total = schedule(c.optim, total_steps, c.ppo_epochs * (batch // c.ppo_mini_batch_size))
        critic_cfg = dataclasses.replace(c, optim=critic_optim)

    # 1. Placement: each role on its ranks, with its own layout and groups.
    topology = _topology(cfg, world_size)
    groups = topology.build_groups(timeout=datetime.timedelta(seconds=t.collective_timeout_s))
    world = RLWorld(
        cfg=cfg,
        world_size=world_size,
        topology=topology,
        mine=frozenset(groups),
        source={role: min(layout.ranks) for role, layout in topology.roles.items()},
        apart=frozenset(role for role, layout in topology.roles.items() if len(layout.ranks) != world_size),
    )
    # 1b. A streaming rollout's ranks that only generate (every rank creates the group of the others).
    _trainer_group(cfg, world)
    # 2. The engine (every rank of the rollout at the same point: it creates process groups).
    if "rollout" in groups:
        world.rollout = Rollout(
            arr.rollout,
            os.path.expanduser(arr.model.path),
            tokenizer,
            dp_group=groups["rollout"].groups["dp"],
            trust_remote_code=arr.model.trust_remote_code,
            world=groups["rollout"].groups["all"] if "rollout" in world.apart else None,
            record_routing=arr.actor.megatron.router_replay.mode == "R3",
        )
    try:
        # 3. Megatron's state (not on a rank that only generates: the rollout apart, alone).
        first = next((role for role in ("actor", "ref", "critic", "reward_model", "teacher") if role in groups), None)
        if first is not None:
            megatron_state.initialize_role(groups[first].pg_collection, seed=arr.actor.megatron.seed)
        torch.manual_seed(t.seed)
        # 4. The trained and frozen roles, then the reward.
        balance, temperature = t.balance_batch, arr.rollout.temperature
        truncation = replayed_truncation(cfg)
        if "actor" in groups:
            world.actor = Actor(
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
                distillation=cfg.distillation.distillation_loss if cfg.use_teacher else None,
                truncation=truncation,
            )
        if "ref" in groups:
            world.reference = Reference(
                arr.ref, arr.model, pg=groups["ref"].pg_collection, max_sequence_length=max_len,
                temperature=temperature, balance=balance,
                policy=world.actor if arr.model.lora_rank > 0 else None, truncation=truncation,
            )
        if critic_cfg is not None and "critic" in groups:
            world.critic = Critic(
                critic_cfg, pg=groups["critic"].pg_collection, total_training_steps=critic_total,
                max_sequence_length=max_len, balance=balance,
            )
        if "teacher" in groups:
            world.teacher = Teacher(
                cfg.distillation.teacher_model, pg=groups["teacher"].pg_collection, max_sequence_length=max_len,
                temperature=temperature, balance=balance, topk=teacher_topk(
                    cfg.distillation.distillation_loss.loss_mode, cfg.distillation.distillation_loss.topk
                ),
            )
        world.reward = _reward(cfg, world, groups, tokenizer, max_len)
        # 5. The weight path: every rank plans a transfer to an engine apart (which keeps its
        # memory); a colocated engine takes the actor's weights in place.
        if set(topology.roles["rollout"].ranks) != set(topology.roles["actor"].ranks):
            if world.rollout is not None:
                world.rollout.attach_apart()
            if arr.actor.strategy == "fsdp2":  # whole tensors gathered from the shards, sent bucket by bucket
                from verl.hybrid.fsdp_sync import GatheredSend

                world.send = GatheredSend(
                    world.actor.engine if world.actor is not None else None,
                    world.rollout.engine if world.rollout is not None else None,
                    bucket_bytes=arr.rollout.update_weights_bucket_megabytes * 2**20,
                    rollout_world=groups["rollout"].groups["all"] if world.rollout is not None else None,
                )
            else:
                world.send = DisaggregatedSync(
                    world.actor.engine if world.actor is not None else None,
                    world.rollout.engine if world.rollout is not None else None,
                    rollout_rank=groups["rollout"].coords.local_rank if world.rollout is not None else None,
                    bucket_bytes=arr.rollout.update_weights_bucket_megabytes * 2**20,
                    rollout_world=groups["rollout"].groups["all"] if world.rollout is not None else None,
                    mode=arr.rollout.update_weights_mode, full_every=arr.rollout.update_weights_full_every,
                    block_bytes=arr.rollout.update_weights_delta_block_bytes,
                )
        elif world.rollout is not None:
            world.rollout.attach(world.actor.engine)
    except BaseException:
        if world.rollout is not None:
            world.rollout.shutdown()
        megatron_state.destroy_model_parallel()
        raise
    return world
