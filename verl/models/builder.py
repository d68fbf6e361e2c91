"""Build Megatron-core GPT models (actor, critic, reward model) from a Hugging Face config.

Parallelism comes from outside: pass the ``ProcessGroupCollection`` that
``verl.parallel.megatron_state.initialize_model_parallel`` returned. The builder only decides
what each pipeline stage holds (``pre_process``/``post_process``, its layers) and logs it.

Choices that keep the model numerically equal to transformers':

- the local layer spec uses verl's :class:`RMSNorm` (fp32 statistics, cast, then weight: the
  transformers formula), which also works under sequence parallel (weights tagged
  ``sequence_parallel`` so ``finalize_model_grads`` sums their grads over TP);
- rotary inverse frequencies are computed by :func:`verl.models.hf_config.rope_inv_freq` and
  installed on the model (Megatron-core 0.16.1 hard-codes part of llama3 scaling);
- Qwen3's per-head query/key norms are verl's :class:`RMSNorm` too (``qk_layernorm``);
- Mistral's sliding window becomes ``window_size=(window - 1, 0)`` (a token sees itself and the
  ``window - 1`` before it, as in transformers).

The Transformer Engine spec is used when ``transformer_engine`` imports (``transformer_impl``
"auto"); it is not exercised on CPU machines, where TE cannot be installed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F

from verl.models.hf_config import HFModelSpec, rope_inv_freq
from verl.models.pipeline_split import PipelineSplit, normalize_layout, resolve_split
from verl.models.weight_mapping import HeadKind, padded_vocab_size
from verl.utils.logging import log_rank0

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

logger = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""verl's short dtype names -> torch dtypes."""
HF_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""verl's short dtype names -> the names of Hugging Face configs (``torch_dtype``) and ``megatron.dtype``."""


@dataclass(kw_only=True)
class ModelBuildConfig:
    """How to build the Megatron model for one role (everything not in the HF config)."""

    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Parameter and compute dtype."""
    head: HeadKind = "lm"
    """``lm`` (actor/reference), ``value`` (critic: one value per token) or ``reward`` (reward model)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs TP > 1 to have an effect)."""
    vocab_pad_multiple: int | None = None
    """Vocabulary rows are padded to a multiple of this times the TP size; None: vLLM's padding
    (``weight_mapping.padded_vocab_size``), which keeps the hybrid engine's TP == TP' push local."""
    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"
    """Layer implementation; ``auto`` picks Transformer Engine when it imports, else local."""
    recompute_activations: bool = False
    """Full activation recomputation of every layer (saves memory on long sequences)."""
    max_sequence_length: int | None = None
    """Longest sequence the model will see; None takes ``max_position_embeddings`` from the config."""
    init_weights: bool = True
    """Randomly initialise parameters; False leaves them uninitialised (every one is about to be loaded)."""
    meta_device: bool = False
    """Build on the meta device: real shapes, no storage (the ``--dry-run`` memory plan); implies no init."""
    moe_aux_loss_coeff: float | None = None
    """Mixture-of-Experts load-balancing loss weight; None: the config's ``router_aux_loss_coef``."""
    num_layers_in_first_pipeline_stage: int | None = None
    """Layers on the first pipeline stage (uneven split); None: uniform, or chosen automatically when the
    layers do not divide the pipeline (``verl.models.pipeline_split``)."""
    num_layers_in_last_pipeline_stage: int | None = None
    """Layers on the last pipeline stage (uneven split); None as for the first stage."""
    moe_enable_routing_replay: bool = False
    """Mixture-of-Experts routers that can record and replay their choices (``verl.models.router_replay``)."""
    pipeline_model_parallel_layout: str | None = None
    """Megatron's explicit layout of every chunk's layers (e.g. ``Et|tt|t|tL``: 5 layers on PP 2 x VPP 2);
    a list of lists of layer types is turned into the string. Excludes the first/last counts."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"ModelBuildConfig.dtype={self.dtype!r}; use one of {sorted(DTYPES)}")
        if self.head not in ("lm", "value", "reward"):
            raise ValueError(f"ModelBuildConfig.head={self.head!r}; use 'lm', 'value' or 'reward'")
        if self.transformer_impl not in ("auto", "local", "transformer_engine"):
            raise ValueError(
                f"ModelBuildConfig.transformer_impl={self.transformer_impl!r}; use 'auto', 'local' or 'transformer_engine'"
            )
        self.pipeline_model_parallel_layout = normalize_layout(self.pipeline_model_parallel_layout)
        if self.vocab_pad_multiple is not None and self.vocab_pad_multiple < 1:
            raise ValueError(f"ModelBuildConfig.vocab_pad_multiple={self.vocab_pad_multiple}; it must be >= 1")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of ``dtype``."""
        return DTYPES[self.dtype]


