"""The one memory model of a colocated PPO/GRPO placement: bytes per role per GPU, per phase, fit.

Both the ``--dry-run`` (parameter counts measured from meta-device Megatron models of every
pipeline stage, weight-sync figures from the real reshard plan) and ``tools/plan.py`` (counts from
:func:`formula_stage_params`, sync from :func:`formula_sync`) hand their counts to
:func:`memory_plan`; everything after the counts is this module, once.

Per GPU, for each Megatron role on it (actor, reference, critic, reward model, on-policy
distillation's teacher; every role is colocated on every rank, as ``PPOTrainer`` places them by
default, except a teacher that ``trainer.placement.teacher`` puts on ranks of its own: the other
roles and the rollout engine then own the remaining ranks):

- parameters: ``params x dtype bytes`` (bf16: 2); a frozen role (reference, reward model, teacher)
  holds these only, in its own dtype and TP/PP layout;
- gradients (trained roles): ``params x 4`` — Megatron's DDP keeps an fp32 ``main_grad`` buffer
  (``grad_reduce_in_fp32=True`` in ``verl.engine.build``);
- optimizer state (trained roles): Adam's two moments in fp32 (8 bytes per parameter) plus an
  fp32 master copy when the parameters are bf16/fp16 (4 more); SGD (no momentum) keeps only the
  master copy. The distributed optimizer divides it by the data-parallel degree (x context
  parallel: Megatron shards over DP x CP);
- a role with LoRA adapters (``lora_rank`` > 0, :func:`lora_layer_params`): the adapters add
  their elements to the parameters, and only they are trained: gradients and optimizer state
  count the adapter elements, not the base's (the reference is then that role with its adapters
  off: no second model);
- activations of one training micro-batch, with recompute on and off (see
  :func:`layer_activation_bytes`): under 1F1B pipeline stage ``i`` of ``PP`` holds
  ``min(PP - i, micro-batches)`` micro-batches in flight; full recompute keeps each layer's input
  only, plus one layer rebuilt during backward; the last stage adds the logits (bf16 output and
  the fp32 log-softmax of the vocabulary shard). Forward-only passes (log-probs, values) hold one
  layer's working set and the logits. Under context parallelism every count is of the GPU's
  ``tokens / CP`` (Transformer Engine's CP attention splits K/V too; verl's attention without TE
  gathers each layer's whole K/V and keeps unfused scores, which this model does not count:
  ``tools/bench.py cp-memory`` measures that path).

A vision-language actor and its reference on Megatron (``PlanInputs.vision``, :mod:`verl.planning.vision`):
the first pipeline stage's GPUs hold the vision tower whole (replicated over TP) in the role's dtype; the
actor's gradients and optimizer state count it unless ``freeze_vision`` (``freeze_vision_tower``); its
activations for the micro-batch's images (``images_per_sequence`` x ``patches_per_image`` each) add to the
training and forward-only working sets (a frozen tower keeps no graph: its forward working set).

An FSDP2 role (``strategy=fsdp2``, :func:`fsdp_model_params`) holds ``1/dp`` of the whole Hugging Face
model in ``fsdp_config.model_dtype``, and as much again of gradients and (Adam) twice of moments
(the shards are the master weights); while it computes, the root and two decoder layers gathered
in the compute dtype (every layer with ``reshard_after_forward=false``) count with its activations.
Its push all-gathers the whole model bucket by bucket (:func:`formula_sync`); ``param_offload``
takes its shards and gradients, ``optimizer_offload`` its optimizer state, out of the rollout phase.

The rollout engine (vLLM) on each GPU: its weights at TP' (the rollout layout's tensors), and
its memory share: vLLM allocates ``gpu_memory_utilization x GPU memory`` for weights and KV cache
whatever the batch needs, so the KV cache held is that share minus the weights; the KV cache the
rollout batch needs (sequences of one replica x (prompt + response) x layers x K and V x KV heads
on the rank x head dim) is printed next to it, with the number of waves the engine needs. The
weight sync's transient buffers (at most two buckets) and its traffic per step come from the
reshard plan (dry run) or its formula (plan.py).

Phases (what is resident at once; the peak is the largest):

- ``rollout``: the training state minus the actor's offloaded categories
  (``actor_rollout_ref.actor.megatron.{param,grad,optimizer}_offload``), the other roles' state,
  the engine's share and the push's buffers (the push reads the actor's parameters before
  ``param_offload`` moves them, so that offload does not lower this phase);
- ``<role>_update``: every role's state plus that role's training activations (the engine is
  asleep: its weights and cache are in host memory or dropped);
- ``forward``: every role's state plus the largest forward-only working set.

A fixed ``reserve_gib`` (CUDA context, NCCL buffers, allocator fragmentation) is added to every
phase. A GPU fits when its peak is within ``gpu_memory_gib`` (GiB, 2**30 bytes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from verl.models.hf_config import HFModelSpec
from verl.models.pipeline_split import PipelineSplit, resolve_split
from verl.models.weight_mapping import padded_vocab_size
from verl.planning.vision import VisionTower

__all__ = [
    "GIB",
    "MegatronRole",
    "MemoryPlan",
    "PlanInputs",
    "RankMemory",
    "lora_layer_params",
    "RoleMemory",
    "RolloutSetup",
    "StageParams",
    "SyncFigures",
    "formula_stage_params",
    "formula_sync",
    "fsdp_model_params",
    "layer_activation_bytes",
    "memory_plan",
]

GIB = 2**30
DEFAULT_RESERVE_GIB = 3.0
"""CUDA context (~0.5 GiB), NCCL communicators and buffers (~1 GiB), allocator fragmentation."""

Head = Literal["lm", "value", "reward"]


@dataclass(frozen=True, kw_only=True)
class MegatronRole:
    """One Megatron role's layout and the memory settings that matter."""

    name: str
    """actor, ref, critic, reward_model or teacher."""
    tp: int
    pp: int
    cp: int = 1
    vpp: int | None = None
    sequence_parallel: bool = False
    head: Head = "lm"
    dtype_bytes: int = 2
    trains: bool = True
    optimizer: Literal["adam", "sgd"] = "adam"
    distributed_optimizer: bool = False
    recompute: bool = False
    micro_batch: int = 1
    """Sequences per forward/backward on one GPU (training roles)."""
    micro_batches: int = 1
    """Micro-batches per optimizer step on one data-parallel rank (the 1F1B schedule's length)."""
    forward_micro_batch: int = 1
    """Sequences per forward-only pass (log-probs, values, scores) on one GPU."""
    offload_params: bool = False
    offload_grads: bool = False
    offload_optimizer: bool = False
    ep: int = 1
    """Expert-parallel degree (Mixture-of-Experts models; experts whole on their rank, expert TP 1)."""
    first_stage_layers: int | None = None
    """``num_layers_in_first_pipeline_stage``; None: uniform, or automatic where layers do not divide PP."""
    last_stage_layers: int | None = None
    """``num_layers_in_last_pipeline_stage``; None as for the first stage."""
    pipeline_layout: str | None = None
    """``pipeline_model_parallel_layout`` (Megatron's string form): every chunk's layers by hand; None: not set."""
    fsdp: bool = False
    """strategy=fsdp2 (``verl.engine.fsdp``): the whole Hugging Face model sharded over the role's ranks
    (tp = pp = cp = 1); ``dtype_bytes`` is then ``fsdp_config.model_dtype`` (the shards and the optimizer)."""
    fsdp_param_bytes: int = 2
    """strategy=fsdp2: ``fsdp_config.mixed_precision.param_dtype``, what every unit is gathered and computed in."""
    fsdp_reshard_after_forward: bool = True
    """strategy=fsdp2: ``fsdp_config.reshard_after_forward``."""
    fsdp_size: int = -1
    """strategy=fsdp2: ``fsdp_config.fsdp_size``, the ranks a parameter is sharded over (HSDP below the DP size); -1: all."""
    lora_rank: int = 0
    """``model.lora_rank``: > 0, low-rank adapters on ``lora_targets`` are the only trained elements."""
    lora_targets: tuple[str, ...] = ()
    """``model.target_modules`` resolved to HF module names (``all-linear``: all seven)."""
    ranks: tuple[int, ...] | None = None
    """The global ranks the role owns (``trainer.placement``), ascending; None: every rank."""
    freeze_vision: bool = False
    """``freeze_vision_tower``: a vision-language actor's tower takes no gradient and no optimizer state."""

    def rank_count(self, world_size: int) -> int:
        """How many ranks the role owns."""
        return world_size if self.ranks is None else len(self.ranks)

    def owns(self, rank: int) -> bool:
        """Whether global ``rank`` holds this role."""
        return self.ranks is None or rank in self.ranks

    def local_rank(self, rank: int) -> int:
        """``rank``'s index among the role's ranks."""
        return rank if self.ranks is None else self.ranks.index(rank)

    def shard_ranks(self, world_size: int) -> int:
        """strategy=fsdp2: how many ranks share one copy of the parameters (``fsdp_size``, else the DP size)."""
        return self.fsdp_size if self.fsdp_size > 0 else self.dp(world_size)

    def split(self, num_layers: int) -> PipelineSplit:
        """Which layers each pipeline stage holds (the builder's rule, ``verl.models.pipeline_split``)."""
        return resolve_split(
            num_layers, self.pp, self.vpp, self.first_stage_layers, self.last_stage_layers, self.pipeline_layout
        )

    def dp(self, world_size: int) -> int:
        """Data-parallel degree over the role's ranks (every rank of ``world_size`` unless placed)."""
        return self.rank_count(world_size) // (self.tp * self.pp * self.cp)

    def describe(self) -> str:
        """One line of the layout."""
        if self.fsdp:
            bits = ["FSDP2", f"shards {self.dtype_bytes * 8}-bit", f"compute {self.fsdp_param_bytes * 8}-bit"]
            if self.trains:
                bits.append("recompute" if self.recompute else "no-recompute")
            return " ".join(bits)
        bits = [f"TP{self.tp}", f"PP{self.pp}"]
        if self.vpp:
            bits.append(f"VPP{self.vpp}")
        if self.cp > 1:
            bits.append(f"CP{self.cp}")
        if self.ep > 1:
            bits.append(f"EP{self.ep}")
        if self.sequence_parallel:
            bits.append("SP")
        if self.trains:
            bits.append("dist-opt" if self.distributed_optimizer else "replicated-opt")
            bits.append("recompute" if self.recompute else "no-recompute")
        return " ".join(bits)


