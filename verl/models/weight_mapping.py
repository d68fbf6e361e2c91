"""The one place that knows how Hugging Face weights map onto Megatron-core GPT parameters.

Every Megatron parameter shard (one tensor-parallel rank's slice of one parameter) is described
by a :class:`ParamMapping`: the list of Hugging Face tensor *pieces* (name + row/column range)
it is made of, in the order they appear in the shard. Two pure functions turn pieces into a
shard and back:

- :func:`assemble_shard` — HF pieces -> Megatron shard (checkpoint loading, hf2megatron);
- :func:`split_shard` — Megatron shard -> HF pieces (megatron2hf, rollout weight sync).

Layouts handled here:

- q/k/v are fused into ``linear_qkv`` *per GQA group*: for each key/value head g the rows are
  ``[q heads of group g; k_g; v_g]``; tensor parallelism splits the groups contiguously.
- gate/up are fused into ``linear_fc1`` as ``[gate; up]`` *per TP rank* (each rank holds its
  gate rows followed by its up rows, because SwiGLU chunks the local output in two).
- the vocabulary (embedding and LM head rows) is padded with zero rows to ``padded_vocab_size``
  and split contiguously; padded rows never reach Hugging Face. By default the padding is
  vLLM's (a multiple of 64, and of the TP size when that is larger), so each TP rank holds the
  vocabulary rows a vLLM engine of the same TP' holds, and the hybrid engine's push at
  TP == TP' is a local copy even for the embedding and LM head.
- Mixture-of-Experts layers (Qwen3-MoE, Mixtral): the router ``mlp.router.weight`` [experts, hidden]
  is replicated; each of a rank's local experts (``mlp.experts.local_experts.{j}``, Megatron's
  ``SequentialMLP``) is whole (expert TP 1): ``linear_fc1`` = ``[gate; up]``, ``linear_fc2`` = down;
  expert parallelism gives rank ``r`` the global experts ``r * E / EP`` onwards.
  Qwen2-MoE's shared expert (``mlp.shared_experts``) is a dense MLP split over TP like any other
  (``linear_fc1`` ``[gate_r; up_r]``, ``linear_fc2`` by columns); its gate ``gate_weight`` [1, hidden]
  (Hugging Face's ``mlp.shared_expert_gate.weight``) is replicated.
- Qwen3's per-head query/key norms (``q_layernorm``/``k_layernorm``, ``[head_dim]``) are replicated.
- tied embeddings: the LM head of a last pipeline stage that does not own the embedding is a
  copy of ``model.embed_tokens.weight`` (marked ``duplicate`` so exporters skip it).
- scalar heads (critic value head, reward head): ``output_layer.weight`` [1, hidden] maps to
  Hugging Face's ``score.weight`` of ``*ForSequenceClassification`` with one label.

Megatron parameter names are local to a model chunk (``decoder.layers.{i}`` counts from the
chunk's first layer); ``layer_offset`` turns them into global Hugging Face layer indices.
Both the local layer spec and Transformer Engine names (fused layer-norm weights) are accepted.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Literal

import torch

from verl.models.hf_config import HFModelSpec

Kind = Literal["replicated", "column", "row", "vocab", "qkv", "gate_up"]
HeadKind = Literal["lm", "value", "reward"]

ROLLOUT_VOCAB_PADDING = 64
"""vLLM pads the vocabulary of its embedding and LM head to a multiple of this (``pad_vocab_size``)."""

# Megatron layer parameter suffix -> (HF suffixes, kind). TE names fuse the layer norms into
# the following linear layer.
_LAYER_PARAMS: dict[str, tuple[tuple[str, ...], Kind]] = {
    "input_layernorm.weight": (("input_layernorm.weight",), "replicated"),
    "self_attention.linear_qkv.layer_norm_weight": (("input_layernorm.weight",), "replicated"),
    "self_attention.linear_qkv.weight": (
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "qkv",
    ),
    "self_attention.linear_qkv.bias": (
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        "qkv",
    ),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), "row"),
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), "replicated"),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), "replicated"),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), "replicated"),
    "mlp.linear_fc1.layer_norm_weight": (("post_attention_layernorm.weight",), "replicated"),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gate_up"),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), "row"),
}
_HEAD_NORMS = frozenset({"self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"})
"""Per-head norms: ``[head_dim]`` wide, not ``[hidden]``."""
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

HF_EMBED = "model.embed_tokens.weight"
HF_FINAL_NORM = "model.norm.weight"
HF_LM_HEAD = "lm_head.weight"
HF_SCORE = "score.weight"


def padded_vocab_size(vocab_size: int, tp_size: int, multiple: int | None = None) -> int:
    """Rows of the padded vocabulary at TP ``tp_size``.

    ``multiple`` None (the default): the smallest size >= vocab_size divisible by
    ``lcm(ROLLOUT_VOCAB_PADDING, tp_size)`` — vLLM's padding, so TP rank ``r`` holds the rows a
    vLLM engine's rank ``r`` holds at the same TP. An explicit ``multiple`` pads to a multiple of
    ``multiple * tp_size`` instead (Megatron-LM's ``make_vocab_size_divisible_by``).
    """
    if vocab_size <= 0 or tp_size <= 0 or (multiple is not None and multiple <= 0):
        raise ValueError(f"vocab_size ({vocab_size}), tp_size ({tp_size}) and multiple ({multiple}) must be positive")
    step = math.lcm(ROLLOUT_VOCAB_PADDING, tp_size) if multiple is None else multiple * tp_size
    return -(-vocab_size // step) * step


@dataclass(frozen=True, kw_only=True)
class HFPiece:
    """A contiguous range of one Hugging Face tensor along one axis."""

    name: str
    """Hugging Face parameter name."""
    full_shape: tuple[int, ...]
    """Shape of the whole Hugging Face tensor."""
    dim: int
    """Axis along which the piece is cut."""
    start: int
    """First index along ``dim`` (inclusive)."""
    stop: int
    """Last index along ``dim`` (exclusive)."""

    @property
    def is_whole(self) -> bool:
        """True when the piece is the entire tensor."""
        return self.start == 0 and self.stop == self.full_shape[self.dim]

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the piece."""
        shape = list(self.full_shape)
        shape[self.dim] = self.stop - self.start
        return tuple(shape)


@dataclass(frozen=True, kw_only=True)
class ParamMapping:
    """How one Megatron parameter shard is built from Hugging Face tensors."""

    megatron_name: str
    """Parameter name inside the Megatron model chunk."""
    kind: Kind
    """Layout rule (see module docstring)."""
    pieces: tuple[HFPiece, ...]
    """Hugging Face pieces in shard order."""
    shard_shape: tuple[int, ...]
    """Shape of the Megatron shard on this TP rank."""
    groups: int = 0
    """``qkv`` only: GQA groups on this rank."""
    q_rows_per_group: int = 0
    """``qkv`` only: query rows per group (q_per_group * head_dim)."""
    duplicate: bool = False
    """The shard repeats a tensor owned elsewhere (tied LM head on a later stage): skip on export."""
    expert: bool = False
    """An expert's weight: whole on its expert-parallel rank (expert TP 1), not split over TP."""


def _piece(name: str, shape: tuple[int, ...], dim: int, start: int, stop: int) -> HFPiece:
    return HFPiece(name=name, full_shape=shape, dim=dim, start=start, stop=stop)


def _check_tp(spec: HFModelSpec, tp_size: int) -> None:
    problems = []
    if spec.num_kv_heads % tp_size:
        problems.append(f"num_key_value_heads ({spec.num_kv_heads})")
    if spec.num_attention_heads % tp_size:
        problems.append(f"num_attention_heads ({spec.num_attention_heads})")
    if spec.intermediate_size % tp_size and not spec.is_moe:  # experts are not split over TP
        problems.append(f"intermediate_size ({spec.intermediate_size})")
    if spec.shared_expert_intermediate_size % tp_size:
        problems.append(f"shared_expert_intermediate_size ({spec.shared_expert_intermediate_size})")
    if problems:
        raise ValueError(
            f"tensor parallel size {tp_size} does not divide {', '.join(problems)} of the "
            f"{spec.model_type} config; choose a TP size that divides them."
        )


def param_mapping(
    megatron_name: str,
    spec: HFModelSpec,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    padded_vocab: int,
    layer_offset: int = 0,
    head: HeadKind = "lm",
    ep_rank: int = 0,
    ep_size: int = 1,
) -> ParamMapping:
    """Describe the Megatron parameter ``megatron_name`` on TP rank ``tp_rank`` of ``tp_size``.

    ``layer_offset`` is the global index of the chunk's first layer; ``ep_rank`` of ``ep_size``
    (expert parallel) places a Mixture-of-Experts chunk's local experts among the global ones.
    Raises ValueError for a name the mapping does not know.
    """
    _check_tp(spec, tp_size)
    if spec.is_moe and spec.num_experts % ep_size:
        raise ValueError(f"expert parallel size {ep_size} does not divide num_experts ({spec.num_experts})")
    if padded_vocab % tp_size or padded_vocab < spec.vocab_size:
        raise ValueError(
            f"padded vocab {padded_vocab} must be >= vocab_size {spec.vocab_size} and divisible by TP {tp_size}"
        )
    h = spec.hidden_size
    d = spec.head_dim

    def split(n: int) -> tuple[int, int]:
        size = n // tp_size
        return tp_rank * size, (tp_rank + 1) * size

    def vocab(name: str, duplicate: bool = False) -> ParamMapping:
        rows = padded_vocab // tp_size
        start, stop = tp_rank * rows, (tp_rank + 1) * rows
        start, stop = min(start, spec.vocab_size), min(stop, spec.vocab_size)
        piece = _piece(name, (spec.vocab_size, h), 0, start, stop)
        return ParamMapping(
            megatron_name=megatron_name, kind="vocab", pieces=(piece,), shard_shape=(rows, h), duplicate=duplicate
        )

    if megatron_name == "embedding.word_embeddings.weight":
        return vocab(HF_EMBED)
    if megatron_name == "decoder.final_layernorm.weight":
        return ParamMapping(
            megatron_name=megatron_name,
            kind="replicated",
            pieces=(_piece(HF_FINAL_NORM, (h,), 0, 0, h),),
            shard_shape=(h,),
        )
    if megatron_name == "output_layer.weight":
        if head != "lm":
            return ParamMapping(
                megatron_name=megatron_name,
                kind="replicated",
                pieces=(_piece(HF_SCORE, (1, h), 0, 0, 1),),
                shard_shape=(1, h),
            )
        if spec.tie_word_embeddings:
            # Only a stage without the embedding has this parameter: it is a copy.
            return vocab(HF_EMBED, duplicate=True)
        return vocab(HF_LM_HEAD)

    match = _LAYER_RE.match(megatron_name)
    if match is not None and spec.is_moe and match.group(2).startswith("mlp."):
        return _moe_mapping(
            megatron_name, spec, int(match.group(1)) + layer_offset, match.group(2), ep_rank, ep_size,
            tp_rank=tp_rank, tp_size=tp_size,
        )
    if match is None or match.group(2) not in _LAYER_PARAMS:
        raise ValueError(
            f"Megatron parameter '{megatron_name}' has no Hugging Face mapping; "
            "verl maps the Llama/Qwen2/Qwen3/Mistral GPT layout and Qwen3-MoE/Qwen2-MoE/Mixtral experts only."
        )
    layer = int(match.group(1)) + layer_offset
    suffix = match.group(2)
    if layer >= spec.num_layers:
        raise ValueError(f"'{megatron_name}' with layer offset {layer_offset} is past num_hidden_layers {spec.num_layers}")
    hf_names, kind = _LAYER_PARAMS[suffix]
    hf_names = tuple(f"model.layers.{layer}.{n}" for n in hf_names)

    if kind == "replicated":
        width = d if suffix in _HEAD_NORMS else h
        pieces = (_piece(hf_names[0], (width,), 0, 0, width),)
        return ParamMapping(megatron_name=megatron_name, kind=kind, pieces=pieces, shard_shape=(width,))
    if kind == "qkv":
        is_bias = suffix.endswith("bias")
        rest = () if is_bias else (h,)
        groups = spec.num_kv_heads // tp_size
        g0 = tp_rank * groups
        q_rows = spec.q_per_group * d
        pieces = (
            _piece(hf_names[0], (spec.num_attention_heads * d, *rest), 0, g0 * q_rows, (g0 + groups) * q_rows),
            _piece(hf_names[1], (spec.num_kv_heads * d, *rest), 0, g0 * d, (g0 + groups) * d),
            _piece(hf_names[2], (spec.num_kv_heads * d, *rest), 0, g0 * d, (g0 + groups) * d),
        )
        return ParamMapping(
            megatron_name=megatron_name,
            kind=kind,
            pieces=pieces,
            shard_shape=(groups * (q_rows + 2 * d), *rest),
            groups=groups,
            q_rows_per_group=q_rows,
        )
    if kind == "row":
        in_features = spec.num_attention_heads * d if "linear_proj" in suffix else spec.intermediate_size
        start, stop = split(in_features)
        pieces = (_piece(hf_names[0], (h, in_features), 1, start, stop),)
        return ParamMapping(megatron_name=megatron_name, kind=kind, pieces=pieces, shard_shape=(h, stop - start))
    if kind == "gate_up":
        f = spec.intermediate_size
        start, stop = split(f)
        pieces = tuple(_piece(n, (f, h), 0, start, stop) for n in hf_names)
        return ParamMapping(megatron_name=megatron_name, kind=kind, pieces=pieces, shard_shape=(2 * (stop - start), h))
    raise AssertionError(f"unhandled kind {kind}")


_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
MOE_HF_NAMES = {
    # model_type -> (MoE block, router, expert gate, up, down), below model.layers.{i}.
    "qwen3_moe": ("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "gate", "w1", "w3", "w2"),
    "qwen2_moe": ("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
}
"""Where a Mixture-of-Experts checkpoint keeps its router and experts (the per-expert names of the
Hugging Face hub's checkpoints, which transformers reads and writes)."""


def moe_hf_names(spec: HFModelSpec, layer: int, expert: int | None = None) -> dict[str, str]:
    """Hugging Face names of layer ``layer``'s router (``expert`` None) or of one expert's gate/up/down."""
    block, router, gate, up, down = MOE_HF_NAMES[spec.model_type]
    p = f"model.layers.{layer}.{block}."
    if expert is None:
        return {"router": f"{p}{router}.weight"}
    e = f"{p}experts.{expert}."
    return {"gate": f"{e}{gate}.weight", "up": f"{e}{up}.weight", "down": f"{e}{down}.weight"}


def shared_expert_hf_names(layer: int) -> dict[str, str]:
    """Hugging Face names of layer ``layer``'s shared expert (gate/up/down) and its gate (Qwen2-MoE)."""
    p = f"model.layers.{layer}.mlp.shared_expert"
    return {"gate": f"{p}.gate_proj.weight", "up": f"{p}.up_proj.weight", "down": f"{p}.down_proj.weight",
            "shared_gate": f"{p}_gate.weight"}


def _moe_mapping(
    megatron_name: str, spec: HFModelSpec, layer: int, suffix: str, ep_rank: int, ep_size: int,
    *, tp_rank: int, tp_size: int,
) -> ParamMapping:
    """The router (replicated), the local experts (whole, expert TP 1) and the shared expert (split
    over TP, its gate replicated) of a Mixture-of-Experts layer.

    Megatron's ``SequentialMLP`` numbers its experts locally: local expert ``j`` on expert-parallel
    rank ``r`` is global expert ``r * num_experts / ep_size + j``. ``linear_fc1`` is ``[gate; up]``.
    """
    h, f, n = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    if layer >= spec.num_layers:
        raise ValueError(f"'{megatron_name}' is past num_hidden_layers {spec.num_layers}")
    if spec.has_shared_expert and suffix.startswith("mlp.shared_experts."):
        names = shared_expert_hf_names(layer)
        fs = spec.shared_expert_intermediate_size
        start, stop = tp_rank * fs // tp_size, (tp_rank + 1) * fs // tp_size
        if suffix == "mlp.shared_experts.gate_weight":
            piece = _piece(names["shared_gate"], (1, h), 0, 0, 1)
            return ParamMapping(megatron_name=megatron_name, kind="replicated", pieces=(piece,), shard_shape=(1, h))
        if suffix == "mlp.shared_experts.linear_fc1.weight":
            pieces = (_piece(names["gate"], (fs, h), 0, start, stop), _piece(names["up"], (fs, h), 0, start, stop))
            return ParamMapping(megatron_name=megatron_name, kind="gate_up", pieces=pieces, shard_shape=(2 * (stop - start), h))
        if suffix == "mlp.shared_experts.linear_fc2.weight":
            pieces = (_piece(names["down"], (h, fs), 1, start, stop),)
            return ParamMapping(megatron_name=megatron_name, kind="row", pieces=pieces, shard_shape=(h, stop - start))
    if suffix == "mlp.router.weight":
        piece = _piece(moe_hf_names(spec, layer)["router"], (n, h), 0, 0, n)
        return ParamMapping(megatron_name=megatron_name, kind="replicated", pieces=(piece,), shard_shape=(n, h))
    match = _EXPERT_RE.match(suffix)
    local = n // ep_size
    if match is None or int(match.group(1)) >= local:
        raise ValueError(
            f"Megatron parameter '{megatron_name}' has no Hugging Face mapping in a {spec.model_type} layer "
            f"({local} local experts per expert-parallel rank)"
        )
    names = moe_hf_names(spec, layer, ep_rank * local + int(match.group(1)))
    if match.group(2) == "linear_fc1":
        pieces = (_piece(names["gate"], (f, h), 0, 0, f), _piece(names["up"], (f, h), 0, 0, f))
        return ParamMapping(megatron_name=megatron_name, kind="gate_up", pieces=pieces, shard_shape=(2 * f, h), expert=True)
    pieces = (_piece(names["down"], (h, f), 1, 0, f),)
    return ParamMapping(megatron_name=megatron_name, kind="row", pieces=pieces, shard_shape=(h, f), expert=True)


def assemble_shard(mapping: ParamMapping, tensors: list[torch.Tensor]) -> torch.Tensor:
    """Build the Megatron shard from its Hugging Face pieces (given in ``mapping.pieces`` order)."""
    assert len(tensors) == len(mapping.pieces), (mapping.megatron_name, len(tensors))
    for piece, t in zip(mapping.pieces, tensors):
        if tuple(t.shape) != piece.shape:
            raise ValueError(
                f"Hugging Face tensor '{piece.name}' slice has shape {tuple(t.shape)}, expected {piece.shape} "
                f"(full {piece.full_shape}); the checkpoint does not match its config.json."
            )
    if mapping.kind == "vocab":
        (t,) = tensors
        pad = mapping.shard_shape[0] - t.shape[0]
        if pad:
            t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])], dim=0)
        return t
    if mapping.kind == "qkv":
        q, k, v = tensors
        rest = q.shape[1:]
        g = mapping.groups
        head_rows = k.shape[0] // g
        fused = torch.cat(
            [q.reshape(g, mapping.q_rows_per_group, *rest), k.reshape(g, head_rows, *rest), v.reshape(g, head_rows, *rest)],
            dim=1,
        )
        return fused.reshape(mapping.shard_shape)
    if mapping.kind == "gate_up":
        return torch.cat(tensors, dim=0)
    (t,) = tensors
    return t