def transformer_engine_available() -> bool:
    """Whether Transformer Engine's PyTorch package can be imported."""
    return importlib.util.find_spec("transformer_engine") is not None


def _use_te(cfg: ModelBuildConfig) -> bool:
    if cfg.transformer_impl == "local":
        return False
    available = transformer_engine_available()
    if cfg.transformer_impl == "transformer_engine" and not available:
        raise ValueError(
            "ModelBuildConfig.transformer_impl='transformer_engine' but transformer_engine is not installed; "
            "use 'local' or 'auto'"
        )
    return available


class RMSNorm(torch.nn.Module):
    """RMSNorm computed as transformers does (fp32 statistics, cast back, then scale).

    Built by Megatron's layer spec as ``RMSNorm(config=..., hidden_size=..., eps=...)``. Under
    sequence parallel each TP rank normalises its own slice of the sequence; the weight is tagged
    ``sequence_parallel`` so Megatron's ``finalize_model_grads`` sums its grads over TP.
    """

    def __init__(self, config: "TransformerConfig", hidden_size: int, eps: float = 1e-6, **_: object) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        if config.sequence_parallel:
            self.weight.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [S, B, H] -> [S, B, H]
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def split_problems(
    spec: HFModelSpec,
    *,
    tp_size: int,
    pp_size: int,
    cp_size: int = 1,
    vpp_size: int | None = None,
    ep_size: int = 1,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    pipeline_layout: str | None = None,
) -> list[str]:
    """Why ``spec`` cannot be split over these parallel degrees (one message per HF field); [] if it can.

    Layers that do not divide the pipeline are split unevenly (``verl.models.pipeline_split``); the
    given first/last stage counts or explicit layout are checked against Megatron's rules."""
    problems = []
    if spec.is_moe and spec.num_experts % ep_size:
        problems.append(f"num_experts={spec.num_experts} is not divisible by expert parallel {ep_size}")
    if not spec.is_moe and ep_size != 1:
        problems.append(f"expert parallel {ep_size} needs a Mixture-of-Experts model ({spec.model_type} is dense; use 1)")
    if spec.num_kv_heads % tp_size:
        problems.append(f"num_key_value_heads={spec.num_kv_heads} is not divisible by tensor parallel {tp_size}")
    if spec.num_attention_heads % tp_size:
        problems.append(f"num_attention_heads={spec.num_attention_heads} is not divisible by tensor parallel {tp_size}")
    if spec.intermediate_size % tp_size and not spec.is_moe:  # experts are whole (expert TP 1)
        problems.append(f"intermediate_size={spec.intermediate_size} is not divisible by tensor parallel {tp_size}")
    if spec.shared_expert_intermediate_size % tp_size:  # the shared expert is a dense MLP, split over TP
        problems.append(
            f"shared_expert_intermediate_size={spec.shared_expert_intermediate_size} is not divisible by tensor parallel {tp_size}"
        )
    try:
        resolve_split(spec.num_layers, pp_size, vpp_size, first_stage_layers, last_stage_layers, pipeline_layout)
    except ValueError as exc:
        problems.append(str(exc))
    problems += context_parallel_problems(spec, cp_size)
    return problems


