"""``Rollout``: the generation engine, its weights pushed from the actor before it samples.

The engine comes from ``verl.rollout.build_rollout_engine`` (vLLM in-process, or transformers'
``generate``) and spans the actor's ranks in ``W / TP'`` data-parallel replicas of ``TP'``
consecutive ranks. :meth:`generate` takes the whole prompt batch on every rank, gives replica
``r`` its ``r``-th share (the ranks of one replica pass identical prompts, as vLLM's
``external_launcher`` requires), samples, and gathers the samples back whole on every rank.

A plain ``nn.Module`` policy (the Python API's; ``verl.engine.torch_engine``) generates with its own
``generate()`` instead (``verl.rollout.module_engine``). On the plain engine the same module trains,
so there is nothing to push; on FSDP2 (``strategy=fsdp2``) the actor trains a sharded copy and the
module given is the rollout's whole replica, which ``GatheredSync`` fills bucket by bucket before
each generation, as it fills the transformers engine.

Weights and memory go through the hybrid engine (``verl.hybrid.WeightSync``; from an FSDP2 actor,
``verl.hybrid.fsdp_sync.GatheredSync``): inside
:meth:`phase` the engine's KV cache is back and the actor's current weights are in it; on exit
the KV cache is released for training (``rollout.free_cache_engine``). Several generations
(validation batches, ReMax's greedy baseline) can share one phase.

Sampling is seeded per call (``seed``): the same weights, prompts and seed give the same
samples, so a resumed run draws what the uninterrupted one drew without saving the engine's
random state.

The rollout lives on the actor's ranks, or on ranks of its own (``trainer.placement.rollout``:
generation disaggregated, :meth:`attach_apart`). Where its ranks are part of the world, the engine
is built and run inside their world (``verl.parallel.role_world``): vLLM's in-process engine then
spans those ranks as if they were the torchrun world.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from verl.engine.torch_engine import registered_module
from verl.hybrid import WeightSync
from verl.parallel.role_world import role_world
from verl.protocol import Batch
from verl.roles.dispatch import collect, shard
from verl.rollout import build_rollout_engine
from verl.rollout.base import RolloutEngine

if TYPE_CHECKING:
    from verl.config.schema import RolloutConfig
    from verl.hybrid.fsdp_sync import GatheredSync
    from verl.engine import MegatronEngine

__all__ = ["Rollout"]


class _SharedModule:
    """The hybrid engine's part when the rollout engine generates with the trained module itself
    (a plain ``nn.Module``, ``verl.rollout.module_engine``), or runs on ranks apart from the actor
    (the trainer sends the weights, ``verl.hybrid.DisaggregatedSync``): nothing to push here, no
    memory to hand over."""

    @contextlib.contextmanager
    def rollout_phase(self) -> Iterator[dict[str, float]]:
        yield {}


def _replica_share(tp: int) -> Any:
    """This rank's engine replica (``tp`` consecutive ranks of the current world) for the agent loop:
    its tools run on the replica's first rank only (``verl.rollout.agent.loop.ReplicaShare``). None
    when each rank is a replica of its own. Collective: every rank makes every replica's group."""
    if tp == 1 or not dist.is_initialized():
        return None
    from verl.rollout.agent.loop import ReplicaShare

    me, size, share = dist.get_rank(), dist.get_world_size(), None
    for first in range(0, size, tp):
        members = list(range(first, min(first + tp, size)))
        group = dist.new_group(members)
        if me in members:
            share = ReplicaShare(group, first, leader=me == first)
    return share


