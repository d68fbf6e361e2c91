"""Where every Hugging Face weight element lives, on a training rank and on a rollout rank.

The resharding plan (:mod:`verl.hybrid.plan`) works in one coordinate system, the Hugging Face
tensors: each is a 2-D array ``[rows, cols]`` (a 1-D tensor such as a norm weight or a bias
is ``[n, 1]``). A rank's local tensor (a Megatron parameter shard, a vLLM parameter, a
transformers parameter) is described by :class:`Box` es: rectangles of one Hugging Face tensor
and where their first element sits in the local tensor, flat, with the local row stride. The
plan intersects the boxes a rollout rank needs with the boxes the training ranks hold.

Layouts (all row-major):

- **Megatron** (:func:`megatron_layout`; ``verl.models.weight_mapping`` is the authority and
  :func:`check_megatron_layout` compares against it): q/k/v fused per GQA group
  (``[q_g; k_g; v_g]`` for each group, groups split over TP), gate/up fused per TP rank
  (``[gate_r; up_r]``), o/down projections split by columns, the vocabulary padded to
  ``padded_vocab`` and split by rows; layers spread over pipeline stages (and virtual stages:
  chunk ``v`` of stage ``p`` holds layer block ``v * PP + p``), tensor keys ``"{chunk}/{name}"``.
- **vLLM** (:func:`vllm_layout`): ``qkv_proj`` stacks ``[q of this rank's heads; k; v]`` (K/V
  heads replicated when TP' exceeds their number), ``gate_up_proj`` stacks ``[gate; up]``,
  ``o_proj``/``down_proj`` split by columns, embedding and LM head rows split after padding the
  vocabulary to a multiple of 64 (padding rows are never written), a tied LM head is the
  embedding; Qwen3's ``q_norm``/``k_norm`` are whole on every rank. Mixture-of-Experts layers are
  vLLM's fused experts (``w13_weight`` [E, 2F', H], ``w2_weight`` [E, H, F'], F' = this rank's
  share of the expert intermediate size) beside a whole router (:func:`_add_vllm_experts`).
- **Hugging Face** (:func:`hf_layout`): whole transformers tensors (the fallback engine, TP' = 1),
  or with ``tp > 1`` each tensor split the way vLLM splits it, unstacked and unpadded (a
  destination for tests and tools).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from verl.models.hf_config import HFModelSpec
from verl.models.lora import is_adapter_param
from verl.models.pipeline_split import PipelineSplit, resolve_split
from verl.models.weight_mapping import (
    HF_EMBED,
    HF_FINAL_NORM,
    HF_LM_HEAD,
    ROLLOUT_VOCAB_PADDING,
    MOE_HF_NAMES,
    megatron_param_names,
    moe_hf_names,
    param_mapping,
    padded_vocab_size,
    shared_expert_hf_names,
)

__all__ = [
    "VLLM_VOCAB_PADDING",
    "Box",
    "Layout",
    "box_view",
    "check_megatron_layout",
    "check_rollout_degrees",
    "fill_from_hf",
    "hf_layout",
    "hf_shape",
    "megatron_layout",
    "vllm_layout",
]

VLLM_VOCAB_PADDING = ROLLOUT_VOCAB_PADDING


@dataclass(frozen=True)
class Box:
    """Rows ``[row0, row1)`` x cols ``[col0, col1)`` of Hugging Face tensor ``hf_name``, stored in the
    local tensor ``tensor`` from flat element ``offset`` on, consecutive rows ``row_stride`` apart."""

    hf_name: str
    row0: int
    row1: int
    col0: int
    col1: int
    tensor: str
    offset: int
    row_stride: int

    @property
    def numel(self) -> int:
        """Elements in the box."""
        return (self.row1 - self.row0) * (self.col1 - self.col0)


@dataclass(frozen=True)
class Layout:
    """One rank's local tensors (key -> shape) and the boxes they are made of."""

    shapes: dict[str, tuple[int, ...]]
    boxes: tuple[Box, ...]