@dataclass(frozen=True, kw_only=True)
class RolloutSetup:
    """The rollout engine's layout and batch."""

    tp: int
    dtype_bytes: int = 2
    sequences: int
    """Sequences generated per step (prompts x n), over all replicas."""
    bucket_bytes: int = 512 * 2**20
    gpu_memory_utilization: float = 0.5


@dataclass(frozen=True, kw_only=True)
class PlanInputs:
    """Everything the memory model needs besides the parameter counts."""

    spec: HFModelSpec
    """The actor's (and reference's) model."""
    critic_spec: HFModelSpec | None = None
    """The critic's model; None: the actor's."""
    reward_spec: HFModelSpec | None = None
    """The reward model's model; None: the actor's."""
    teacher_spec: HFModelSpec | None = None
    """On-policy distillation's teacher's model; None: the actor's."""
    world_size: int
    gpus_per_node: int
    seq_len: int
    """prompt + response tokens of one sequence."""
    response_len: int
    """Generated tokens of one sequence (the decode steps of the step-time estimate)."""
    roles: tuple[MegatronRole, ...]
    rollout: RolloutSetup
    gpu_memory_gib: float = 80.0
    reserve_gib: float = DEFAULT_RESERVE_GIB
    vision: VisionTower | None = None
    """The actor's vision tower (a vision-language model on Megatron; the actor and the reference hold it)."""

    def role(self, name: str) -> MegatronRole | None:
        """The role called ``name``, or None when the run has none."""
        return next((r for r in self.roles if r.name == name), None)

    def spec_of(self, role: str) -> HFModelSpec:
        """The model a role runs."""
        if role == "critic" and self.critic_spec is not None:
            return self.critic_spec
        if role == "reward_model" and self.reward_spec is not None:
            return self.reward_spec
        if role == "teacher" and self.teacher_spec is not None:
            return self.teacher_spec
        return self.spec

    def rollout_ranks(self) -> tuple[int, ...]:
        """The ranks of the rollout engine and the weight sync: the actor's (the hybrid engine)."""
        actor = self.role("actor")
        return tuple(range(self.world_size)) if actor is None or actor.ranks is None else actor.ranks


