"""Parse and validate a Hugging Face ``config.json`` into the architecture verl builds.

Only decoder-only Llama-family models are accepted: Llama 1/2/3/3.1 (incl. ``llama3`` rope
scaling), Qwen2/Qwen2.5 (qkv bias, tied embeddings), Qwen3 (per-head RMSNorm of queries and
keys, an explicit head_dim), Mistral (sliding window) and the Mixture-of-Experts families
Qwen3-MoE and Mixtral (every layer sparse: a top-k softmax router over SwiGLU experts) and Qwen2-MoE
(the same routed experts plus one shared SwiGLU expert whose output a sigmoid gate scales). Everything
the Megatron model cannot reproduce exactly fails here with a ``ValueError`` that names the
config field, so a conversion never silently produces a different network.

Both the transformers v4 layout (``rope_theta`` + ``rope_scaling``) and the v5 layout
(``rope_parameters``) are read; the raw dict is kept so conversions can write it back verbatim.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from verl.utils.logging import warn_once
from verl.utils.paths import load_json_object

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral", "qwen2_moe")
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "qwen2_moe")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, kw_only=True)
class RopeSpec:
    """Rotary position embedding parameters, normalised across transformers versions."""

    theta: float
    """Base period (``rope_theta``)."""
    rope_type: str = "default"
    """One of ``default``, ``linear``, ``llama3``."""
    factor: float = 1.0
    """Scaling factor (``linear`` and ``llama3``)."""
    low_freq_factor: float = 1.0
    """``llama3`` only: wavelengths longer than original_max/low_freq_factor are divided by factor."""
    high_freq_factor: float = 4.0
    """``llama3`` only: wavelengths shorter than original_max/high_freq_factor are kept."""
    original_max_position_embeddings: int = 8192
    """``llama3`` only: context length the model was pre-trained with."""


@dataclass(frozen=True, kw_only=True)
class HFModelSpec:
    """The architecture of a supported Hugging Face causal LM, as verl builds it."""

    model_type: str
    """One of :data:`SUPPORTED_MODEL_TYPES`."""
    vocab_size: int
    """Real (unpadded) vocabulary size."""
    hidden_size: int
    """Model width."""
    intermediate_size: int
    """SwiGLU inner width."""
    num_layers: int
    """Number of decoder layers (``num_hidden_layers``)."""
    num_attention_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (GQA groups)."""
    head_dim: int
    """Per-head width."""
    rms_norm_eps: float
    """RMSNorm epsilon."""
    rope: RopeSpec
    """Rotary embedding parameters."""
    max_position_embeddings: int
    """Longest sequence the config allows."""
    tie_word_embeddings: bool
    """LM head shares the input embedding matrix."""
    qkv_bias: bool
    """q/k/v projections carry a bias (Qwen2)."""
    qk_layernorm: bool = False
    """Queries and keys go through a per-head RMSNorm (weights ``[head_dim]``) before rotary (Qwen3)."""
    sliding_window: int | None = None
    """Attention window in tokens (Mistral), None for full causal attention."""
    num_experts: int = 0
    """Routed experts per layer (``num_experts``/``num_local_experts``); 0 for a dense model."""
    moe_topk: int = 0
    """Experts each token is sent to (``num_experts_per_tok``)."""
    moe_intermediate_size: int = 0
    """SwiGLU inner width of one expert (``moe_intermediate_size``; Mixtral: ``intermediate_size``)."""
    moe_renormalize: bool = True
    """The top-k routing weights are renormalised to sum to 1 (Mixtral always; Qwen3-MoE: ``norm_topk_prob``)."""
    router_aux_loss_coef: float = 0.0
    """Weight of the router's load-balancing loss in training (``router_aux_loss_coef``)."""
    shared_expert_intermediate_size: int = 0
    """SwiGLU inner width of the shared expert every token goes through, its output scaled by
    ``sigmoid(shared_expert_gate(x))`` (Qwen2-MoE); 0: no shared expert."""
    initializer_range: float = 0.02
    """Std of the normal init used for freshly created weights (e.g. a value head)."""
    torch_dtype: str | None = None
    """dtype recorded in the config, if any."""
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The config.json dict it was parsed from (written back by conversions)."""

    @property
    def is_moe(self) -> bool:
        """Every layer's MLP is a set of routed experts."""
        return self.num_experts > 0

    @property
    def has_shared_expert(self) -> bool:
        """Each MoE layer also has a gated shared expert (Qwen2-MoE)."""
        return self.shared_expert_intermediate_size > 0

    @property
    def q_per_group(self) -> int:
        """Query heads sharing one key/value head."""
        return self.num_attention_heads // self.num_kv_heads


def _err(source: str, field_name: str, problem: str, fix: str) -> ValueError:
    return ValueError(f"{source}: field '{field_name}' {problem}. {fix}")


