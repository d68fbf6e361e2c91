"""``--dry-run``: the full-size placement built on one CPU process, measured, and planned.

For a representative rank of every pipeline stage of every Megatron role, this process joins a
simulated world of the cluster's size (torch.distributed's ``fake`` backend: collectives are
no-ops, no peers exist), builds the real :class:`~verl.parallel.topology.Topology` and its process
groups, and builds that rank's Megatron model chunks with the real builder on the meta device
(shapes, no storage). The parameter counts measured from those modules, and the weight sync's
figures from the real reshard plan (:func:`verl.hybrid.plan.cluster_layouts` and
:func:`~verl.hybrid.plan.build_plan`), go into the one memory model (:mod:`verl.planning.memory`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import torch.distributed as dist

from verl.models.hf_config import HFModelSpec
from verl.planning.memory import (
    MemoryPlan,
    PlanInputs,
    StageParams,
    SyncFigures,
    formula_stage_params,
    formula_sync,
    memory_plan,
)

__all__ = ["measure_stage_params", "measure_sync", "dry_run_plan"]

logger = logging.getLogger(__name__)

_DTYPES = {2: "bf16", 4: "fp32"}


def _topology(inputs: PlanInputs):
    from verl.parallel.topology import RoleLayout, Topology

    every = tuple(range(inputs.world_size))
    roles = {
        r.name: RoleLayout(ranks=every if r.ranks is None else r.ranks, tensor_parallel=r.tp, pipeline_parallel=r.pp,
                           context_parallel=r.cp, expert_parallel=r.ep)
        for r in inputs.roles
    }
    roles["rollout"] = RoleLayout(ranks=inputs.rollout_ranks(), tensor_parallel=inputs.rollout.tp)
    return Topology(world_size=inputs.world_size, roles=roles)


def measure_stage_params(inputs: PlanInputs) -> dict[str, list[StageParams]]:
    """Per role, per pipeline stage: parameter elements of one GPU's meta-device model chunks.

    One simulated rank per (role, stage) not yet measured: its TP rank 0 (every TP rank of a stage
    holds the same count: the vocabulary is padded to a multiple of TP). Roles with the same model,
    head and layout (the actor and its reference) share one build per stage.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from verl.models.builder import ModelBuildConfig, build_model_chunks
    from verl.parallel import megatron_state
    from verl.parallel.bootstrap import init_distributed

    if dist.is_initialized():
        raise RuntimeError("dry run: torch.distributed is already initialised in this process; run it alone")
    topo = _topology(inputs)
    # An FSDP2 role holds the Hugging Face model itself, not Megatron chunks: its count is the formula's.
    todo = {(r.name, s) for r in inputs.roles if not r.fsdp for s in range(r.pp)}
    found: dict[str, dict[int, StageParams]] = {
        r.name: dict(enumerate(formula_stage_params(inputs.spec_of(r.name), r))) if r.fsdp else {} for r in inputs.roles
    }
    built: dict[tuple, StageParams] = {}
    start = time.perf_counter()
    for rank in range(inputs.world_size):
        here = {(r.name, topo.coords(r.name, rank).pp) for r in inputs.roles
                if r.owns(rank) and topo.coords(r.name, rank).tp == 0} & todo
        if not here:
            continue
        init_distributed(backend="fake", store=FakeStore(), rank=rank, world_size=inputs.world_size)
        try:
            groups = topo.build_groups()
            for role in inputs.roles:
                if not role.owns(rank):
                    continue
                stage = topo.coords(role.name, rank).pp
                if (role.name, stage) not in here:
                    continue
                spec = inputs.spec_of(role.name)
                key = (spec, role.head, role.tp, role.pp, role.cp, role.vpp, role.dtype_bytes, stage,
                       role.first_stage_layers, role.last_stage_layers, role.pipeline_layout, role.ep)
                if key not in built:
                    pg = groups[role.name].pg_collection
                    megatron_state.initialize_role(pg)
                    build = ModelBuildConfig(
                        dtype=_DTYPES[role.dtype_bytes], head=role.head, sequence_parallel=role.sequence_parallel,
                        transformer_impl="local", meta_device=True, recompute_activations=role.recompute,
                        num_layers_in_first_pipeline_stage=role.first_stage_layers,
                        num_layers_in_last_pipeline_stage=role.last_stage_layers,
                        pipeline_model_parallel_layout=role.pipeline_layout,
                    )
                    with megatron_state.activate_role(pg):  # a role apart builds in its own world
                        chunks = build_model_chunks(spec, build, pg, vpp_size=role.vpp)
                    built[key] = StageParams(
                        params=sum(p.numel() for c in chunks for p in c.parameters()),
                        layers=sum(len(c.decoder.layers) for c in chunks),
                        pre=any(c.pre_process for c in chunks),
                        post=any(c.post_process for c in chunks),
                        expert_params=sum(p.numel() for c in chunks for n, p in c.named_parameters()
                                          if ".mlp.experts." in n),
                    )
                    megatron_state.destroy_model_parallel()
                found[role.name][stage] = built[key]
                todo.discard((role.name, stage))
        finally:
            megatron_state.destroy_model_parallel()
            dist.destroy_process_group()
        if not todo:
            break
    logger.info("dry run: built %d meta-device stages in %.1f s", len(built),
                time.perf_counter() - start)
    return {name: [stages[s] for s in sorted(stages)] for name, stages in found.items()}