@dataclass(frozen=True, kw_only=True)
class StageParams:
    """What one pipeline stage of a role holds on one GPU (all its virtual chunks together)."""

    params: int
    """Parameter elements on one GPU of this stage."""
    layers: int
    """Transformer layers on this stage."""
    pre: bool
    """Holds the embedding (first stage)."""
    post: bool
    """Holds the final norm and the head (last stage)."""
    expert_params: int = 0
    """Of ``params``, the Mixture-of-Experts experts' elements (their optimizer state shards over
    expert data parallel, not data parallel)."""


@dataclass(frozen=True, kw_only=True)
class SyncFigures:
    """The weight sync per rank: the engine's weights, the push's buffers and traffic (bytes)."""

    rollout_weight_bytes: tuple[int, ...]
    transient_bytes: tuple[int, ...]
    received_bytes: tuple[int, ...]


# -- formulas ---------------------------------------------------------------------------------


def _expert_params(spec: HFModelSpec, split: int) -> int:
    """One layer's expert elements on one GPU when the experts are spread over ``split`` GPUs."""
    return spec.num_experts * 3 * spec.hidden_size * spec.moe_intermediate_size // split if spec.is_moe else 0


def _layer_params(spec: HFModelSpec, tp: int, *, expert_split: int = 1) -> int:
    """One layer's elements on one GPU: attention over TP, a dense MLP over TP or the experts over
    ``expert_split`` (the trainer's EP: whole experts; vLLM: every expert's slice over TP')."""
    h, d, a, g, f = spec.hidden_size, spec.head_dim, spec.num_attention_heads, spec.num_kv_heads, spec.intermediate_size
    qkv = h * (a + 2 * g) * d + ((a + 2 * g) * d if spec.qkv_bias else 0)
    qk_norms = 2 * d if spec.qk_layernorm else 0  # Qwen3's per-head q/k norms, replicated
    if spec.is_moe:  # the router [experts, hidden] is replicated; a shared expert split over TP, its gate replicated
        shared = 3 * h * spec.shared_expert_intermediate_size // tp + (h if spec.has_shared_expert else 0)
        return (qkv + a * d * h) // tp + 2 * h + qk_norms + spec.num_experts * h + _expert_params(spec, expert_split) + shared
    return (qkv + a * d * h + 3 * h * f) // tp + 2 * h + qk_norms  # q/k/v, o, gate/up/down over TP; norms replicated