def context_parallel_problems(spec: HFModelSpec, cp_size: int) -> list[str]:
    """Why ``spec`` cannot run at context parallel ``cp_size`` (one message, the fix included); [] if it can."""
    if cp_size > 1 and spec.is_moe:
        return [
            f"context parallelism (CP {cp_size}) is supported for dense models only and {spec.model_type} is a "
            "Mixture-of-Experts model (its routers, load-balancing loss and expert gradients are not checked across "
            "context-parallel ranks): set context_parallel_size=1; for long sequences use tensor parallel with "
            "sequence_parallel=true, or model.enable_gradient_checkpointing=true"
        ]
    return []


def transformer_config_from_hf(
    spec: HFModelSpec,
    cfg: ModelBuildConfig,
    *,
    tp_size: int,
    pp_size: int,
    cp_size: int = 1,
    vpp_size: int | None = None,
    ep_size: int = 1,
) -> "TransformerConfig":
    """The Megatron ``TransformerConfig`` that reproduces ``spec`` at the given parallel degrees.

    Raises ValueError naming the HF field when the degrees cannot split the model.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    problems = split_problems(
        spec, tp_size=tp_size, pp_size=pp_size, cp_size=cp_size, vpp_size=vpp_size, ep_size=ep_size,
        first_stage_layers=cfg.num_layers_in_first_pipeline_stage,
        last_stage_layers=cfg.num_layers_in_last_pipeline_stage,
        pipeline_layout=cfg.pipeline_model_parallel_layout,
    )
    if problems:
        raise ValueError(f"{spec.model_type} config cannot be split as requested: " + "; ".join(problems))
    if cfg.moe_enable_routing_replay and not spec.is_moe:
        raise ValueError(
            f"moe_enable_routing_replay=true on a dense {spec.model_type} model: it has no routers; remove the key"
        )

    cuda = torch.cuda.is_available()
    dtype = cfg.torch_dtype
    use_te = _use_te(cfg)
    kwargs = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        rotary_interleaved=False,
        init_method_std=spec.initializer_range,
        attention_softmax_in_fp32=True,
        # Fusions that need apex / Transformer Engine kernels.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=not cuda or cfg.meta_device,  # meta: no device is touched
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        virtual_pipeline_model_parallel_size=vpp_size,
        context_parallel_size=cp_size,
        sequence_parallel=cfg.sequence_parallel and tp_size > 1,
        # HF sliding window w: token i attends to j with i - w < j <= i.
        window_size=(spec.sliding_window - 1, 0) if spec.sliding_window is not None else None,
        transformer_impl="transformer_engine" if use_te else "local",
        perform_initialization=cfg.init_weights and not cfg.meta_device,
        init_model_with_meta_device=cfg.meta_device,
    )
    kwargs.update(pipeline_split_of(spec, cfg, pp_size=pp_size, vpp_size=vpp_size).megatron_kwargs())
    if spec.is_moe:
        kwargs.update(moe_config_kwargs(spec, cfg, ep_size=ep_size))
    if cfg.recompute_activations:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return TransformerConfig(**kwargs)


def pipeline_split_of(spec: HFModelSpec, cfg: ModelBuildConfig, *, pp_size: int, vpp_size: int | None) -> PipelineSplit:
    """The layers of each pipeline stage: ``cfg``'s layout or first/last counts, or automatic ones (uneven layers)."""
    return resolve_split(
        spec.num_layers, pp_size, vpp_size, cfg.num_layers_in_first_pipeline_stage, cfg.num_layers_in_last_pipeline_stage,
        cfg.pipeline_model_parallel_layout,
    )