def split_shard(mapping: ParamMapping, shard: torch.Tensor) -> list[tuple[HFPiece, torch.Tensor]]:
    """Cut a Megatron shard into its Hugging Face pieces (views where possible); inverse of assemble_shard."""
    if tuple(shard.shape) != mapping.shard_shape:
        raise ValueError(f"'{mapping.megatron_name}' shard has shape {tuple(shard.shape)}, expected {mapping.shard_shape}")
    if mapping.kind == "vocab":
        (piece,) = mapping.pieces
        return [(piece, shard[: piece.stop - piece.start])]
    if mapping.kind == "qkv":
        g = mapping.groups
        rest = shard.shape[1:]
        head_rows = mapping.pieces[1].stop - mapping.pieces[1].start
        head_rows //= g
        q, k, v = shard.reshape(g, -1, *rest).split([mapping.q_rows_per_group, head_rows, head_rows], dim=1)
        parts = [q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]
        return list(zip(mapping.pieces, parts))
    if mapping.kind == "gate_up":
        return list(zip(mapping.pieces, shard.chunk(2, dim=0)))
    return [(mapping.pieces[0], shard)]


def megatron_param_names(
    spec: HFModelSpec,
    *,
    num_layers: int,
    pre_process: bool,
    post_process: bool,
    head: HeadKind = "lm",
    te_names: bool = False,
    ep_size: int = 1,
) -> list[str]:
    """Parameter names of one GPT model chunk with ``num_layers`` layers (local spec or TE names;
    a Mixture-of-Experts chunk holds ``num_experts / ep_size`` local experts per layer)."""
    names = []
    if pre_process:
        names.append("embedding.word_embeddings.weight")
    for i in range(num_layers):
        p = f"decoder.layers.{i}."
        names.append(p + ("self_attention.linear_qkv.layer_norm_weight" if te_names else "input_layernorm.weight"))
        names.append(p + "self_attention.linear_qkv.weight")
        if spec.qkv_bias:
            names.append(p + "self_attention.linear_qkv.bias")
        if spec.qk_layernorm:
            names += [p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"]
        names.append(p + "self_attention.linear_proj.weight")
        if spec.is_moe:  # the MoE layer's norm stays its own module, under TE too
            names += [p + "pre_mlp_layernorm.weight", p + "mlp.router.weight"]
            for j in range(spec.num_experts // ep_size):
                names += [p + f"mlp.experts.local_experts.{j}.linear_fc1.weight",
                          p + f"mlp.experts.local_experts.{j}.linear_fc2.weight"]
            if spec.has_shared_expert:
                names += [p + "mlp.shared_experts.linear_fc1.weight", p + "mlp.shared_experts.linear_fc2.weight",
                          p + "mlp.shared_experts.gate_weight"]
            continue
        names.append(p + ("mlp.linear_fc1.layer_norm_weight" if te_names else "pre_mlp_layernorm.weight"))
        names.append(p + "mlp.linear_fc1.weight")
        names.append(p + "mlp.linear_fc2.weight")
    if post_process:
        names.append("decoder.final_layernorm.weight")
        # A tied LM head on the stage that owns the embedding has no parameter of its own.
        if head != "lm" or not (spec.tie_word_embeddings and pre_process):
            names.append("output_layer.weight")
    return names


def hf_param_names(spec: HFModelSpec, *, head: HeadKind = "lm") -> list[str]:
    """Every tensor name a Hugging Face checkpoint of this spec holds (lm_head omitted when tied)."""
    names = [HF_EMBED]
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight"]
        names += [p + "self_attn.v_proj.weight"]
        if spec.qkv_bias:
            names += [p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias", p + "self_attn.v_proj.bias"]
        if spec.qk_layernorm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        names += [p + "self_attn.o_proj.weight", p + "post_attention_layernorm.weight"]
        if spec.is_moe:
            names.append(moe_hf_names(spec, i)["router"])
            for e in range(spec.num_experts):
                names += list(moe_hf_names(spec, i, e).values())
            if spec.has_shared_expert:
                names += list(shared_expert_hf_names(i).values())
            continue
        names += [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", p + "mlp.down_proj.weight"]
    names.append(HF_FINAL_NORM)
    if head != "lm":
        names.append(HF_SCORE)
    elif not spec.tie_word_embeddings:
        names.append(HF_LM_HEAD)
    return names


def read_piece(tensor: torch.Tensor, piece: HFPiece) -> torch.Tensor:
    """Slice ``piece`` out of the whole Hugging Face tensor."""
    if tuple(tensor.shape) != piece.full_shape:
        raise ValueError(
            f"Hugging Face tensor '{piece.name}' has shape {tuple(tensor.shape)}, the config implies {piece.full_shape}"
        )
    return tensor.narrow(piece.dim, piece.start, piece.stop - piece.start)


def load_shard(mapping: ParamMapping, read: Callable[[HFPiece], torch.Tensor]) -> torch.Tensor:
    """Read every piece of ``mapping`` through ``read`` and assemble the Megatron shard."""
    return assemble_shard(mapping, [read(p) for p in mapping.pieces])


def merge_pieces(pieces: Iterable[tuple[HFPiece, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Reassemble whole Hugging Face tensors from pieces (e.g. the shards of every TP rank).

    Pieces of one tensor must arrive consecutively; repeated whole pieces (replicated params
    seen from several ranks) are yielded once. Yields ``(hf_name, tensor)`` as each completes.
    """
    current: str | None = None
    parts: list[tuple[HFPiece, torch.Tensor]] = []

    def finish() -> Iterator[tuple[str, torch.Tensor]]:
        if not parts:
            return
        first = parts[0][0]
        if first.is_whole:
            yield first.name, parts[0][1]
            return
        parts.sort(key=lambda pt: pt[0].start)
        covered = 0
        chunks = []
        for piece, t in parts:
            if piece.start == piece.stop:
                continue
            if piece.start != covered:
                raise ValueError(f"pieces of '{piece.name}' leave a gap or overlap at index {covered}")
            chunks.append(t)
            covered = piece.stop
        if covered != first.full_shape[first.dim]:
            raise ValueError(f"pieces of '{first.name}' cover {covered} of {first.full_shape[first.dim]} rows")
        yield first.name, torch.cat(chunks, dim=first.dim)

    for piece, tensor in pieces:
        if piece.name != current:
            yield from finish()
            current, parts = piece.name, []
        if piece.is_whole and parts:
            continue
        parts.append((piece, tensor))
    yield from finish()