_LORA_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # column-parallel: B split over TP, A whole
_LORA_ROW = ("o_proj", "down_proj")  # row-parallel: A split over TP, B whole


def lora_layer_params(spec: HFModelSpec, tp: int, rank: int, targets: Sequence[str]) -> int:
    """One layer's LoRA adapter elements on one GPU: per HF module of ``targets`` with weight
    ``[out, in]``, A ``[r, in]`` and B ``[out, r]``, split the way ``verl.models.lora`` splits them
    (column-parallel q/k/v/gate/up: B's rows over TP; row-parallel o/down: A's columns)."""
    h, d, f = spec.hidden_size, spec.head_dim, spec.intermediate_size
    shapes = {
        "q_proj": (spec.num_attention_heads * d, h), "k_proj": (spec.num_kv_heads * d, h),
        "v_proj": (spec.num_kv_heads * d, h), "o_proj": (h, spec.num_attention_heads * d),
        "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f),
    }
    n = 0
    for module in targets:
        out, inp = shapes[module]
        n += rank * inp + out * rank // tp if module in _LORA_COLUMN else rank * inp // tp + out * rank
    return n


def fsdp_model_params(spec: HFModelSpec, head: Head) -> int:
    """Elements of the whole Hugging Face model an FSDP2 role shards: every layer, the embedding (the
    vocabulary unpadded), the final norm, and the LM head (once when tied) or a ``[1, hidden]`` score."""
    vocab = spec.vocab_size * spec.hidden_size
    n = spec.num_layers * _layer_params(spec, 1, expert_split=1) + vocab + spec.hidden_size
    if head != "lm":
        return n + spec.hidden_size
    return n + (0 if spec.tie_word_embeddings else vocab)


def formula_stage_params(spec: HFModelSpec, role: MegatronRole) -> list[StageParams]:
    """Parameter elements per GPU of every pipeline stage of ``role``, from the HF config alone.

    Layers split as the builder splits them (uniform, or uneven first/last stages); the vocabulary
    padded as the builder pads it (vLLM's padding); a tied LM head on a pipeline of more than one
    stage is a second copy on the last stage (Megatron); a value/reward head is one ``[1, hidden]``
    row, replicated.
    """
    if role.fsdp:  # one "stage": the whole model (sharded in the plan)
        return [StageParams(params=fsdp_model_params(spec, role.head), layers=spec.num_layers, pre=True, post=True)]
    stage_layers = role.split(spec.num_layers).stage_layers()
    vocab = padded_vocab_size(spec.vocab_size, role.tp) * spec.hidden_size // role.tp
    tied = spec.tie_word_embeddings and role.head == "lm"
    out = []
    for stage in range(role.pp):
        pre, post = stage == 0, stage == role.pp - 1
        layers = stage_layers[stage]
        n = layers * _layer_params(spec, role.tp, expert_split=role.ep)
        if pre:
            n += vocab
        if post:
            n += spec.hidden_size  # final norm
            if role.head != "lm":
                n += spec.hidden_size
            elif not tied or role.pp > 1:
                n += vocab
        out.append(StageParams(params=n, layers=layers, pre=pre, post=post,
                               expert_params=layers * _expert_params(spec, role.ep)))
    return out


def _rollout_elements(spec: HFModelSpec, tp: int) -> int:
    # vLLM's shards: every layer's matrices over TP', norms replicated, vocabulary padded.
    vocab = padded_vocab_size(spec.vocab_size, tp) * spec.hidden_size // tp
    head = 0 if spec.tie_word_embeddings else vocab
    return spec.num_layers * _layer_params(spec, tp, expert_split=tp) + vocab + head + spec.hidden_size


def formula_sync(inputs: PlanInputs) -> SyncFigures:
    """The weight sync from formulas: the engine's shard, two buckets, and the part of the shard a
    rank does not already hold (a rank holds ``1/PP`` of the layers, and of each tensor its
    ``1/TP`` training slice, which covers ``min(1, TP'/TP)`` of its ``1/TP'`` rollout slice)."""
    actor = inputs.role("actor")
    r = inputs.rollout
    weights = _rollout_elements(inputs.spec, r.tp) * r.dtype_bytes
    if actor.fsdp:
        return _fsdp_sync(inputs, weights)
    local = min(1.0, r.tp / actor.tp) / actor.pp
    received = int(weights * (1.0 - local))
    transient = 2 * min(r.bucket_bytes, max(received, 1))
    return _on_rollout_ranks(inputs, weights, transient, received)