def moe_config_kwargs(spec: HFModelSpec, cfg: ModelBuildConfig, *, ep_size: int) -> dict:
    """Megatron's MoE settings that route and weigh tokens as transformers does.

    Mixtral and Qwen3-MoE with ``norm_topk_prob``: the top-k of the logits, softmax over those k
    (= transformers' softmax, top-k, renormalise). Qwen3-MoE without it: softmax over every expert,
    then the top-k probabilities as they are (``moe_router_pre_softmax``). Experts are whole on their
    expert-parallel rank (expert TP 1; Megatron's ``SequentialMLP``, no grouped GEMM) and tokens
    travel by all-to-all. The load-balancing loss weighs ``router_aux_loss_coef`` unless
    ``cfg.moe_aux_loss_coeff`` overrides it; 0 turns it off.

    Qwen2-MoE's shared expert is Megatron's ``SharedExpertMLP`` with its gate
    (``moe_shared_expert_gate``: ``sigmoid(x @ gate_weight.T)`` [tokens, 1] scales the expert's output,
    transformers' ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``), a dense SwiGLU MLP split
    over TP; it runs before the router, not overlapped with the dispatch.
    """
    coeff = spec.router_aux_loss_coef if cfg.moe_aux_loss_coeff is None else cfg.moe_aux_loss_coeff
    shared = (
        dict(moe_shared_expert_intermediate_size=spec.shared_expert_intermediate_size, moe_shared_expert_gate=True)
        if spec.has_shared_expert
        else {}
    )
    return dict(
        **shared,
        num_moe_experts=spec.num_experts,
        moe_router_topk=spec.moe_topk,
        moe_ffn_hidden_size=spec.moe_intermediate_size,
        moe_router_pre_softmax=not spec.moe_renormalize,
        moe_router_load_balancing_type="aux_loss" if coeff > 0 else "none",
        moe_aux_loss_coeff=coeff,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        expert_model_parallel_size=ep_size,
        expert_tensor_parallel_size=1,
        moe_enable_routing_replay=cfg.moe_enable_routing_replay,
    )