def box_view(box: Box, tensor: torch.Tensor) -> torch.Tensor:
    """The elements of ``box`` inside its local ``tensor`` (contiguous), as a [rows, cols] view."""
    rows = box.row1 - box.row0
    flat = tensor.view(-1)[box.offset : box.offset + (rows - 1) * box.row_stride + (box.col1 - box.col0)]
    return flat.as_strided((rows, box.col1 - box.col0), (box.row_stride, 1))


def fill_from_hf(spec: HFModelSpec, layout: Layout, tensors: Mapping[str, torch.Tensor],
                 full: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Write whole Hugging Face tensors ``full`` into the local ``tensors`` of ``layout`` (what an engine's
    loader does with a checkpoint); elements outside every box (vocabulary padding) are left as they are."""
    by_name: dict[str, list[Box]] = {}
    for box in layout.boxes:
        by_name.setdefault(box.hf_name, []).append(box)
    with torch.no_grad():
        for name, tensor in full:
            whole = tensor.reshape(hf_shape(spec, name))
            for box in by_name.get(name, []):
                box_view(box, tensors[box.tensor]).copy_(whole[box.row0 : box.row1, box.col0 : box.col1])


def hf_shape(spec: HFModelSpec, name: str) -> tuple[int, int]:
    """The 2-D shape of Hugging Face tensor ``name`` (1-D tensors are ``[n, 1]``)."""
    h, d = spec.hidden_size, spec.head_dim
    if name in (HF_EMBED, HF_LM_HEAD):
        return spec.vocab_size, h
    if spec.is_moe and name.startswith("model.layers."):
        layer = int(name.split(".")[2])
        if name == moe_hf_names(spec, layer)["router"]:
            return spec.num_experts, h
        if ".experts." in name:
            f = spec.moe_intermediate_size
            return (h, f) if name.endswith("." + MOE_HF_NAMES[spec.model_type][4] + ".weight") else (f, h)
        if spec.has_shared_expert and ".mlp.shared_expert" in name:
            shared, fs = shared_expert_hf_names(layer), spec.shared_expert_intermediate_size
            return {shared["gate"]: (fs, h), shared["up"]: (fs, h), shared["down"]: (h, fs), shared["shared_gate"]: (1, h)}[name]
    if name == HF_FINAL_NORM or name.endswith("layernorm.weight"):
        return h, 1
    suffix = name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1]
    table = {
        "q_proj.weight": (spec.num_attention_heads * d, h),
        "k_proj.weight": (spec.num_kv_heads * d, h),
        "v_proj.weight": (spec.num_kv_heads * d, h),
        "q_proj.bias": (spec.num_attention_heads * d, 1),
        "k_proj.bias": (spec.num_kv_heads * d, 1),
        "v_proj.bias": (spec.num_kv_heads * d, 1),
        "q_norm.weight": (d, 1),
        "k_norm.weight": (d, 1),
        "o_proj.weight": (h, spec.num_attention_heads * d),
        "gate_proj.weight": (spec.intermediate_size, h),
        "up_proj.weight": (spec.intermediate_size, h),
        "down_proj.weight": (h, spec.intermediate_size),
    }
    if suffix not in table:
        raise ValueError(f"hf_shape: {name!r} is not a Llama/Qwen2/Qwen3/Mistral tensor")
    return table[suffix]


def _rows(name: str, r0: int, r1: int, width: int, tensor: str, offset: int) -> Box:
    """Whole rows ``[r0, r1)`` of a ``width``-column tensor stored contiguously from ``offset``."""
    return Box(name, r0, r1, 0, width, tensor, offset, width)


def _layer_names(layer: int) -> dict[str, str]:
    p = f"model.layers.{layer}."
    return {
        "in_norm": p + "input_layernorm.weight",
        "post_norm": p + "post_attention_layernorm.weight",
        "q": p + "self_attn.q_proj",
        "k": p + "self_attn.k_proj",
        "v": p + "self_attn.v_proj",
        "q_norm": p + "self_attn.q_norm.weight",
        "k_norm": p + "self_attn.k_norm.weight",
        "o": p + "self_attn.o_proj.weight",
        "gate": p + "mlp.gate_proj.weight",
        "up": p + "mlp.up_proj.weight",
        "down": p + "mlp.down_proj.weight",
    }


# ---------------------------------------------------------------------------------------------
# Megatron (training ranks)


def _megatron_param_boxes(spec: HFModelSpec, mapping, key: str) -> list[Box]:
    """The boxes of one Megatron shard, from its ``ParamMapping`` (shard order = storage order)."""
    shape = mapping.shard_shape
    width = shape[1] if len(shape) == 2 else 1
    if mapping.duplicate:
        return []  # a tied LM head on a later stage copies the embedding; the embedding is the source
    if mapping.kind == "qkv":
        q, k, v = mapping.pieces
        head_rows = (k.stop - k.start) // mapping.groups
        group_rows = mapping.q_rows_per_group + 2 * head_rows
        boxes = []
        for g in range(mapping.groups):
            base = g * group_rows * width
            q0 = q.start + g * mapping.q_rows_per_group
            k0 = k.start + g * head_rows
            v0 = v.start + g * head_rows
            boxes += [
                _rows(q.name, q0, q0 + mapping.q_rows_per_group, width, key, base),
                _rows(k.name, k0, k0 + head_rows, width, key, base + mapping.q_rows_per_group * width),
                _rows(v.name, v0, v0 + head_rows, width, key, base + (mapping.q_rows_per_group + head_rows) * width),
            ]
        return boxes
    if mapping.kind == "row":
        (piece,) = mapping.pieces
        return [Box(piece.name, 0, piece.full_shape[0], piece.start, piece.stop, key, 0, piece.stop - piece.start)]
    boxes, offset = [], 0
    for piece in mapping.pieces:  # vocab, replicated, column, gate_up: stacked row blocks
        if piece.stop > piece.start:
            boxes.append(_rows(piece.name, piece.start, piece.stop, width, key, offset))
        offset += (piece.stop - piece.start) * width
    return boxes


def megatron_layout(
    spec: HFModelSpec,
    *,
    tp: int,
    tp_rank: int,
    pp: int,
    pp_rank: int,
    vpp: int | None = None,
    vocab_pad_multiple: int | None,
    ep: int = 1,
    ep_rank: int = 0,
    split: "PipelineSplit | None" = None,
) -> Layout:
    """The actor's shards on the rank at (``tp_rank``, ``pp_rank``, ``ep_rank``): keys ``"{chunk}/{param name}"``.

    Layers per chunk as the builder split them: ``split`` (the model's ``verl_split``), or None for
    Megatron's uniform split, uneven first/last stages chosen automatically where layers do not divide.
    """
    chunks = vpp or 1
    if split is None:
        split = resolve_split(spec.num_layers, pp, vpp)
    if (split.num_layers, split.pp, split.vpp or 1) != (spec.num_layers, pp, chunks):
        raise ValueError(f"pipeline split {split.describe()} does not match the layout's pipeline {pp} x virtual {chunks}")
    padded = padded_vocab_size(spec.vocab_size, tp, vocab_pad_multiple)
    shapes: dict[str, tuple[int, ...]] = {}
    boxes: list[Box] = []
    for v in range(chunks):
        pre = pp_rank == 0 and v == 0
        post = pp_rank == pp - 1 and v == chunks - 1
        offset, per_chunk = split.chunk_range(pp_rank, v)
        for name in megatron_param_names(spec, num_layers=per_chunk, pre_process=pre, post_process=post, ep_size=ep):
            mapping = param_mapping(
                name, spec, tp_rank=tp_rank, tp_size=tp, padded_vocab=padded, layer_offset=offset,
                ep_rank=ep_rank, ep_size=ep,
            )
            key = f"{v}/{name}"
            shapes[key] = mapping.shard_shape
            boxes += _megatron_param_boxes(spec, mapping, key)
    return Layout(shapes=shapes, boxes=tuple(boxes))


def check_megatron_layout(layout: Layout, chunks: list, *, where: str) -> None:
    """The live model chunks hold exactly the tensors ``layout`` expects (names, shapes), or ValueError."""
    from verl.models.builder import unwrap_model

    actual = {}
    for v, chunk in enumerate(chunks):
        for name, param in unwrap_model(chunk).named_parameters():
            if not is_adapter_param(name):  # LoRA factors: pushed merged into their base weights
                actual[f"{v}/{name}"] = tuple(param.shape)
    missing = sorted(set(layout.shapes) - set(actual))
    extra = sorted(set(actual) - set(layout.shapes))
    wrong = sorted(k for k in set(actual) & set(layout.shapes) if actual[k] != layout.shapes[k])
    if missing or extra or wrong:
        raise ValueError(
            f"{where}: the actor's model chunks do not match the resharding plan's layout (missing {missing[:3]}, "
            f"unexpected {extra[:3]}, shape differs {[(k, actual[k], layout.shapes[k]) for k in wrong[:3]]}); "
            "verl's reshard plan assumes Megatron's uniform layer split and verl's model builder"
        )


# ---------------------------------------------------------------------------------------------
# Rollout ranks


def check_rollout_degrees(spec: HFModelSpec, tp: int) -> list[str]:
    """Problems splitting ``spec`` over rollout tensor parallel ``tp`` (vLLM's rules); [] when it fits."""
    problems = []
    if tp < 1:
        problems.append(f"rollout tensor parallel {tp} must be >= 1")
        return problems
    if spec.num_attention_heads % tp:
        problems.append(f"num_attention_heads={spec.num_attention_heads} is not divisible by rollout TP' {tp}")
    if spec.num_kv_heads % tp and tp % spec.num_kv_heads:
        problems.append(
            f"num_key_value_heads={spec.num_kv_heads} and rollout TP' {tp}: one must divide the other "
            "(vLLM splits or replicates the K/V heads)"
        )
    if spec.is_moe and spec.moe_intermediate_size % tp:
        problems.append(f"moe_intermediate_size={spec.moe_intermediate_size} is not divisible by rollout TP' {tp}")
    if not spec.is_moe and spec.intermediate_size % tp:
        problems.append(f"intermediate_size={spec.intermediate_size} is not divisible by rollout TP' {tp}")
    if spec.shared_expert_intermediate_size % tp:
        problems.append(
            f"shared_expert_intermediate_size={spec.shared_expert_intermediate_size} is not divisible by rollout TP' {tp}"
        )
    if (-(-spec.vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING) % tp:
        problems.append(
            f"vocab_size={spec.vocab_size} padded to a multiple of {VLLM_VOCAB_PADDING} is not divisible by rollout TP' {tp}"
        )
    return problems


def _split(n: int, tp: int, rank: int) -> tuple[int, int]:
    size = n // tp
    return rank * size, (rank + 1) * size


def _kv_rows(spec: HFModelSpec, tp: int, rank: int) -> tuple[int, int]:
    """Rows of k_proj / v_proj on rollout rank ``rank`` (K/V heads replicated when tp > their number)."""
    d = spec.head_dim
    if tp >= spec.num_kv_heads:
        head = rank // (tp // spec.num_kv_heads)
        return head * d, (head + 1) * d
    return _split(spec.num_kv_heads * d, tp, rank)


def vllm_layout(spec: HFModelSpec, *, tp: int, tp_rank: int) -> Layout:
    """vLLM's parameters on rollout rank ``tp_rank`` of ``tp`` (vLLM names, see the module docstring)."""
    problems = check_rollout_degrees(spec, tp)
    if problems:
        raise ValueError(f"rollout layout TP'={tp}: " + "; ".join(problems))
    h, d = spec.hidden_size, spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    boxes: list[Box] = []

    def add(key: str, shape: tuple[int, ...], parts: list[Box]) -> None:
        shapes[key] = shape
        boxes.extend(parts)

    per = -(-spec.vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING // tp
    v0, v1 = min(tp_rank * per, spec.vocab_size), min((tp_rank + 1) * per, spec.vocab_size)

    def vocab(key: str, hf: str) -> None:
        add(key, (per, h), [_rows(hf, v0, v1, h, key, 0)] if v1 > v0 else [])

    vocab("model.embed_tokens.weight", HF_EMBED)
    q0, q1 = _split(spec.num_attention_heads * d, tp, tp_rank)
    k0, k1 = _kv_rows(spec, tp, tp_rank)
    f0, f1 = _split(spec.intermediate_size, tp, tp_rank)
    for layer in range(spec.num_layers):
        n = _layer_names(layer)
        p = f"model.layers.{layer}."
        for norm, hf in (("input_layernorm.weight", n["in_norm"]), ("post_attention_layernorm.weight", n["post_norm"])):
            add(p + norm, (h,), [_rows(hf, 0, h, 1, p + norm, 0)])
        rows = (q1 - q0) + 2 * (k1 - k0)
        for kind, width in (("weight", h), ("bias", 1)):
            if kind == "bias" and not spec.qkv_bias:
                continue
            key = p + f"self_attn.qkv_proj.{kind}"
            add(key, (rows, h) if kind == "weight" else (rows,), [
                _rows(f"{n['q']}.{kind}", q0, q1, width, key, 0),
                _rows(f"{n['k']}.{kind}", k0, k1, width, key, (q1 - q0) * width),
                _rows(f"{n['v']}.{kind}", k0, k1, width, key, (q1 - q0 + k1 - k0) * width),
            ])
        if spec.qk_layernorm:
            for norm in ("q_norm", "k_norm"):
                key = p + f"self_attn.{norm}.weight"
                add(key, (d,), [_rows(n[norm], 0, d, 1, key, 0)])
        key = p + "self_attn.o_proj.weight"
        add(key, (h, q1 - q0), [Box(n["o"], 0, h, q0, q1, key, 0, q1 - q0)])
        if spec.is_moe:
            _add_vllm_experts(spec, layer, tp, tp_rank, add)
        else:
            key = p + "mlp.gate_up_proj.weight"
            add(key, (2 * (f1 - f0), h), [_rows(n["gate"], f0, f1, h, key, 0), _rows(n["up"], f0, f1, h, key, (f1 - f0) * h)])
            key = p + "mlp.down_proj.weight"
            add(key, (h, f1 - f0), [Box(n["down"], 0, h, f0, f1, key, 0, f1 - f0)])
    add("model.norm.weight", (h,), [_rows(HF_FINAL_NORM, 0, h, 1, "model.norm.weight", 0)])
    if not spec.tie_word_embeddings:
        vocab("lm_head.weight", HF_LM_HEAD)
    return Layout(shapes=shapes, boxes=tuple(boxes))


def _add_vllm_experts(spec: HFModelSpec, layer: int, tp: int, tp_rank: int, add) -> None:
    """One MoE layer in vLLM's fused experts, on rollout rank ``tp_rank`` of ``tp`` (vLLM shards the
    experts' intermediate dim over TP', every rank holds every expert): the router
    ``{block}.gate.weight`` [E, H] (whole), ``{block}.experts.routed_experts.w13_weight``
    [E, 2F', H] (expert e: its gate rows of this rank, then its up rows) and ``...w2_weight``
    [E, H, F'] (its down columns of this rank); Qwen2-MoE's shared expert is a dense MLP
    (``mlp.shared_expert.gate_up_proj``/``down_proj``, split like one) with a whole gate
    ``mlp.shared_expert_gate.weight`` [1, H]."""
    h, n = spec.hidden_size, spec.num_experts
    block = MOE_HF_NAMES[spec.model_type][0]
    p = f"model.layers.{layer}.{block}."
    key = p + "gate.weight"
    add(key, (n, h), [_rows(moe_hf_names(spec, layer)["router"], 0, n, h, key, 0)])
    e0, e1 = _split(spec.moe_intermediate_size, tp, tp_rank)
    f = e1 - e0
    w13, w2 = p + "experts.routed_experts.w13_weight", p + "experts.routed_experts.w2_weight"
    gate_up: list[Box] = []
    down: list[Box] = []
    for e in range(n):
        names = moe_hf_names(spec, layer, e)
        gate_up += [_rows(names["gate"], e0, e1, h, w13, e * 2 * f * h), _rows(names["up"], e0, e1, h, w13, (e * 2 * f + f) * h)]
        down.append(Box(names["down"], 0, h, e0, e1, w2, e * h * f, f))
    add(w13, (n, 2 * f, h), gate_up)
    add(w2, (n, h, f), down)
    if spec.has_shared_expert:
        shared = shared_expert_hf_names(layer)
        s0, s1 = _split(spec.shared_expert_intermediate_size, tp, tp_rank)
        key = f"model.layers.{layer}.mlp.shared_expert.gate_up_proj.weight"
        add(key, (2 * (s1 - s0), h), [_rows(shared["gate"], s0, s1, h, key, 0),
                                      _rows(shared["up"], s0, s1, h, key, (s1 - s0) * h)])
        key = f"model.layers.{layer}.mlp.shared_expert.down_proj.weight"
        add(key, (h, s1 - s0), [Box(shared["down"], 0, h, s0, s1, key, 0, s1 - s0)])
        key = f"model.layers.{layer}.mlp.shared_expert_gate.weight"
        add(key, (1, h), [_rows(shared["shared_gate"], 0, 1, h, key, 0)])


def hf_layout(spec: HFModelSpec, *, tp: int = 1, tp_rank: int = 0, fused_experts: bool = False) -> Layout:
    """Hugging Face tensors (their names) on rollout rank ``tp_rank`` of ``tp``: whole at ``tp = 1``,
    else split as vLLM splits them (q/k/v, gate/up, vocabulary by rows; o/down by columns), unpadded.

    Experts (Qwen3-MoE, Qwen2-MoE, Mixtral) are per-expert tensors, split like a dense MLP; Qwen2-MoE's
    shared expert is split like a dense MLP in either case and its gate is whole. ``fused_experts``
    (``tp = 1``, the transformers engine's own parameters) puts them where transformers 5 holds them:
    ``model.layers.{i}.mlp.experts.gate_up_proj`` [E, 2F, H] (expert e: its gate rows, then its up
    rows), ``...experts.down_proj`` [E, H, F] and the router in ``model.layers.{i}.mlp.gate.weight``."""
    if fused_experts and tp != 1:
        raise ValueError("hf_layout: fused experts are the transformers engine's layout, which has TP' = 1")
    if tp > 1:
        problems = check_rollout_degrees(spec, tp)
        if problems:
            raise ValueError(f"rollout layout TP'={tp}: " + "; ".join(problems))
    h, d = spec.hidden_size, spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    boxes: list[Box] = []

    def add_rows(name: str, r0: int, r1: int, width: int) -> None:
        shapes[name] = (r1 - r0, width) if width > 1 else (r1 - r0,)
        if r1 > r0:
            boxes.append(_rows(name, r0, r1, width, name, 0))

    def add_cols(name: str, c0: int, c1: int) -> None:
        shapes[name] = (h, c1 - c0)
        boxes.append(Box(name, 0, h, c0, c1, name, 0, c1 - c0))

    per = -(-spec.vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING // tp if tp > 1 else spec.vocab_size
    v0, v1 = min(tp_rank * per, spec.vocab_size), min((tp_rank + 1) * per, spec.vocab_size)
    add_rows(HF_EMBED, v0, v1, h)
    q0, q1 = _split(spec.num_attention_heads * d, tp, tp_rank)
    k0, k1 = _kv_rows(spec, tp, tp_rank) if tp > 1 else (0, spec.num_kv_heads * d)
    f0, f1 = _split(spec.intermediate_size, tp, tp_rank)
    for layer in range(spec.num_layers):
        n = _layer_names(layer)
        add_rows(n["in_norm"], 0, h, 1)
        add_rows(n["post_norm"], 0, h, 1)
        for kind, width in (("weight", h), ("bias", 1)):
            if kind == "bias" and not spec.qkv_bias:
                continue
            add_rows(f"{n['q']}.{kind}", q0, q1, width)
            add_rows(f"{n['k']}.{kind}", k0, k1, width)
            add_rows(f"{n['v']}.{kind}", k0, k1, width)
        if spec.qk_layernorm:
            add_rows(n["q_norm"], 0, d, 1)
            add_rows(n["k_norm"], 0, d, 1)
        add_cols(n["o"], q0, q1)
        if not spec.is_moe:
            add_rows(n["gate"], f0, f1, h)
            add_rows(n["up"], f0, f1, h)
            add_cols(n["down"], f0, f1)
        elif fused_experts:
            _add_fused_experts(spec, layer, shapes, boxes)
        else:
            e0, e1 = _split(spec.moe_intermediate_size, tp, tp_rank)
            add_rows(moe_hf_names(spec, layer)["router"], 0, spec.num_experts, h)
            for e in range(spec.num_experts):
                names = moe_hf_names(spec, layer, e)
                add_rows(names["gate"], e0, e1, h)
                add_rows(names["up"], e0, e1, h)
                shapes[names["down"]] = (h, e1 - e0)
                boxes.append(Box(names["down"], 0, h, e0, e1, names["down"], 0, e1 - e0))
        if spec.has_shared_expert:  # a dense MLP (split like one) and its gate (whole); transformers' own names
            shared = shared_expert_hf_names(layer)
            s0, s1 = _split(spec.shared_expert_intermediate_size, tp, tp_rank)
            add_rows(shared["gate"], s0, s1, h)
            add_rows(shared["up"], s0, s1, h)
            add_cols(shared["down"], s0, s1)
            add_rows(shared["shared_gate"], 0, 1, h)
    add_rows(HF_FINAL_NORM, 0, h, 1)
    if not spec.tie_word_embeddings:
        add_rows(HF_LM_HEAD, v0, v1, h)
    return Layout(shapes=shapes, boxes=tuple(boxes))


def _add_fused_experts(spec: HFModelSpec, layer: int, shapes: dict, boxes: list) -> None:
    """One MoE layer's router and experts in transformers 5's fused parameters (see :func:`hf_layout`)."""
    h, f, n = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    p = f"model.layers.{layer}.mlp."
    router = p + "gate.weight"
    shapes[router] = (n, h)
    boxes.append(_rows(moe_hf_names(spec, layer)["router"], 0, n, h, router, 0))
    gate_up, down = p + "experts.gate_up_proj", p + "experts.down_proj"
    shapes[gate_up], shapes[down] = (n, 2 * f, h), (n, h, f)
    for e in range(n):
        names = moe_hf_names(spec, layer, e)
        boxes.append(_rows(names["gate"], 0, f, h, gate_up, e * 2 * f * h))
        boxes.append(_rows(names["up"], 0, f, h, gate_up, (e * 2 * f + f) * h))
        boxes.append(_rows(names["down"], 0, h, f, down, e * h * f))