def _on_rollout_ranks(inputs: PlanInputs, weights: int, transient: int, received: int) -> SyncFigures:
    """The same figures on every rank of the rollout engine, 0 on the ranks of a role apart."""
    on = set(inputs.rollout_ranks())

    def per_rank(value: int) -> tuple[int, ...]:
        return tuple(value if rank in on else 0 for rank in range(inputs.world_size))

    return SyncFigures(rollout_weight_bytes=per_rank(weights), transient_bytes=per_rank(transient),
                       received_bytes=per_rank(received))


def _fsdp_sync(inputs: PlanInputs, weights: int) -> SyncFigures:
    """The push from FSDP2 shards (``verl.hybrid.fsdp_sync``): every rank all-gathers the whole model,
    receiving the ``1 - 1/dp`` of it the other ranks hold (in the shards' dtype), and holds one bucket
    of whole tensors at a time (a tensor larger than a bucket is a bucket of its own)."""
    actor = inputs.role("actor")
    dp = actor.shard_ranks(inputs.world_size)  # the whole tensors are gathered over the shard group
    model = fsdp_model_params(inputs.spec, "lm")
    received = model * (dp - 1) // dp * actor.dtype_bytes
    largest = inputs.spec.vocab_size * inputs.spec.hidden_size * actor.dtype_bytes  # the embedding
    transient = max(inputs.rollout.bucket_bytes, largest)
    return _on_rollout_ranks(inputs, weights, transient, received)


def layer_activation_bytes(spec: HFModelSpec, role: MegatronRole, tokens: int) -> int:
    """Bytes one transformer layer saves for backward for ``tokens`` tokens of one GPU (bf16 here).

    Counted per saved tensor (Korthikanti et al. 2022, "Reducing Activation Recomputation in
    Large Transformer Models", redone for this architecture: no dropout masks, RMSNorm, grouped-
    query attention, SwiGLU, flash/fused attention that saves its output and not the ``s x s``
    scores): the two norms' inputs and outputs (split over TP only under sequence parallel), q/k/v
    after rotary, the attention output, gate and up outputs and their SwiGLU product (split over TP;
    a Mixture-of-Experts layer: those of each token's top-k experts, whole, routing assumed balanced).
    Megatron's local spec (no Transformer Engine: the CPU path) uses unfused attention, which also
    keeps the ``[b, heads / TP, s, s]`` softmax; that path is not what the GPU recipes run and is not
    counted here.
    """
    h, d, a, g, f = spec.hidden_size, spec.head_dim, spec.num_attention_heads, spec.num_kv_heads, spec.intermediate_size
    t = role.tp
    sp = t if role.sequence_parallel else 1
    # A dense MLP's gate, up and product split over TP; each token's top-k experts' (whole, expert TP 1).
    mlp = 3 * spec.moe_intermediate_size * spec.moe_topk + 3 * spec.shared_expert_intermediate_size / t if spec.is_moe else 3 * f / t
    per_token = 4 * h / sp + (a + 2 * g) * d / t + a * d / t + mlp
    return int(role.dtype_bytes * tokens * per_token)


def _logits_bytes(spec: HFModelSpec, role: MegatronRole, tokens: int) -> int:
    if role.head != "lm":
        return tokens * 4
    # bf16 logits of the vocabulary shard and their fp32 log-softmax.
    return tokens * padded_vocab_size(spec.vocab_size, role.tp) // role.tp * (role.dtype_bytes + 4)


# -- the plan ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RoleMemory:
    """One role on one GPU (bytes)."""

    role: str
    stage: int
    params: int
    grads: int
    optimizer: int
    activations: int
    """Training activations with the role's recompute setting (forward-only working set if frozen)."""
    activations_recompute_on: int
    activations_recompute_off: int
    forward_activations: int

    @property
    def state(self) -> int:
        """Parameters, gradients and optimizer state."""
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True, kw_only=True)
class RankMemory:
    """One GPU: every role, the engine, the phases and the peak (bytes)."""

    rank: int
    roles: dict[str, RoleMemory]
    rollout_weights: int
    kv_cache: int
    """What the engine holds for its KV cache (its memory share minus its weights)."""
    kv_cache_needed: int
    """What this replica's share of the rollout batch needs."""
    sync_transient: int
    sync_received: int
    phases: dict[str, int]
    reserve: int

    @property
    def peak(self) -> int:
        """The largest phase, reserve included."""
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    def key(self) -> tuple:
        """Ranks with the same key print as one row."""
        return (
            tuple((r.role, r.stage, r.params, r.grads, r.optimizer, r.activations) for r in self.roles.values()),
            self.rollout_weights, self.kv_cache, self.kv_cache_needed, self.sync_transient, self.sync_received,
        )


