"""Step-time estimate of a placement, and the search for layouts that fit (formula plans, ranked).

The estimate is arithmetic over stated figures (:mod:`verl.planning.hardware`) and these
assumptions, not a measurement:

- every sequence runs to prompt + response tokens (an upper bound for the rollout and training);
- training and prefill run at ``MFU`` of the peak bf16 throughput; a training pass costs 6 FLOPs
  per parameter per token (forward 2, backward 4), 8 with full recompute, a forward-only pass 2;
  the 1F1B pipeline bubble adds ``(PP - 1) / micro-batches`` of the training time;
- decoding is bound by memory bandwidth: every token step of a replica reads its weight shard and
  its KV cache once, at ``HBM_EFFICIENCY`` of the peak bandwidth, in as many waves as the KV cache
  needs to hold the batch;
- the weight sync moves the largest rank's received bytes at the inter-node bandwidth;
- context parallelism (CP > 1) exchanges every layer's keys and values over the CP group: each rank
  receives the other ranks' ``(CP - 1) / CP`` of a sequence's K/V per layer and pass (forward, backward,
  and the forward again under recompute), over NVLink when a TP x CP group fits in a node, else at the
  inter-node bandwidth (the all-gather of verl's attention without Transformer Engine; a ring moves
  the same bytes).

The layout search varies CP for the actor, its reference and the critic (``CP_ROLES``) together:
each sequence is split over CP GPUs, so every per-token activation shrinks by CP at the price of
that exchange and of data parallelism (``world / (TP x PP x CP)``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from verl.planning.hardware import GPUPreset
from verl.planning.memory import MegatronRole, MemoryPlan, PlanInputs, formula_stage_params, formula_sync, memory_plan

__all__ = [
    "CP_ROLES", "HBM_EFFICIENCY", "MAX_CP", "MFU", "Candidate", "CPSuggestion", "context_parallel_suggestion",
    "estimate_step_seconds", "grow_cluster", "search_layouts", "suggestion_overrides",
]

MFU = 0.40
"""Model-FLOPs utilisation assumed for training and prefill (Megatron-core dense models commonly
report 40-50% on H100 clusters; the lower end, as RL steps mix in short passes)."""
HBM_EFFICIENCY = 0.60
"""Fraction of peak memory bandwidth a decode step reaches (small-batch GEMV-like kernels)."""
CP_ROLES = ("actor", "ref", "critic")
"""The roles whose context-parallel degree the search and the CP suggestion set (together: the
reference and the critic run the actor's sequences)."""
MAX_CP = 8
"""The largest context-parallel degree tried."""


def _params_total(inputs: PlanInputs, role: str) -> int:
    head = inputs.role(role).head if inputs.role(role) is not None else "lm"
    whole = MegatronRole(name=role, tp=1, pp=1, head=head)
    return sum(s.params for s in formula_stage_params(inputs.spec_of(role), whole))


def estimate_step_seconds(plan: MemoryPlan, gpu: GPUPreset) -> dict[str, float]:
    """Seconds per RL step by phase (rollout, sync, forward, training) and in total (see module docstring)."""
    inp = plan.inputs
    world = inp.world_size
    flops = gpu.bf16_tflops * 1e12 * MFU * world
    tokens = inp.rollout.sequences * inp.seq_len
    train = forward = 0.0
    for role in inp.roles:
        n = _params_total(inp, role.name)
        forward += 2 * n * tokens / flops
        if role.trains:
            per = 8 if role.recompute else 6
            bubble = (role.pp - 1) / max(1, role.micro_batches)
            train += per * n * tokens / flops * (1 + bubble)
    forward += 2 * _params_total(inp, "actor") * tokens / flops  # old log-probs of the actor
    worst = plan.worst
    r = inp.rollout
    replicas = len(inp.rollout_ranks()) // r.tp
    response = inp.response_len
    per_replica = math.ceil(r.sequences / replicas)
    waves = max(1, plan.kv_waves)
    kv_read = worst.kv_cache_needed / waves
    bw = gpu.hbm_tb_s * 1e12 * HBM_EFFICIENCY
    decode = waves * response * (worst.rollout_weights + kv_read / 2) / bw
    prefill_flops = 2 * _params_total(inp, "actor") * per_replica * (inp.seq_len - response)
    prefill = prefill_flops / (gpu.bf16_tflops * 1e12 * MFU * r.tp)
    sync = max(x.sync_received for x in plan.ranks) / (gpu.internode_gb_s * 1e9)
    out = {"rollout": decode + prefill, "weight_sync": sync, "forward": forward, "train": train,
           "context_parallel": _cp_exchange_seconds(inp, gpu)}
    out["total"] = sum(out.values())
    return out


def _cp_exchange_seconds(inp: PlanInputs, gpu: GPUPreset) -> float:
    """Seconds per step one GPU spends receiving the other CP ranks' keys and values (module docstring)."""
    seconds = 0.0
    for role in inp.roles:
        if role.cp == 1 or role.fsdp:
            continue
        spec = inp.spec_of(role.name)
        passes = (3 if role.recompute else 2) if role.trains else 0
        passes += 1  # the forward-only pass: old log-probs, the reference's log-probs, the values
        sequences = inp.rollout.sequences / role.dp(inp.world_size)  # of every pipeline stage of this DP rank
        layers = math.ceil(spec.num_layers / role.pp)
        kv = 2 * max(1, spec.num_kv_heads // role.tp) * spec.head_dim * role.dtype_bytes
        received = passes * sequences * inp.seq_len * (role.cp - 1) / role.cp * layers * kv
        bw = gpu.nvlink_gb_s if role.tp * role.cp <= inp.gpus_per_node else gpu.internode_gb_s
        seconds += received / (bw * 1e9)
    return seconds


@dataclass(frozen=True)
class Candidate:
    """A layout that was tried, with its formula plan and time."""

    inputs: PlanInputs
    plan: MemoryPlan
    seconds: float

    def describe(self) -> str:
        a = self.inputs.role("actor")
        offl = [k for k, v in (("params", a.offload_params and a.fsdp), ("grads", a.offload_grads),
                               ("optimizer", a.offload_optimizer)) if v]
        cp = f" CP{a.cp}" if a.cp > 1 else ""
        return (f"{'FSDP2' if a.fsdp else f'TP{a.tp} PP{a.pp}{cp}'}{' SP' if a.sequence_parallel else ''} TP'{self.inputs.rollout.tp}"
                f"{' recompute' if a.recompute else ''}{' dist-opt' if a.distributed_optimizer else ''}"
                f"{' offload ' + '+'.join(offl) if offl else ''}: peak {self.plan.peak / 2**30:.1f} GiB, "
                f"~{self.seconds:.0f} s/step")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _variant(
    inputs: PlanInputs, *, world: int, tp: int, pp: int, rollout_tp: int, recompute: bool, offload: bool,
    cp: int | None = None,
) -> PlanInputs:
    """``inputs`` at another layout; ``cp`` None keeps every role's CP, else sets that of :data:`CP_ROLES`."""
    roles = []
    for r in inputs.roles:
        mini = r.micro_batch * r.micro_batches * r.dp(inputs.world_size)  # sequences per optimizer step, kept
        if r.fsdp:  # FSDP2 keeps its layout (every GPU's shard); recompute and the actor's offload are tried
            changes = dict(recompute=recompute, micro_batches=max(1, mini // world // r.micro_batch)) if r.trains else {}
            if r.name == "actor":
                changes.update(offload_params=offload, offload_grads=offload, offload_optimizer=offload)
            roles.append(dataclasses.replace(r, **changes))
            continue
        role_cp = cp if cp is not None and r.name in CP_ROLES else r.cp
        dp = world // (tp * pp * role_cp)
        changes = dict(tp=tp, pp=pp, cp=role_cp, vpp=None, sequence_parallel=tp > 1)
        if pp != r.pp:  # a hand-set uneven split was for the old pipeline: the builder's automatic one
            changes.update(first_stage_layers=None, last_stage_layers=None)
        if pp != r.pp or r.vpp:  # an explicit layout names every chunk of the old pipeline (and its VPP)
            changes.update(pipeline_layout=None)
        if r.trains:
            changes.update(recompute=recompute, distributed_optimizer=True,
                           micro_batches=max(1, mini // max(1, dp) // r.micro_batch))
            if r.name == "actor":
                changes.update(offload_grads=offload, offload_optimizer=offload)
        roles.append(dataclasses.replace(r, **changes))
    return dataclasses.replace(inputs, world_size=world, roles=tuple(roles),
                               rollout=dataclasses.replace(inputs.rollout, tp=rollout_tp))


def _layout_problems(inputs: PlanInputs, r, *, world: int, tp: int, pp: int, cp: int = 1) -> list[str]:
    """Why role ``r`` cannot take TP x PP (x CP for :data:`CP_ROLES`) on ``world`` GPUs (its EP and, at its
    own PP, its stage split kept)."""
    from verl.models.builder import split_problems

    if r.fsdp:
        return [] if cp == 1 else ["context parallel is Megatron's"]  # FSDP2 keeps its layout
    cp = cp if r.name in CP_ROLES else r.cp
    if world % (tp * pp * cp):
        return [f"TP {tp} x PP {pp} x CP {cp} does not divide {world} GPUs"]
    problems = split_problems(
        inputs.spec_of(r.name), tp_size=tp, pp_size=pp, cp_size=cp, ep_size=r.ep,
        first_stage_layers=r.first_stage_layers if pp == r.pp else None,
        last_stage_layers=r.last_stage_layers if pp == r.pp else None,
        pipeline_layout=r.pipeline_layout if pp == r.pp and not r.vpp else None,
    )
    if (world // pp) % r.ep:
        problems.append(f"expert parallel {r.ep} does not divide the {world // pp} GPUs of a pipeline stage")
    return problems


def search_layouts(inputs: PlanInputs, gpu: GPUPreset, *, limit: int = 5, nodes: int | None = None) -> list[Candidate]:
    """Layouts that fit on ``nodes`` nodes (default: the inputs' cluster), fastest first (formula
    plans): every Megatron role on one TP x PP, TP and TP' within a node, CP of :data:`CP_ROLES` up to
    :data:`MAX_CP`, the distributed optimizer, recompute and the actor's grad/optimizer offload tried both
    ways; the sequences per optimizer step are kept. Colocated roles only: none when a role is placed apart (``trainer.placement``)."""
    from verl.hybrid.layout import check_rollout_degrees

    if any(r.ranks is not None for r in inputs.roles):
        return []

    node = inputs.gpus_per_node
    world = node * nodes if nodes is not None else inputs.world_size
    found = []
    for tp in _divisors(node):
        for pp, cp in ((pp, cp) for pp in _divisors(world // tp) for cp in _divisors(world // (tp * pp)) if cp <= MAX_CP):
            if any(_layout_problems(inputs, r, world=world, tp=tp, pp=pp, cp=cp) for r in inputs.roles):
                continue
            for rollout_tp in _divisors(node):
                if world % rollout_tp or check_rollout_degrees(inputs.spec, rollout_tp):
                    continue
                for recompute in (False, True):
                    for offload in (False, True):
                        v = _variant(inputs, world=world, tp=tp, pp=pp, rollout_tp=rollout_tp, recompute=recompute,
                                     offload=offload, cp=cp)
                        plan = memory_plan(v, {r.name: formula_stage_params(v.spec_of(r.name), r) for r in v.roles},
                                           formula_sync(v), source="formulas")
                        if plan.fits and all(c.inputs != v for c in found):  # an FSDP2 run: the same for every TP x PP
                            found.append(Candidate(v, plan, estimate_step_seconds(plan, gpu)["total"]))
    found.sort(key=lambda c: (c.seconds, c.plan.peak))
    return found[:limit]


def grow_cluster(inputs: PlanInputs, gpu: GPUPreset, *, limit: int = 5, max_factor: int = 8) -> tuple[int, list[Candidate]]:
    """The fewest nodes (the cluster doubled, up to ``max_factor`` times) on which some layout fits,
    and those layouts; (0, []) when none does."""
    nodes = inputs.world_size // inputs.gpus_per_node
    factor = 2
    while factor <= max_factor:
        found = search_layouts(inputs, gpu, limit=limit, nodes=nodes * factor)
        if found:
            return nodes * factor, found
        factor *= 2
    return 0, []


def suggestion_overrides(candidate: Candidate) -> list[str]:
    """The main_ppo overrides that select ``candidate``'s layout (and its node count)."""
    out = [f"trainer.nnodes={candidate.inputs.world_size // candidate.inputs.gpus_per_node}"]
    for r in candidate.inputs.roles:
        prefix = {"actor": "actor_rollout_ref.actor", "ref": "actor_rollout_ref.ref", "critic": "critic",
                  "reward_model": "reward_model", "teacher": "distillation.teacher_model"}[r.name]
        if not r.fsdp:  # an FSDP2 role keeps its layout
            out += [f"{prefix}.megatron.tensor_model_parallel_size={r.tp}",
                    f"{prefix}.megatron.pipeline_model_parallel_size={r.pp}",
                    f"{prefix}.megatron.context_parallel_size={r.cp}",
                    f"{prefix}.megatron.sequence_parallel={str(r.sequence_parallel).lower()}"]
            if r.trains:
                out.append(f"{prefix}.megatron.use_distributed_optimizer=true")
        if r.name == "actor":
            out.append(f"actor_rollout_ref.model.enable_gradient_checkpointing={str(r.recompute).lower()}")
            if r.fsdp:
                out += [f"{prefix}.fsdp_config.param_offload={str(r.offload_params).lower()}",
                        f"{prefix}.fsdp_config.optimizer_offload={str(r.offload_optimizer).lower()}"]
            else:
                out += [f"{prefix}.megatron.grad_offload={str(r.offload_grads).lower()}",
                        f"{prefix}.megatron.optimizer_offload={str(r.offload_optimizer).lower()}"]
        if r.name == "critic":
            out.append(f"critic.model.enable_gradient_checkpointing={str(r.recompute).lower()}")
    out.append(f"actor_rollout_ref.rollout.tensor_model_parallel_size={candidate.inputs.rollout.tp}")
    return out


@dataclass(frozen=True)
class CPSuggestion:
    """The same layout with the sequences split over ``cp`` GPUs (:data:`CP_ROLES`), and what it frees."""

    cp: int
    plan: MemoryPlan
    before: MemoryPlan

    def _activations(self, plan: MemoryPlan) -> int:
        """The largest activations of a role of :data:`CP_ROLES` on one GPU (training, or forward-only)."""
        return max(max(m.activations, m.forward_activations) for r in plan.ranks for m in r.roles.values()
                   if m.role in CP_ROLES)

    @property
    def freed(self) -> int:
        """Bytes of the worst GPU's peak that CP frees."""
        return self.before.peak - self.plan.peak

    def overrides(self) -> list[str]:
        """The dotted overrides that set it."""
        prefix = {"actor": "actor_rollout_ref.actor", "ref": "actor_rollout_ref.ref", "critic": "critic"}
        return [f"{prefix[r.name]}.megatron.context_parallel_size={self.cp}"
                for r in self.plan.inputs.roles if r.name in CP_ROLES and not r.fsdp]

    def describe(self) -> str:
        """One paragraph for the report."""
        inp = self.plan.inputs
        actor = inp.role("actor")
        g = 2**30
        return (
            f"context parallelism: {' '.join(self.overrides())} splits each {inp.seq_len}-token sequence over "
            f"{self.cp} GPUs (TP{actor.tp} x PP{actor.pp} x CP{self.cp}, DP{actor.dp(inp.world_size)}): activations "
            f"per GPU {self._activations(self.before) / g:.1f} -> {self._activations(self.plan) / g:.1f} GiB, "
            f"peak {self.before.peak / g:.1f} -> {self.plan.peak / g:.1f} GiB (frees {self.freed / g:.1f} GiB): "
            f"{'fits' if self.plan.fits else 'still does not fit'} in {inp.gpu_memory_gib:g} GiB"
        )


def context_parallel_suggestion(plan: MemoryPlan) -> CPSuggestion | None:
    """The smallest CP (above the actor's, up to :data:`MAX_CP`) at which ``plan``'s layout fits when only
    the CP of :data:`CP_ROLES` changes (TP, PP, recompute and offload kept; DP shrinks, the sequences per
    optimizer step are kept); None when activations are not what exceeds the GPU (no CP fits), the
    actor is not Megatron's, a role is placed apart, or the model cannot be split (a Mixture-of-Experts
    model). Formula counts, as the layout search."""
    inputs = plan.inputs
    actor = inputs.role("actor")
    if actor is None or actor.fsdp or any(r.ranks is not None for r in inputs.roles):
        return None
    world = inputs.world_size
    cp = actor.cp * 2
    while cp <= MAX_CP and world % (actor.tp * actor.pp * cp) == 0:
        if any(_layout_problems(inputs, r, world=world, tp=r.tp, pp=r.pp, cp=cp) for r in inputs.roles
               if r.name in CP_ROLES):
            return None
        roles = []
        for r in inputs.roles:
            if r.name in CP_ROLES and not r.fsdp:
                mini = r.micro_batch * r.micro_batches * r.dp(world)  # sequences per optimizer step, kept
                dp = max(1, world // (r.tp * r.pp * cp))
                r = dataclasses.replace(r, cp=cp, micro_batches=max(1, mini // dp // r.micro_batch) if r.trains else r.micro_batches)
            roles.append(r)
        v = dataclasses.replace(inputs, roles=tuple(roles))
        found = memory_plan(v, {r.name: formula_stage_params(v.spec_of(r.name), r) for r in v.roles}, formula_sync(v),
                            source="formulas")
        if found.fits:
            before = memory_plan(inputs, {r.name: formula_stage_params(inputs.spec_of(r.name), r) for r in inputs.roles},
                                 formula_sync(inputs), source="formulas")
            return CPSuggestion(cp=cp, plan=found, before=before)
        cp *= 2
    return None