def local_layer_spec(config: "TransformerConfig", *, vp_stage: int | None, pp_rank: int, num_layers: int | None = None):
    """Megatron's local (no Transformer Engine) block spec of this stage with verl's :class:`RMSNorm`.

    Megatron's own local norm (``WrappedTorchNorm``) refuses sequence parallel; verl's computes
    the transformers formula and tags its weight for sequence parallel. The core attention is
    Megatron's, extended to packed (THD) sequences (``verl.models.packing``) and to context
    parallelism (``verl.models.cp_attention``); unpacked calls at CP 1 are Megatron's own. ``num_layers`` None: Megatron's count for this chunk.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from verl.models.cp_attention import ContextParallelAttention

    layer = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=False, normalization="RMSNorm"
    )
    layer.submodules.self_attention.submodules.core_attention = ContextParallelAttention
    layer.submodules.input_layernorm = RMSNorm
    layer.submodules.pre_mlp_layernorm = RMSNorm
    if config.qk_layernorm:
        # Per-head norms of queries and keys (Qwen3): replicated over TP; Megatron's
        # finalize_model_grads sums their grads over TP (each rank saw its own heads only).
        layer.submodules.self_attention.submodules.q_layernorm = RMSNorm
        layer.submodules.self_attention.submodules.k_layernorm = RMSNorm
    n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank) if num_layers is None else num_layers
    return TransformerBlockSubmodules(layer_specs=[layer] * n, layer_norm=RMSNorm)


def _layer_spec(config: "TransformerConfig", split: PipelineSplit, *, use_te: bool, vp_stage: int | None, pp_rank: int):
    # megatron-core 0.16.1 counts an explicit layout's layers at parallel_state's pipeline rank and
    # virtual size, not at pp_rank (the dry run builds every stage from one process): verl's split
    # (the same table, compared in tests/models/test_uneven_pipeline.py) gives the count.
    num_layers = split.chunk_range(pp_rank, vp_stage)[1] if split.chunks is not None else None
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        return get_gpt_decoder_block_spec(
            config, use_transformer_engine=True, normalization="RMSNorm", vp_stage=vp_stage, pp_rank=pp_rank
        )
    return local_layer_spec(config, vp_stage=vp_stage, pp_rank=pp_rank, num_layers=num_layers)


def build_gpt_model(
    spec: HFModelSpec,
    cfg: ModelBuildConfig,
    pg: "ProcessGroupCollection",
    *,
    vp_stage: int | None = None,
    vpp_size: int | None = None,
    mrope_section: list[int] | None = None,
) -> "GPTModel":
    """One model chunk of this rank's pipeline stage (``vp_stage`` with interleaving).

    Weights are freshly initialised; load them with ``verl.models.checkpoint``. For
    ``cfg.head`` ``value``/``reward`` the LM head is replaced by a :class:`ScalarHead`.
    ``mrope_section`` (temporal, height, width shares of the rotary half-dimension): multimodal
    rotary positions (``position_embedding_type="mrope"``; the model then takes position ids
    [3, B, S], ``verl.models.megatron_vlm``).
    """
    from megatron.core.models.gpt import GPTModel

    from verl.models.heads import ScalarHead

    tp_size, pp_size = pg.tp.size(), pg.pp.size()
    pp_rank = pg.pp.rank()
    ep_size = pg.ep.size() if getattr(pg, "ep", None) is not None else 1
    config = transformer_config_from_hf(
        spec, cfg, tp_size=tp_size, pp_size=pp_size, cp_size=pg.cp.size(), vpp_size=vpp_size, ep_size=ep_size
    )
    if mrope_section is not None:
        if sum(mrope_section) != spec.head_dim // 2:
            raise ValueError(
                f"rope_scaling.mrope_section {list(mrope_section)} sums to {sum(mrope_section)}, not head_dim / 2 = "
                f"{spec.head_dim // 2}; fix the config"
            )
        config.mrope_section = list(mrope_section)
    if spec.is_moe:
        _megatron_moe_without_te()
    use_te = config.transformer_impl == "transformer_engine"
    pre_process = pp_rank == 0 and (vp_stage is None or vp_stage == 0)
    post_process = pp_rank == pp_size - 1 and (vp_stage is None or vp_stage == (vpp_size or 1) - 1)
    padded = padded_vocab_size(spec.vocab_size, tp_size, cfg.vocab_pad_multiple)
    tie = spec.tie_word_embeddings and cfg.head == "lm"
    split = pipeline_split_of(spec, cfg, pp_size=pp_size, vpp_size=vpp_size)  # every stage's layers
    inv_freq = rope_inv_freq(spec.rope, spec.head_dim)  # outside the meta context: real values
    with torch.device("meta") if cfg.meta_device else contextlib.nullcontext():
        model = GPTModel(
            config=config,
            transformer_layer_spec=_layer_spec(config, split, use_te=use_te, vp_stage=vp_stage, pp_rank=pp_rank),
            vocab_size=padded,
            max_sequence_length=cfg.max_sequence_length or spec.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            parallel_output=True,
            share_embeddings_and_output_weights=tie,
            position_embedding_type="rope" if mrope_section is None else "mrope",
            rotary_base=spec.rope.theta,
            pg_collection=pg,
            vp_stage=vp_stage,
        )
        if post_process and cfg.head != "lm":
            model.output_layer = ScalarHead(config, pg=pg, init_std=spec.initializer_range)
    if spec.has_shared_expert and torch.cuda.is_available() and not cfg.meta_device:
        # megatron-core 0.16.1 creates the shared expert's gate weight on the CPU whatever the
        # initialisation device (its SharedExpertMLP has no GPU initialisation); move it beside the rest.
        for layer in model.decoder.layers:
            gate = layer.mlp.shared_experts.gate_weight
            gate.data = gate.data.to(torch.cuda.current_device())
    # Exact transformers frequencies for every supported rope type (see module docstring).
    model.rotary_pos_emb.inv_freq = inv_freq.to(model.rotary_pos_emb.inv_freq.device)
    if hasattr(model.rotary_pos_emb.forward, "cache_clear"):  # mrope's embedding keeps no cache
        model.rotary_pos_emb.forward.cache_clear()
    # Bookkeeping the loaders and the forward pass read.
    model.verl_spec = spec
    model.verl_build = cfg
    model.verl_padded_vocab = padded
    model.verl_split = split
    model.verl_layer_offset = _layer_offset(config, split, vp_stage, pp_rank)
    model.verl_ep = (pg.ep.rank() if ep_size > 1 else 0, ep_size)  # (expert-parallel rank, size)
    log_rank0(
        logger,
        logging.INFO,
        "built %s %s chunk: pp_rank=%d vp_stage=%s layers %d..%d of %d, pre=%s post=%s, vocab %d->%d, tp=%d, %s spec, %s",
        spec.model_type,
        cfg.head,
        pp_rank,
        vp_stage,
        model.verl_layer_offset,
        model.verl_layer_offset + len(model.decoder.layers) - 1,
        spec.num_layers,
        pre_process,
        post_process,
        spec.vocab_size,
        padded,
        tp_size,
        "TE" if use_te else "local",
        cfg.dtype,
        group=pg.tp,
    )
    return model


def _megatron_moe_without_te() -> None:
    """megatron-core 0.16.1's ``moe_utils`` reads ``te_general_gemm`` in the router's gating
    (``RouterGatingLinearFunction``) but defines it only when Transformer Engine imports: without
    TE (every CPU machine; a GPU image without TE) the router fails with NameError. Defining it as
    None selects Megatron's own ``torch.matmul`` branch. Checked against megatron-core 0.16.1; a
    version that defines the name is left alone."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def unwrap_model(module: torch.nn.Module) -> "GPTModel":
    """The verl-built GPTModel inside ``module`` (DDP and other wrappers expose it as ``.module``)."""
    while not hasattr(module, "verl_spec") and hasattr(module, "module"):
        module = module.module
    if not hasattr(module, "verl_spec"):
        raise ValueError("model chunk was not built by verl.models.builder (no verl_spec attribute)")
    return module