@dataclass(kw_only=True)
class MemoryPlan:
    """Per-GPU memory of a placement; ``source`` says where the counts came from."""

    inputs: PlanInputs
    source: str
    ranks: list[RankMemory]
    problems: list[str] = field(default_factory=list)
    """Why the layout cannot run at all (e.g. the engine's share does not hold its weights)."""

    @property
    def capacity(self) -> int:
        return int(self.inputs.gpu_memory_gib * GIB)

    @property
    def peak(self) -> int:
        return max(r.peak for r in self.ranks)

    @property
    def worst(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.peak)

    @property
    def fits(self) -> bool:
        return not self.problems and self.peak <= self.capacity

    @property
    def kv_waves(self) -> int:
        """Rounds the engine needs to hold the rollout batch's KV cache (1: all at once)."""
        worst = max(self.ranks, key=lambda r: r.kv_cache_needed)
        return max(1, math.ceil(worst.kv_cache_needed / worst.kv_cache)) if worst.kv_cache > 0 else 0

    def to_dict(self) -> dict:
        """JSON-ready figures (bytes) of every distinct GPU."""
        out = []
        for rank, group in _groups(self.ranks):
            out.append({
                "ranks": group,
                "roles": {name: {k: getattr(m, k) for k in ("stage", "params", "grads", "optimizer", "activations",
                                                              "activations_recompute_on", "activations_recompute_off",
                                                              "forward_activations")}
                          for name, m in rank.roles.items()},
                "rollout_weights": rank.rollout_weights,
                "kv_cache": rank.kv_cache,
                "kv_cache_needed": rank.kv_cache_needed,
                "sync_transient": rank.sync_transient,
                "sync_received": rank.sync_received,
                "phases": rank.phases,
                "peak": rank.peak,
            })
        return {"source": self.source, "world_size": self.inputs.world_size, "gpu_memory_gib": self.inputs.gpu_memory_gib,
                "fits": self.fits, "peak": self.peak, "problems": self.problems, "gpus": out}

    def table(self) -> str:
        """A readable per-GPU table: one block per distinct GPU (ranks listed), GiB."""
        inp = self.inputs
        lines = [
            f"memory plan ({self.source}): {inp.world_size} GPUs ({inp.world_size // inp.gpus_per_node} nodes x "
            f"{inp.gpus_per_node}), {inp.gpu_memory_gib:g} GiB each, {inp.seq_len} tokens per sequence, "
            f"reserve {inp.reserve_gib:g} GiB per GPU",
        ]
        for role in inp.roles:
            batches = f"micro-batch {role.micro_batch} x {role.micro_batches} per optimizer step, " if role.trains else ""
            placed = f", ranks {_ranks_text(role.ranks)}" if role.ranks is not None else ""
            lines.append(f"  {role.name:<12} {role.describe()}, DP{role.dp(inp.world_size)}{placed}, {batches}"
                         f"forward micro-batch {role.forward_micro_batch}")
        r = inp.rollout
        lines.append(f"  {'rollout':<12} TP'{r.tp}, {r.sequences} sequences per step over "
                     f"{len(inp.rollout_ranks()) // r.tp} replicas, gpu_memory_utilization {r.gpu_memory_utilization:g}")
        for rank, group in _groups(self.ranks):
            lines.append(f"GPU ranks {_ranks_text(group)}:")
            lines.append(f"  {'role':<12} {'stage':>5} {'params':>9} {'grads':>9} {'optim':>9} {'act':>9} "
                         f"{'act(rc on)':>10} {'act(rc off)':>11} {'fwd act':>9}")
            for m in rank.roles.values():
                lines.append(
                    f"  {m.role:<12} {m.stage:>5} {_g(m.params):>9} {_g(m.grads):>9} {_g(m.optimizer):>9} "
                    f"{_g(m.activations):>9} {_g(m.activations_recompute_on):>10} {_g(m.activations_recompute_off):>11} "
                    f"{_g(m.forward_activations):>9}"
                )
            if rank.rank not in inp.rollout_ranks():
                lines.append(f"  rollout: none here (the engine runs on the actor's ranks "
                             f"{_ranks_text(inp.rollout_ranks())})")
            else:
                lines.append(
                    f"  rollout: weights {_g(rank.rollout_weights)}, KV cache held {_g(rank.kv_cache)} (the batch "
                    f"needs {_g(rank.kv_cache_needed)}), sync buffers {_g(rank.sync_transient)}, sync received "
                    f"{_g(rank.sync_received)} per step"
                )
            phases = ", ".join(f"{k} {_g(v)}" for k, v in rank.phases.items())
            verdict = "fits" if rank.peak <= self.capacity else "DOES NOT FIT"
            lines.append(f"  phases (reserve included): {phases}; peak {_g(rank.peak)} in {rank.peak_phase} "
                         f"of {inp.gpu_memory_gib:g} GiB: {verdict}")
        for p in self.problems:
            lines.append(f"problem: {p}")
        lines.append(f"KV cache waves for the rollout batch: {self.kv_waves}")
        lines.append(f"verdict: {'fits' if self.fits else 'does not fit'} (peak {_g(self.peak)} GiB on rank "
                     f"{self.worst.rank} in {self.worst.peak_phase}, capacity {inp.gpu_memory_gib:g} GiB)")
        return "\n".join(lines)