def _parse_rope(cfg: dict[str, Any], source: str) -> RopeSpec:
    # transformers v5 stores everything in rope_parameters; v4 uses rope_theta + rope_scaling.
    params = cfg.get("rope_parameters")
    field_name = "rope_parameters"
    if params is None:
        params = dict(cfg.get("rope_scaling") or {})
        field_name = "rope_scaling"
        if "rope_theta" in cfg:
            params.setdefault("rope_theta", cfg["rope_theta"])
    params = dict(params)
    if "rope_theta" not in params:
        params["rope_theta"] = cfg.get("rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise _err(
            source,
            f"{field_name}.rope_type",
            f"is '{rope_type}', which verl's Megatron models do not implement",
            f"Supported: {', '.join(SUPPORTED_ROPE_TYPES)}.",
        )
    partial_field = f"{field_name}.partial_rotary_factor" if "partial_rotary_factor" in params else "partial_rotary_factor"
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise _err(
            source,
            partial_field,
            f"is {partial}",
            "Only full rotary embeddings (1.0) are supported.",
        )
    kwargs: dict[str, Any] = {"theta": float(params["rope_theta"]), "rope_type": rope_type}
    if rope_type in ("linear", "llama3"):
        if "factor" not in params:
            raise _err(source, f"{field_name}.factor", "is missing", f"'{rope_type}' needs it.")
        kwargs["factor"] = float(params["factor"])
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in params:
                raise _err(source, f"{field_name}.{key}", "is missing", "'llama3' rope needs it.")
        kwargs["low_freq_factor"] = float(params["low_freq_factor"])
        kwargs["high_freq_factor"] = float(params["high_freq_factor"])
        kwargs["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
        if kwargs["low_freq_factor"] == kwargs["high_freq_factor"]:
            raise _err(
                source,
                f"{field_name}.high_freq_factor",
                "equals low_freq_factor (the smoothing divides by their difference)",
                "Use the values the model was trained with (Llama 3.1: 1.0 and 4.0).",
            )
    return RopeSpec(**kwargs)


def _max_positions(cfg: dict[str, Any], model_type: str, source: str) -> int:
    """``max_position_embeddings``, or (with a warning) the default transformers gives ``model_type``."""
    if "max_position_embeddings" in cfg:
        return int(cfg["max_position_embeddings"])
    from transformers import AutoConfig

    default = int(AutoConfig.for_model(model_type).max_position_embeddings)
    warn_once(
        logger,
        "%s has no max_position_embeddings: using %d, the default transformers gives %s "
        "(set it in the config to silence this; it bounds the sequence length verl builds for)",
        source, default, model_type,
    )
    return default


def _parse_moe(cfg: dict[str, Any], model_type: str, source: str) -> dict[str, Any]:
    """The expert fields of a Qwen3-MoE, Qwen2-MoE or Mixtral config (HFModelSpec keyword arguments)."""
    experts_key = "num_local_experts" if "num_local_experts" in cfg else "num_experts"
    experts = cfg.get(experts_key)
    if not isinstance(experts, int) or experts <= 0:
        raise _err(source, experts_key, f"is {experts!r}", "A Mixture-of-Experts config needs a positive expert count.")
    topk = cfg.get("num_experts_per_tok")
    if not isinstance(topk, int) or not 0 < topk <= experts:
        raise _err(source, "num_experts_per_tok", f"is {topk!r}", f"It must be between 1 and the {experts} experts.")
    if model_type == "mixtral":
        if float(cfg.get("router_jitter_noise", 0.0) or 0.0) != 0.0:
            raise _err(
                source, "router_jitter_noise", f"is {cfg['router_jitter_noise']}",
                "Router noise must be 0 for RL training (trainer and rollout must route alike).",
            )
        width, renormalize = cfg["intermediate_size"], True
    else:
        width = cfg.get("moe_intermediate_size")
        if not isinstance(width, int) or width <= 0:
            raise _err(source, "moe_intermediate_size", f"is {width!r}", "It must be a positive integer.")
        renormalize = bool(cfg.get("norm_topk_prob", False))
        if int(cfg.get("decoder_sparse_step", 1) or 1) != 1 or cfg.get("mlp_only_layers"):
            field_name = "mlp_only_layers" if cfg.get("mlp_only_layers") else "decoder_sparse_step"
            raise _err(
                source, field_name, f"is {cfg[field_name]!r} (some layers dense)",
                f"verl builds {model_type} with every layer sparse (decoder_sparse_step 1, mlp_only_layers []).",
            )
    shared = 0
    if model_type == "qwen2_moe":
        shared = cfg.get("shared_expert_intermediate_size")
        if not isinstance(shared, int) or shared <= 0:
            raise _err(
                source, "shared_expert_intermediate_size", f"is {shared!r}",
                "Qwen2-MoE's shared expert needs a positive width (a model without one is a qwen3_moe-like config).",
            )
    elif cfg.get("shared_expert_intermediate_size"):
        raise _err(
            source, "shared_expert_intermediate_size", f"is set for {model_type}",
            "Only qwen2_moe configs have a (gated) shared expert; remove the field.",
        )
    return dict(
        num_experts=experts,
        moe_topk=topk,
        moe_intermediate_size=width,
        moe_renormalize=renormalize,
        router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0) or 0.0),
        shared_expert_intermediate_size=shared,
    )