def _layer_offset(config: "TransformerConfig", split: PipelineSplit, vp_stage: int | None, pp_rank: int) -> int:
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if split.chunks is not None:
        # megatron-core 0.16.1 reads the layout's offset at parallel_state's pipeline rank, whatever
        # pp_rank says; the split is the same table (tests/models/test_uneven_pipeline.py compares them).
        return split.chunk_range(pp_rank, vp_stage)[0]
    return get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)


def mark_experts_replicated_over_tp(chunks: list["GPTModel"], pg: "ProcessGroupCollection") -> None:
    """Before DDP wraps trainable ``chunks``: at TP > 1 and EP 1 with sequence parallel, give the
    experts Megatron's expert-parallel marking. Nothing to do at TP 1 or EP > 1.

    verl builds experts whole (expert TP 1), so at EP 1 each TP rank holds every expert. Under
    sequence parallel (which Megatron requires for MoE training at TP > 1) each rank routes its own
    slice of the tokens, so its expert gradients are partial sums. megatron-core 0.16.1 marks expert
    parameters ``allreduce = not (is_expert and expert_model_parallel_size > 1)``: at EP 1 DDP
    reduced them over data parallel only and the TP copies drifted apart. ``allreduce=False`` (read
    by DDP and by the optimizer's parameter groups) puts them in DDP's expert buffers, reduced over
    the expert-data-parallel group, which at expert TP 1 spans the TP ranks: the sum over the
    slices, scaled by 1/dp like every gradient, as at EP > 1.

    The gradient norm verl clips by (the optimizer's, ``verl.engine.step``) then counts each expert
    once, as at EP > 1: the expert optimizer reduces its statistics over expert TP x EP x PP (at
    EP 1 the pipeline stages, not the TP copies), or, with the distributed optimizer, over all ranks
    with each shard of the expert-data-parallel group counted once.
    """
    ep_size = pg.ep.size() if getattr(pg, "ep", None) is not None else 1
    if ep_size > 1 or pg.tp.size() == 1:
        return
    for chunk in chunks:
        if not (unwrap_model(chunk).verl_spec.is_moe and chunk.config.sequence_parallel):
            continue
        for name, param in chunk.named_parameters():
            if ".mlp.experts." in name:
                param.allreduce = False