def _g(n: int) -> str:
    return f"{n / GIB:.2f}"


def _ranks_text(ranks: Sequence[int]) -> str:
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"{ranks[0]}-{ranks[-1]}"
    if len(ranks) > 8:
        return ",".join(map(str, ranks[:8])) + f",... ({len(ranks)} GPUs)"
    return ",".join(map(str, ranks))


def _groups(ranks: list[RankMemory]) -> list[tuple[RankMemory, list[int]]]:
    seen: dict[tuple, tuple[RankMemory, list[int]]] = {}
    for r in ranks:
        seen.setdefault(r.key(), (r, []))[1].append(r.rank)
    return list(seen.values())


def _fsdp_state(inputs: PlanInputs, role: MegatronRole, counts: StageParams) -> tuple[int, int, int, int]:
    """An FSDP2 role's (params, grads, optimizer, gathered) bytes on one GPU: ``1/dp`` of the model's
    elements (rounded up) in ``dtype_bytes`` for the shards, their gradients and Adam's two moments
    (no master copy: the shards are the master weights; SGD keeps none); ``gathered``: whole units in
    the compute dtype while the role computes -- the root (embedding, final norm, head: FSDP2 keeps the
    root gathered through forward and backward) and two decoder layers (the running one and the one
    prefetched), or every layer with ``reshard_after_forward=false``."""
    spec = inputs.spec_of(role.name)
    shard = math.ceil(counts.params / role.shard_ranks(inputs.world_size))
    params = shard * role.dtype_bytes
    grads = shard * role.dtype_bytes if role.trains else 0
    optimizer = shard * 2 * role.dtype_bytes if role.trains and role.optimizer == "adam" else 0
    layer = _layer_params(spec, 1, expert_split=1)
    root = counts.params - spec.num_layers * layer
    units = min(2, spec.num_layers) if role.fsdp_reshard_after_forward else spec.num_layers
    return params, grads, optimizer, (root + units * layer) * role.fsdp_param_bytes


def _role_memory(inputs: PlanInputs, role: MegatronRole, stage: int, counts: StageParams) -> RoleMemory:
    spec = inputs.spec_of(role.name)
    params = counts.params * role.dtype_bytes
    grads = optimizer = gathered = 0
    if role.fsdp:
        params, grads, optimizer, gathered = _fsdp_state(inputs, role, counts)
        role = replace(role, dtype_bytes=role.fsdp_param_bytes)  # activations in the compute dtype
    elif role.lora_rank > 0:  # the adapters (in the base's dtype) are the only trained elements
        adapters = counts.layers * lora_layer_params(spec, role.tp, role.lora_rank, role.lora_targets)
        trained = adapters + (spec.hidden_size if role.head != "lm" and counts.post else 0)  # a value head trains too
        params += adapters * role.dtype_bytes
        if role.trains:
            grads = trained * 4
            per = (4 if role.dtype_bytes < 4 else 0) + (8 if role.optimizer == "adam" else 0)
            shard = role.dp(inputs.world_size) * role.cp if role.distributed_optimizer else 1
            optimizer = math.ceil(trained * per / shard)
    elif role.trains:
        grads = counts.params * 4
        per = (4 if role.dtype_bytes < 4 else 0) + (8 if role.optimizer == "adam" else 0)
        shard = role.dp(inputs.world_size) * role.cp if role.distributed_optimizer else 1
        # Experts shard over expert data parallel: the ranks of a stage that hold the same experts.
        expert_shard = role.rank_count(inputs.world_size) // (role.pp * role.ep) if role.distributed_optimizer else 1
        dense = counts.params - counts.expert_params
        optimizer = math.ceil(dense * per / shard) + math.ceil(counts.expert_params * per / expert_shard)
    tokens = role.micro_batch * inputs.seq_len // role.cp
    layer = layer_activation_bytes(spec, role, tokens)
    in_flight = min(role.pp - stage, max(1, role.micro_batches))
    logits = _logits_bytes(spec, role, tokens) if counts.post else 0
    off = in_flight * counts.layers * layer + logits
    layer_input = int(role.dtype_bytes * tokens * spec.hidden_size / (role.tp if role.sequence_parallel else 1))
    inputs_only = in_flight * counts.layers * layer_input
    on = inputs_only + layer + logits
    f_tokens = role.forward_micro_batch * inputs.seq_len // role.cp
    forward = layer_activation_bytes(spec, role, f_tokens) + (_logits_bytes(spec, role, f_tokens) if counts.post else 0)
    on, off, forward = on + gathered, off + gathered, forward + gathered
    tower = inputs.vision if role.name in ("actor", "ref") and not role.fsdp and counts.pre else None
    if tower is not None:  # whole on every TP rank of the first stage, in the role's dtype (verl.planning.vision)
        trained = role.trains and not role.freeze_vision
        params += tower.params * role.dtype_bytes
        if trained:
            grads += tower.params * 4
            per = (4 if role.dtype_bytes < 4 else 0) + (8 if role.optimizer == "adam" else 0)
            shard = role.dp(inputs.world_size) * role.cp if role.distributed_optimizer else 1
            optimizer += math.ceil(tower.params * per / shard)
        images = role.micro_batch * tower.images_per_sequence
        seen = in_flight * tower.activation_bytes(images, role.dtype_bytes, trains=trained)
        on, off = on + seen, off + seen
        forward += tower.activation_bytes(role.forward_micro_batch * tower.images_per_sequence, role.dtype_bytes,
                                          trains=False)
    act = (on if role.recompute else off) if role.trains else forward
    return RoleMemory(
        role=role.name, stage=stage, params=params, grads=grads, optimizer=optimizer, activations=act,
        activations_recompute_on=on if role.trains else 0, activations_recompute_off=off if role.trains else 0,
        forward_activations=forward,
    )


def memory_plan(
    inputs: PlanInputs, stages: Mapping[str, Sequence[StageParams]], sync: SyncFigures, *, source: str
) -> MemoryPlan:
    """Per-GPU memory of ``inputs`` from per-stage parameter counts and the weight sync's figures."""
    world = inputs.world_size
    capacity = int(inputs.gpu_memory_gib * GIB)
    reserve = int(inputs.reserve_gib * GIB)
    r = inputs.rollout
    spec = inputs.spec
    engine_ranks = set(inputs.rollout_ranks())
    replicas = len(engine_ranks) // r.tp
    per_replica = math.ceil(r.sequences / replicas)
    kv_heads = max(1, spec.num_kv_heads // r.tp)
    kv_needed = per_replica * inputs.seq_len * spec.num_layers * 2 * kv_heads * spec.head_dim * r.dtype_bytes
    problems = []
    ranks = []
    for rank in range(world):
        roles = {}
        for role in inputs.roles:
            if not role.owns(rank):  # a role apart (trainer.placement)
                continue
            # Megatron's rank order (verl.parallel.topology): tp fastest, then cp, dp, pp.
            stage = role.local_rank(rank) // (role.tp * role.cp * role.dp(world))
            roles[role.name] = _role_memory(inputs, role, stage, stages[role.name][stage])
        engine = rank in engine_ranks
        weights = sync.rollout_weight_bytes[rank]
        share = int(r.gpu_memory_utilization * capacity) if engine else 0
        kv = max(0, share - weights)
        if engine and kv == 0 and not problems:
            problems.append(
                f"actor_rollout_ref.rollout.gpu_memory_utilization={r.gpu_memory_utilization:g} gives the engine "
                f"{_g(share)} GiB, not more than its weights ({_g(weights)} GiB at TP'{r.tp}); raise it or TP'"
            )
        state_all = sum(m.state for m in roles.values())
        actor = roles.get("actor")
        kept = state_all
        if actor is not None:
            a = inputs.role("actor")
            kept -= (actor.grads if a.offload_grads else 0) + (actor.optimizer if a.offload_optimizer else 0)
            # FSDP2's push moves each offloaded shard to the device as it gathers it: the shards stay on the host.
            kept -= actor.params if a.fsdp and a.offload_params else 0
        # On the ranks of a role apart the rollout phase is its idle state.
        phases = {"rollout": kept + weights + kv + sync.transient_bytes[rank] + reserve}
        for role in inputs.roles:
            if role.trains and role.name in roles:
                phases[f"{role.name}_update"] = state_all + roles[role.name].activations + reserve
        phases["forward"] = state_all + max(m.forward_activations for m in roles.values()) + reserve
        ranks.append(RankMemory(
            rank=rank, roles=roles, rollout_weights=weights, kv_cache=kv, kv_cache_needed=kv_needed if engine else 0,
            sync_transient=sync.transient_bytes[rank], sync_received=sync.received_bytes[rank], phases=phases,
            reserve=reserve,
        ))
    return MemoryPlan(inputs=inputs, source=source, ranks=ranks, problems=problems)