def measure_sync(inputs: PlanInputs) -> SyncFigures:
    """The weight sync's figures from the real reshard plan of this cluster (actor -> vLLM layout),
    on the actor's ranks (0 on the ranks of a role apart)."""
    from verl.hybrid.plan import build_plan, cluster_layouts

    actor, r = inputs.role("actor"), inputs.rollout
    if actor.fsdp:  # FSDP2's push gathers whole tensors: no reshard plan (verl.hybrid.fsdp_sync)
        return formula_sync(inputs)
    engine_ranks = inputs.rollout_ranks()
    sources, dests = cluster_layouts(
        inputs.spec, world_size=len(engine_ranks), train_tp=actor.tp, train_pp=actor.pp, train_vpp=actor.vpp,
        # MoE: vLLM's fused experts (w13/w2) hold the same rows of every expert over TP' as the
        # per-expert HF shards, so the plan's figures are the same; verl's push into them is not built.
        train_ep=actor.ep, rollout_tp=r.tp, destination="hf-shards" if inputs.spec.is_moe else "vllm",
    )
    plan = build_plan(sources, dests)
    elem = r.dtype_bytes
    weights, transient, received = [0] * inputs.world_size, [0] * inputs.world_size, [0] * inputs.world_size
    for local, rank in enumerate(engine_ranks):  # the plan numbers the engine's ranks from 0
        weights[rank] = sum(box.numel for box in dests[local].boxes) * elem
        transient[rank] = plan.peak_extra_bound(local, elem, r.bucket_bytes)
        received[rank] = plan.rank_stats(local).received_elements * elem
    return SyncFigures(rollout_weight_bytes=tuple(weights), transient_bytes=tuple(transient),
                       received_bytes=tuple(received))


def dry_run_plan(inputs: PlanInputs, *, stages: Mapping[str, list[StageParams]] | None = None) -> MemoryPlan:
    """The memory plan of ``inputs`` from meta-device models and the real reshard plan."""
    return memory_plan(
        inputs, stages if stages is not None else measure_stage_params(inputs), measure_sync(inputs),
        source="dry run: meta-device Megatron models on a simulated world, the real reshard plan",
    )


def check_inputs(inputs: PlanInputs, spec: HFModelSpec) -> list[str]:
    """Why the layout cannot be built at all (the builder's split rules), per role."""
    from verl.hybrid.layout import check_rollout_degrees
    from verl.models.builder import split_problems

    problems = []
    for r in inputs.roles:
        for p in split_problems(inputs.spec_of(r.name), tp_size=r.tp, pp_size=r.pp, cp_size=r.cp, vpp_size=r.vpp,
                                ep_size=r.ep, first_stage_layers=r.first_stage_layers,
                                last_stage_layers=r.last_stage_layers, pipeline_layout=r.pipeline_layout):
            problems.append(f"{r.name}: {p}")
    for p in check_rollout_degrees(spec, inputs.rollout.tp):
        problems.append(f"rollout: {p}")
    return problems