def build_model_chunks(
    spec: HFModelSpec,
    cfg: ModelBuildConfig,
    pg: "ProcessGroupCollection",
    *,
    vpp_size: int | None = None,
) -> list["GPTModel"]:
    """Every model chunk this rank holds: one without interleaving, ``vpp_size`` with it."""
    if vpp_size is None:
        return [build_gpt_model(spec, cfg, pg)]
    return [build_gpt_model(spec, cfg, pg, vp_stage=i, vpp_size=vpp_size) for i in range(vpp_size)]


def verify_model_matches_spec(chunk: "GPTModel", pg: "ProcessGroupCollection") -> None:
    """Check a built chunk against its Hugging Face config; ValueError naming the HF field.

    Guards conversions against a builder or mapping that drifts from the config: every
    architectural number, the rotary frequencies, and every parameter's shard shape.
    """
    from verl.models.weight_mapping import param_mapping

    spec: HFModelSpec = chunk.verl_spec
    c = chunk.config
    pairs = [
        ("num_hidden_layers", spec.num_layers, c.num_layers),
        ("hidden_size", spec.hidden_size, c.hidden_size),
        ("num_attention_heads", spec.num_attention_heads, c.num_attention_heads),
        ("num_key_value_heads", spec.num_kv_heads, c.num_query_groups),
        ("head_dim", spec.head_dim, c.kv_channels),
        ("intermediate_size", spec.intermediate_size, c.ffn_hidden_size),
        ("rms_norm_eps", spec.rms_norm_eps, c.layernorm_epsilon),
        ("attention_bias (q/k/v bias)", spec.qkv_bias, c.add_qkv_bias),
        ("model_type (q/k norm)", spec.qk_layernorm, c.qk_layernorm),
        ("num_experts", spec.num_experts or None, c.num_moe_experts),
        ("num_experts_per_tok", spec.moe_topk if spec.is_moe else 2, c.moe_router_topk),
        ("moe_intermediate_size", spec.moe_intermediate_size if spec.is_moe else None,
         c.moe_ffn_hidden_size if spec.is_moe else None),
        ("shared_expert_intermediate_size", spec.shared_expert_intermediate_size or None,
         c.moe_shared_expert_intermediate_size),
        ("shared_expert_gate", spec.has_shared_expert, bool(c.moe_shared_expert_gate and c.moe_shared_expert_intermediate_size)),
        ("sliding_window", spec.sliding_window, None if c.window_size is None else c.window_size[0] + 1),
        ("hidden_act", "silu", "silu" if c.activation_func is F.silu and c.gated_linear_unit else "other"),
    ]
    for field_name, expected, actual in pairs:
        if expected != actual:
            raise ValueError(f"built model disagrees with config.json field '{field_name}': config {expected}, model {actual}")
    expected_freq = rope_inv_freq(spec.rope, spec.head_dim)
    if not torch.equal(chunk.rotary_pos_emb.inv_freq.cpu(), expected_freq):
        raise ValueError("built model's rotary frequencies disagree with config.json fields 'rope_theta'/'rope_scaling'")
    tp_rank, tp_size = pg.tp.rank(), pg.tp.size()
    for name, param in chunk.named_parameters():
        mapping = param_mapping(
            name,
            spec,
            tp_rank=tp_rank,
            tp_size=tp_size,
            padded_vocab=chunk.verl_padded_vocab,
            layer_offset=chunk.verl_layer_offset,
            head=chunk.verl_build.head,
            ep_rank=chunk.verl_ep[0],
            ep_size=chunk.verl_ep[1],
        )
        if tuple(param.shape) != mapping.shard_shape:
            fields = ", ".join(sorted({p.name for p in mapping.pieces}))
            raise ValueError(
                f"parameter '{name}' has shape {tuple(param.shape)} but config.json implies {mapping.shard_shape} "
                f"(from {fields})"
            )