def parse_hf_config(config: dict[str, Any] | str | os.PathLike, *, source: str | None = None) -> HFModelSpec:
    """Validate a Hugging Face config (dict, config.json path, or model dir) into an HFModelSpec.

    Raises ValueError naming the field for anything verl cannot reproduce exactly.
    """
    if not isinstance(config, dict):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"{path}: no Hugging Face config.json here; pass a model directory that has one.")
        config = load_json_object(path)
        source = source or path
    cfg = dict(config)
    source = source or "config"

    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise _err(
            source,
            "model_type",
            f"is '{model_type}'",
            f"verl builds Megatron models for: {', '.join(SUPPORTED_MODEL_TYPES)}"
            + (
                " (a vision-language model: the Megatron engine builds Qwen2.5-VL from its directory, "
                "verl.models.megatron_vlm; other families train with the FSDP2 engine, strategy=fsdp2)."
                if isinstance(cfg.get("vision_config"), dict)
                else "."
            ),
        )
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if not isinstance(cfg.get(key), int) or cfg[key] <= 0:
            raise _err(source, key, f"is {cfg.get(key)!r}", "It must be a positive integer.")

    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise _err(source, "hidden_act", f"is '{act}'", "Only SwiGLU (silu) MLPs are supported.")
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    if heads % kv_heads != 0:
        raise _err(
            source, "num_key_value_heads", f"({kv_heads}) does not divide num_attention_heads ({heads})", "Fix the config."
        )
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if cfg.get("head_dim") is None and cfg["hidden_size"] % heads != 0:
        raise _err(source, "hidden_size", f"({cfg['hidden_size']}) is not a multiple of num_attention_heads", "Set head_dim.")
    if cfg.get("mlp_bias", False):
        raise _err(source, "mlp_bias", "is true", "Biased MLPs are not supported.")
    for key in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop"):
        if float(cfg.get(key, 0.0) or 0.0) != 0.0:
            raise _err(source, key, f"is {cfg[key]}", "Dropout must be 0 for RL training (logprobs must be deterministic).")

    qk_layernorm = model_type in ("qwen3", "qwen3_moe")
    moe = _parse_moe(cfg, model_type, source) if model_type in MOE_MODEL_TYPES else {}
    if model_type in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe"):
        name = {"qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3-MoE", "qwen2_moe": "Qwen2-MoE"}[model_type]
        # Qwen2-MoE's configs carry the switch (``qkv_bias``, default on); Qwen2 always has q/k/v biases.
        qkv_bias = model_type == "qwen2" or (model_type == "qwen2_moe" and bool(cfg.get("qkv_bias", True)))
        if cfg.get("attention_bias", False):
            # Qwen3's attention_bias adds biases to q/k/v and o_proj; Megatron offers an o_proj bias
            # only together with biases on every linear layer. Qwen2 has q/k/v biases regardless.
            fix = "Qwen2 has q/k/v biases only; remove the field." if qkv_bias else "Biased attention is not supported."
            raise _err(source, "attention_bias", f"is true for {model_type}", fix)
        if cfg.get("use_sliding_window", False):
            raise _err(
                source,
                "use_sliding_window",
                f"is true ({name} windows only some layers, per max_window_layers)",
                "Set it to false; per-layer sliding windows are not supported.",
            )
        layer_types = cfg.get("layer_types")
        if layer_types and any(t != "full_attention" for t in layer_types):
            raise _err(
                source, "layer_types", "contains sliding-window layers", f"Only full attention is supported for {model_type}."
            )
        sliding_window = None
    else:
        if cfg.get("attention_bias", False):
            # Llama's attention_bias adds a bias to o_proj too, which Megatron only offers together
            # with biases on every linear layer.
            raise _err(source, "attention_bias", f"is true for {model_type}", "Biased attention is not supported.")
        qkv_bias = False
        sliding_window = cfg.get("sliding_window") if model_type in ("mistral", "mixtral") else None
        if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window <= 0):
            raise _err(source, "sliding_window", f"is {sliding_window!r}", "Use a positive integer or null.")

    return HFModelSpec(
        model_type=model_type,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=_parse_rope(cfg, source),
        max_position_embeddings=_max_positions(cfg, model_type, source),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_layernorm=qk_layernorm,
        sliding_window=sliding_window,
        **moe,
        initializer_range=float(cfg.get("initializer_range", 0.02)),
        torch_dtype=cfg.get("torch_dtype", cfg.get("dtype")),
        raw=cfg,
    )


def rope_inv_freq(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """Inverse rotary frequencies [head_dim // 2], float32, computed exactly as transformers does.

    Megatron-core 0.16.1 implements llama3 scaling with hard-coded low/high frequency factors and
    original context (1, 4, 8192); computing the frequencies here makes any llama3 config exact.
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponent)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        old_context = rope.original_max_position_embeddings
        low_freq_wavelen = old_context / rope.low_freq_factor
        high_freq_wavelen = old_context / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq
