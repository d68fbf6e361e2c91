"""Building an engine: the model chunks from a Hugging Face directory, the optimizer, the LR schedule.

- :func:`load_model_spec`: the HF config of ``model.path`` with ``model.override_config`` applied;
- :func:`build_trainable_chunks`: Megatron model chunks on the role's layout with the HF weights
  loaded, wrapped in Megatron's ``DistributedDataParallel`` when the role trains;
  :func:`build_vlm_chunk` the same for a Qwen2.5-VL (``verl.models.megatron_vlm``: the decoder on
  the layout, the vision tower whole beside it), after :func:`check_vlm_engine` refused, in one line,
  what it does not run;
- :func:`check_remove_padding`: ``model.use_remove_padding`` checked against the built model;
- :func:`build_optimizer` (``get_megatron_optimizer``: Adam/SGD, fp32 master weights) and
  :func:`build_scheduler` (``OptimizerParamScheduler``: linear warm-up, then constant, linear,
  cosine or inverse-square-root decay; :func:`lr_schedule_steps` resolves its lengths).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch

from verl.config.schema import MegatronConfig, ModelConfig, OptimConfig
from verl.models.builder import HF_DTYPE_NAMES, ModelBuildConfig, build_model_chunks, mark_experts_replicated_over_tp
from verl.models.checkpoint import load_hf_weights
from verl.models.hf_config import HFModelSpec, parse_hf_config
from verl.models.lora import LoRASpec, apply_lora, resolve_target_modules
from verl.utils.paths import check_model_dir, load_json_object

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

logger = logging.getLogger(__name__)

__all__ = [
    "build_optimizer",
    "build_scheduler",
    "build_trainable_chunks",
    "build_vlm_chunk",
    "check_remove_padding",
    "check_vlm_engine",
    "vlm_sharded_state_dict",
    "load_model_spec",
    "lora_spec",
    "lr_schedule_steps",
    "resolve_dtype",
]

# Megatron's names for the decay styles of OptimConfig.lr_decay_style.
_DECAY_STYLES = {
    "constant": "constant",
    "linear": "linear",
    "cosine": "cosine",
    "inverse_square_root": "inverse-square-root",
}
_SHORT_DTYPE = {hf: short for short, hf in HF_DTYPE_NAMES.items()}


def resolve_dtype(dtype: str) -> str:
    """``megatron.dtype`` -> the builder's dtype name: auto is bf16 on GPU, fp32 on CPU."""
    if dtype == "auto":
        return "bf16" if torch.cuda.is_available() else "fp32"
    return _SHORT_DTYPE[dtype]


def check_remove_padding(requested: bool, transformer_impl: str, *, cp_size: int = 1, log: bool = True) -> None:
    """Check ``model.use_remove_padding=True`` against the built model and say what it does.

    True packs each micro-batch's rows into one row of their real tokens and runs it as
    Megatron's THD packed sequences (``verl.models.packing``): Transformer Engine's attention
    takes them natively, the local spec's through verl's ``VarlenDotProductAttention``; under context
    parallelism each sequence is padded to a multiple of 2 x CP and split per sequence
    (``verl.models.cp_attention``). ``log``: say which attention runs them (False on ranks other than
    the group's first).
    """
    if not requested:
        return
    if log:
        attention = (
            "Transformer Engine's variable-length attention"
            if transformer_impl == "transformer_engine"
            else "Megatron's local attention per sequence (verl.models.varlen_attention)"
        )
        logger.info(
            "model.use_remove_padding=true: each micro-batch runs as one packed row of its real tokens "
            "(Megatron's THD layout; attention by %s)",
            attention,
        )


def lr_schedule_steps(optim: OptimConfig, total_training_steps: int) -> tuple[int, int]:
    """(warm-up steps, decay steps) of ``optim`` for a run of ``total_training_steps`` optimizer steps.

    Raises ValueError naming the fields when warm-up does not end before the decay does.
    """
    if total_training_steps < 1:
        raise ValueError(
            f"total_training_steps={total_training_steps}: the learning-rate schedule needs the run length "
            "(>= 1); the trainer fills optim.total_training_steps from the data and epochs"
        )
    warmup = optim.lr_warmup_steps
    if warmup is None:
        warmup = int(optim.lr_warmup_steps_ratio * total_training_steps)
    decay = optim.lr_decay_steps if optim.lr_decay_steps is not None else total_training_steps
    if optim.lr_decay_style == "constant":
        # Megatron's scheduler wants decay > warm-up even when nothing decays.
        decay = max(decay, warmup + 1)
    if warmup >= decay:
        raise ValueError(
            f"optim.lr_warmup_steps resolves to {warmup}, not below the decay length {decay} "
            f"(optim.lr_decay_steps={optim.lr_decay_steps}, total_training_steps={total_training_steps}); "
            "shorten the warm-up or lengthen the decay"
        )
    return warmup, decay


def lora_spec(model: ModelConfig, megatron: MegatronConfig, *, key: str = "model") -> LoRASpec | None:
    """The adapters ``model.lora_rank`` asks for (None at rank 0); ValueError naming ``key``'s
    fields when they are not valid."""
    if model.lora_rank == 0:
        return None
    try:
        return LoRASpec(
            rank=model.lora_rank,
            alpha=model.lora_alpha,
            dropout=model.lora_dropout,
            target_modules=resolve_target_modules(model.target_modules, key=f"{key}.target_modules"),
            seed=megatron.seed,
        )
    except ValueError as exc:
        raise ValueError(f"{key}.lora_*: {exc}") from None


def load_model_spec(model: ModelConfig, *, key: str = "model.path") -> HFModelSpec:
    """The Hugging Face config at ``model.path`` with ``model.override_config`` applied.

    ``key`` names the config field in errors (``critic.model.path``, ...). A Qwen2.5-VL directory
    gives its language model's spec (``verl.models.megatron_vlm.parse_vlm_config``): what the layout
    checks, the memory plan and the weight mapping read.
    """
    path = check_model_dir(model.path, key)
    config_path = os.path.join(path, "config.json")
    raw = load_json_object(config_path)
    if isinstance(raw.get("vision_config"), dict):  # a vision-language model (verl.models.megatron_vlm)
        from verl.models.megatron_vlm import parse_vlm_config

        if model.override_config:
            raise ValueError(
                f"{key.rsplit('.', 1)[0]}.override_config={dict(model.override_config)}: not applied to a vision-language "
                f"model ({config_path}); edit its config.json (text_config, vision_config) instead"
            )
        return parse_vlm_config(path).text
    raw.update(model.override_config)
    return parse_hf_config(raw, source=config_path)


def check_vlm_engine(model: ModelConfig, megatron: MegatronConfig, build: ModelBuildConfig, pg: "ProcessGroupCollection",
                     *, key: str = "model") -> None:
    """Refuse, in one line naming the fields, what the Megatron engine does not run for a vision-language
    model (before anything is built): virtual pipeline stages, context parallel, LoRA adapters,
    value/reward heads. Pipeline stages (the tower on the first), sequence parallel and packed
    sequences (``use_remove_padding``) run: each micro-batch's images go with its rows
    (``verl.models.forward``), each packed sequence gets its row's 3D positions
    (``verl.models.megatron_vlm``)."""
    problems = []
    pp, vpp, cp = pg.pp.size(), megatron.virtual_pipeline_model_parallel_size, pg.cp.size()
    if vpp is not None:
        problems.append(f"virtual_pipeline_model_parallel_size={vpp} (pipeline {pp}): set it to null")
    if cp > 1:
        problems.append(f"context_parallel_size={cp}: set it to 1")
    if model.lora_rank > 0:
        problems.append(f"{key}.lora_rank={model.lora_rank}: LoRA adapters are not built on the vision-language model")
    if build.head != "lm":
        problems.append(f"a {build.head} head (critic or reward model): only the policy head 'lm'")
    if problems:
        raise ValueError(
            f"{model.path}: the Megatron engine runs a vision-language model (Qwen2.5-VL) with TP (sequence "
            "parallel too), PP, DP and packed sequences only; "
            + "; ".join(problems) + " (docs/vlm.md)"
        )


def _ddp_wrap(chunks: list[torch.nn.Module], pg: "ProcessGroupCollection", megatron: MegatronConfig) -> list[torch.nn.Module]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=megatron.use_distributed_optimizer,
    )
    wrapped = [
        DistributedDataParallel(
            c.config,
            ddp_config,
            c,
            # Megatron's convention: only the first chunk's buffers are bucketed.
            disable_bucketing=i > 0,
            pg_collection=pg,
        )
        for i, c in enumerate(chunks)
    ]
    for chunk in wrapped:
        # The pipeline schedule calls these; forward_backward passes pg_collection through.
        chunk.config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def vlm_sharded_state_dict(model: torch.nn.Module, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
    """Megatron's sharded state dict of a ``MegatronVLM`` (the engine's checkpoint, the optimizer's state):
    the language model's under its own checkpoint keys (those of a text model's checkpoint), the vision
    tower's tensors whole under ``vision.*``, replicated over TP and DP (written once, read by any layout).
    The returned dict's keys are the module's ``state_dict`` names, so ``load_state_dict`` takes what
    ``dist_checkpointing.load`` gives back."""
    from megatron.core.utils import make_sharded_tensor_for_checkpoint

    lm = model.language_model
    out = {f"language_model.{k}": v for k, v in lm.sharded_state_dict(prefix, sharded_offsets, metadata).items()}
    if model.vision is None:
        return out
    pg = lm.pg_collection
    # keep_vars: the parameters themselves, not copies: Megatron's optimizer finds each one's state by its id.
    for name, tensor in model.vision.state_dict(keep_vars=True).items():
        out[f"vision.{name}"] = make_sharded_tensor_for_checkpoint(
            tensor, f"{prefix}vision.{name}", tp_group=pg.tp, dp_cp_group=pg.dp_cp
        )
    return out


def build_vlm_chunk(
    build: ModelBuildConfig,
    hf_dir: str,
    pg: "ProcessGroupCollection",
    *,
    device: torch.device,
    megatron: MegatronConfig,
    trainable: bool,
    freeze_vision_tower: bool,
) -> list[torch.nn.Module]:
    """The one model chunk of a Qwen2.5-VL (``verl.models.megatron_vlm.MegatronVLM``: the decoder's TP
    shard, the vision tower whole) with the weights of ``hf_dir``; DDP-wrapped when ``trainable``
    (a frozen tower takes no gradient buffer and no optimizer state), frozen otherwise."""
    import types

    from verl.models.megatron_vlm import build_megatron_vlm

    model = build_megatron_vlm(hf_dir, build, pg, freeze_vision_tower=freeze_vision_tower or not trainable)
    # What the engine's checkpoint and Megatron's optimizer state read of a chunk (vlm_sharded_state_dict).
    model.sharded_state_dict = types.MethodType(vlm_sharded_state_dict, model)
    if device.type == "cuda":
        model = model.to(device)
    if not trainable:
        model.requires_grad_(False)
        model.eval()
        return [model]
    return _ddp_wrap([model], pg, megatron)


def build_trainable_chunks(
    spec: HFModelSpec,
    build: ModelBuildConfig,
    hf_dir: str,
    pg: "ProcessGroupCollection",
    *,
    device: torch.device,
    vpp_size: int | None,
    megatron: MegatronConfig,
    trainable: bool,
    lora: LoRASpec | None = None,
) -> list[torch.nn.Module]:
    """This rank's model chunks with the weights of ``hf_dir``; DDP-wrapped when ``trainable``,
    frozen (no grads, eval mode) otherwise. With ``lora``, adapters are added after the base
    weights are loaded and only they (and a value/reward head) train (``verl.models.lora``)."""
    chunks = build_model_chunks(spec, build, pg, vpp_size=vpp_size)
    if device.type == "cuda":
        chunks = [c.to(device) for c in chunks]
    load_hf_weights(chunks, hf_dir, pg=pg)
    if lora is not None:
        apply_lora(chunks, lora, pg, trainable_head=build.head != "lm")
    if not trainable:
        for chunk in chunks:
            chunk.requires_grad_(False)
            chunk.eval()
        return chunks
    mark_experts_replicated_over_tp(chunks, pg)
    return _ddp_wrap(chunks, pg, megatron)


def build_optimizer(
    optim: OptimConfig,
    chunks: list[torch.nn.Module],
    pg: "ProcessGroupCollection",
    *,
    dtype: torch.dtype,
    use_distributed_optimizer: bool,
):
    """Megatron's optimizer over the DDP-wrapped ``chunks`` (gradient clipping is the engine's)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    if len(optim.betas) != 2:
        raise ValueError(f"optim.betas must hold two numbers (beta1, beta2), got {optim.betas}")
    config = OptimizerConfig(
        optimizer=optim.optimizer,
        lr=optim.lr,
        min_lr=optim.lr * optim.min_lr_ratio,
        weight_decay=optim.weight_decay,
        adam_beta1=float(optim.betas[0]),
        adam_beta2=float(optim.betas[1]),
        adam_eps=optim.eps,
        sgd_momentum=0.0,
        # Clipping is done by verl.engine.step.optimizer_step (Megatron's asserts CUDA tensors).
        clip_grad=0.0,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    logger.debug(
        "Megatron's OptimizerConfig has clip_grad=0.0 because verl clips the gradient norm itself "
        "(optim.clip_grad=%g)", optim.clip_grad,
    )
    optimizer = get_megatron_optimizer(config, chunks, use_gloo_process_groups=False, pg_collection=pg)
    for chunk in chunks:
        chunk.config.grad_scale_func = optimizer.scale_loss
    return optimizer


def build_scheduler(optimizer, optim: OptimConfig, total_training_steps: int):
    """The LR / weight-decay schedule of ``optim`` for a run of ``total_training_steps`` updates."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    warmup, decay = lr_schedule_steps(optim, total_training_steps)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup > 0 else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.lr * optim.min_lr_ratio,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style=_DECAY_STYLES[optim.lr_decay_style],
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=decay,
        wd_incr_style="constant",
        # A resumed run continues the saved schedule.
        use_checkpoint_opt_param_scheduler=True,
    )
    # Megatron's schedule gives position 0 the initial lr (0 with warm-up); starting at 1
    # makes the k-th update use position k, so no update is spent at lr 0 and the last one
    # (k = decay steps) reaches min_lr.
    scheduler.step(1)
    return scheduler