class Rollout:
    """The rollout engine and its weight sync (see the module docstring).

    Args:
        cfg: ``actor_rollout_ref.rollout``.
        model_path: the policy's Hugging Face directory (config, tokenizer, initial weights).
        tokenizer: the policy's tokenizer.
        dp_group: this rank's group of replicas (the ranks with its TP' rank, one per replica).
        trust_remote_code: ``actor_rollout_ref.model.trust_remote_code``.
        world: the group of the actor's ranks when they are part of the world (None: the world);
            every call of this role runs with it as the default group.
        record_routing: R3 router replay (``actor.megatron.router_replay.mode=R3``): the engine records
            the experts of every sample (``routed_experts``; the transformers engine, and vLLM on GPU).
    """

    def __init__(
        self,
        cfg: "RolloutConfig",
        model_path: str,
        tokenizer: Any,
        *,
        dp_group: dist.ProcessGroup | None,
        trust_remote_code: bool = False,
        world: dist.ProcessGroup | None = None,
        record_routing: bool = False,
    ) -> None:
        self.cfg = cfg
        self.dp_group = dp_group
        self.world = world
        with role_world(world):
            self._build(cfg, model_path, tokenizer, trust_remote_code, record_routing)
        if record_routing:  # R3 router replay: every sample carries the experts it was generated with
            if not hasattr(self.engine, "record_routing") or cfg.multi_turn.enable:
                raise ValueError(
                    f"actor.megatron.router_replay.mode=R3: the {cfg.name!r} rollout engine"
                    f"{' behind the multi-turn agent loop' if cfg.multi_turn.enable else ''} does not record the "
                    "experts it routes to; use actor_rollout_ref.rollout.name=hf (single-turn), vllm on GPU, or "
                    "router_replay.mode=R2"
                )
            self.engine.record_routing = True
        self.sync: WeightSync | GatheredSync | _SharedModule | None = None
        self._local = threading.local()  # per thread: inside phase() (the free-running generator has its own)
        # One engine call at a time across threads (the free-running generator's segments and the
        # owner's calls while it is paused: verl.trainer.step.generator).
        self.lock = threading.RLock()
        self.last_metrics: dict[str, float] = {}
        # Multi-turn rollouts with tools (``rollout.multi_turn.enable``): the agent loop drives the engine.
        self.agent = None
        if cfg.multi_turn.enable:
            from verl.rollout.agent import AgentLoop, load_agent_loop_config, load_interaction_config, load_tool_config

            path = cfg.multi_turn.tool_config_path
            tools = load_tool_config(os.path.expanduser(path)) if path else []
            talk_path = cfg.multi_turn.interaction_config_path
            interactions = load_interaction_config(os.path.expanduser(talk_path)) if talk_path else {}
            loops_path = cfg.agent.agent_loop_config_path
            agent_loops = load_agent_loop_config(os.path.expanduser(loops_path)) if loops_path else {}
            self.agent = AgentLoop(
                cfg.multi_turn,
                tools,
                tokenizer,
                response_length=cfg.response_length,
                interactions=interactions,
                agent_loops=agent_loops,
                endpoint=cfg.agent.endpoint,
            )
            self.agent.default_agent_loop = cfg.agent.default_agent_loop
            with role_world(world):
                self.agent.replica = _replica_share(cfg.tensor_model_parallel_size)
                # vLLM's data-parallel replicas all-reduce at every engine step: agent programs'
                # engine calls, timed by the programs, must then run in rounds across them.
                if cfg.name == "vllm" and dp_group is not None and dist.get_world_size(dp_group) > 1:
                    self.agent.lockstep = dp_group

    def _build(
        self, cfg: "RolloutConfig", model_path: str, tokenizer: Any, trust_remote_code: bool, record_routing: bool
    ) -> None:
        module = registered_module(model_path)
        if module is not None:  # a plain nn.Module: it generates itself (verl.rollout.module_engine)
            from verl.rollout.module_engine import ModuleRollout

            if cfg.tensor_model_parallel_size != 1:
                raise ValueError(
                    f"actor_rollout_ref.rollout.tensor_model_parallel_size={cfg.tensor_model_parallel_size}: a plain "
                    f"nn.Module ({type(module).__name__}) generates on its own rank; set it to 1"
                )
            self.engine: RolloutEngine = ModuleRollout(cfg, module, tokenizer=tokenizer)
        else:
            # vLLM records routing only when started to (enable_return_routed_experts); the others are told after.
            extra = {"record_routing": True} if record_routing and cfg.name == "vllm" else {}
            self.engine = build_rollout_engine(cfg, model_path, tokenizer, trust_remote_code=trust_remote_code, **extra)

    def attach(self, actor: "MegatronEngine") -> None:
        """Plan the weight transfer from ``actor`` (collective), then release the KV cache until
        the first :meth:`phase`."""
        from verl.rollout.module_engine import ModuleRollout

        with role_world(self.world):
            if isinstance(self.engine, ModuleRollout) and self.engine.module is getattr(actor, "module", None):
                self.sync = _SharedModule()  # the plain engine trains the very module that generates
            elif not actor.capabilities.megatron_layout:  # FSDP2 shards: whole tensors, bucket by bucket
                from verl.hybrid.fsdp_sync import GatheredSync

                if isinstance(self.engine, ModuleRollout):  # the module's whole replica generates beside the shards
                    self.engine.module.to(actor.device)

                self.sync = GatheredSync(
                    actor, self.engine, bucket_bytes=self.cfg.update_weights_bucket_megabytes * 2**20
                )
            elif getattr(actor, "is_vlm", False):  # a Megatron VLM: whole tensors, its vision tower included
                from verl.hybrid.hf_push import GatheredHFPush

                self.sync = GatheredHFPush(
                    actor, self.engine, bucket_bytes=self.cfg.update_weights_bucket_megabytes * 2**20
                )
            else:
                self.sync = WeightSync(
                    actor, self.engine, bucket_bytes=self.cfg.update_weights_bucket_megabytes * 2**20
                )
            self.engine.release()

    def attach_apart(self) -> None:
        """The engine runs on ranks apart from the actor's: it keeps its memory (no handoff), and
        the trainer sends it the actor's weights before each phase (``verl.hybrid.DisaggregatedSync``)."""
        self.sync = _SharedModule()

    @property
    def _in_phase(self) -> bool:
        return getattr(self._local, "in_phase", False)

    @_in_phase.setter
    def _in_phase(self, value: bool) -> None:
        self._local.in_phase = value

    @contextlib.contextmanager
    def phase(self) -> Iterator[dict[str, float]]:
        """The rollout phase (collective): KV cache back, actor weights pushed; released on exit.

        Yields the push's metrics (``timing_s/update_weights``, ``update_weights/bytes_*``). The
        block runs in the actor's world (``world``): only rollout calls belong in it.
        """
        if self.sync is None:
            raise RuntimeError("Rollout.phase: call attach(actor) first")
        if self._in_phase:
            yield {}
            return
        with role_world(self.world), self.sync.rollout_phase() as push:
            self._in_phase = True
            try:
                yield push
            finally:
                self._in_phase = False

    def generate(self, prompts: Batch, *, seed: int, validate: bool = False, greedy: bool = False) -> Batch:
        """Samples for every prompt of ``prompts`` (whole on every rank), ``n`` per prompt adjacent
        (``val_kwargs`` with ``validate``; one greedy sample per prompt with ``greedy``).

        Outside :meth:`phase` a phase is entered for this call. ``last_metrics`` holds the
        engine's ``rollout/*`` metrics of this call (its replica's share) and ``timing_s/gen``.
        """
        if not self._in_phase:
            with self.phase():
                return self.generate(prompts, seed=seed, validate=validate, greedy=greedy)
        with self.lock:
            return self._generate(prompts, seed=seed, validate=validate, greedy=greedy)

    def _generate(self, prompts: Batch, *, seed: int, validate: bool, greedy: bool) -> Batch:
        start = time.perf_counter()
        piece = shard(prompts, self.dp_group)
        generate = self.engine.generate if self.agent is None else functools.partial(self.agent.generate, self.engine)
        if greedy:
            with self._sampling(do_sample=False, n=1):
                local = generate(piece.rows, seed=seed)
        else:
            local = generate(piece.rows, validate=validate, seed=seed)
        if self.agent is not None:
            # An agent rollout's rows per prompt vary (each trajectory of a split agent-program
            # episode is a row): this rank drops its padding prompts' rows before the gather.
            start = len(piece.rows) * (dist.get_rank(self.dp_group) if self.dp_group is not None else 0)
            real = min(max(len(prompts) - start, 0), len(piece.rows))
            local = local[: sum(self.agent.last_rows_per_prompt[:real])]
            if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
                from verl.rollout.agent.images import align_image_columns

                local = align_image_columns(local, self.dp_group)  # each rank's tool images set its widths
            whole = collect(local, self.dp_group, dataclasses.replace(piece, pad=0))
        else:
            n = len(local) // max(len(piece.rows), 1)
            whole = collect(local, self.dp_group, dataclasses.replace(piece, pad=piece.pad * n))
        metrics = self.engine.last_metrics if self.agent is None else self.agent.last_metrics
        self.last_metrics = {**metrics, "timing_s/gen": time.perf_counter() - start}
        return whole

    def generate_segment(self, rows: Batch, *, seed: int, max_tokens: int, n: int) -> Batch:
        """At most ``max_tokens`` new tokens for each row of ``rows`` (``n`` samples of each):
        partial rollout's engine call (``verl.trainer.step.stream``). A row is a prompt, or a
        prompt and the response sampled so far (left-padded, up to ``prompt_length +
        response_length`` wide), which the engine continues as it would a prompt."""
        with self.lock:
            cfg = self.engine.cfg
            with self._sampling(n=n, response_length=max_tokens, prompt_length=cfg.prompt_length + cfg.response_length):
                return self.generate(rows, seed=seed)

    def add_tools(self, tools: list[Any]) -> None:
        """Offer ``tools`` (``verl.rollout.agent.Tool`` objects or plain functions) besides those of
        ``multi_turn.tool_config_path``: the Python API's ``RolloutOperator(tools=...)``."""
        if self.agent is None:
            raise ValueError("Rollout.add_tools: set actor_rollout_ref.rollout.multi_turn.enable=true first")
        from verl.rollout.agent import as_tools

        new = [t for t in as_tools(list(tools)) if self.agent.tools.get(t.name) is not t]  # binding twice adds nothing
        self.agent.tools = {t.name: t for t in as_tools([*self.agent.tools.values(), *new])}

    @contextlib.contextmanager
    def _sampling(self, **changes: Any) -> Iterator[None]:
        """The engine samples with ``changes`` to its rollout config for the block (ReMax's greedy
        baseline: the engine's public ``cfg`` is its sampling source)."""
        saved = self.engine.cfg
        self.engine.cfg = dataclasses.replace(saved, **changes)
        try:
            yield
        finally:
            self.engine.cfg = saved

    def shutdown(self) -> None:
        """Free the engine."""
        with role_world(self.world):
            self.engine.shutdown()
