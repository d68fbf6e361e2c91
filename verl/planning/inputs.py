"""A PPO/GRPO config -> the memory model's inputs (one reading, shared by the dry run and plan.py)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import TYPE_CHECKING

from verl.config.loader import CONFIG_DIR
from verl.models.hf_config import HFModelSpec, parse_hf_config
from verl.models.pipeline_split import stage_layer_overrides
from verl.planning.memory import DEFAULT_RESERVE_GIB, MegatronRole, PlanInputs, RolloutSetup
from verl.planning.vision import VisionTower

if TYPE_CHECKING:
    from verl.config.schema import FSDPConfig, MegatronConfig, PPOConfig

__all__ = ["MODEL_CONFIG_DIR", "inputs_from_config", "load_spec", "named_model_configs"]

MODEL_CONFIG_DIR = str(CONFIG_DIR / "models")
"""Hugging Face config.json files of the recipes' models (``llama3_70b``, ``qwen2_7b``, ``qwen3_30b_a3b``): what a dry run
reads on a machine without the weights."""

_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def named_model_configs() -> dict[str, str]:
    """Name -> path of every config in :data:`MODEL_CONFIG_DIR`."""
    if not os.path.isdir(MODEL_CONFIG_DIR):
        return {}
    return {f[:-5]: os.path.join(MODEL_CONFIG_DIR, f) for f in sorted(os.listdir(MODEL_CONFIG_DIR)) if f.endswith(".json")}


def load_spec(model: str, *, override: dict | None = None, what: str = "--model") -> HFModelSpec:
    """The model of a config.json file, a model directory holding one, or a name of
    :func:`named_model_configs`; ValueError naming ``what`` otherwise."""
    path = model
    if os.path.isdir(model):
        path = os.path.join(model, "config.json")
    elif not os.path.isfile(model):
        named = named_model_configs()
        if model not in named:
            raise ValueError(
                f"{what}={model!r} is neither a config.json, a model directory nor a known model "
                f"({', '.join(named) or 'none'} in {MODEL_CONFIG_DIR})"
            )
        path = named[model]
    if not os.path.isfile(path):
        raise ValueError(f"{what}={model!r}: no config.json at {path}")
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    if isinstance(raw.get("vision_config"), dict):  # a vision-language model: its language model's shapes
        from verl.models.megatron_vlm import parse_vlm_config

        if override:
            raise ValueError(f"{what}={model!r}: override_config is not applied to a vision-language model; edit its config.json")
        return parse_vlm_config(os.path.dirname(os.path.abspath(path))).text
    raw.update(override or {})
    return parse_hf_config(raw, source=path)


def _dtype_bytes(dtype: str, device: str) -> int:
    if dtype == "auto":
        return 4 if device == "cpu" else 2  # as verl.engine.build.resolve_dtype on that device
    return _BYTES[dtype]


def _megatron_role(name: str, m: "MegatronConfig", *, device: str, **kw) -> MegatronRole:
    return MegatronRole(
        name=name,
        tp=m.tensor_model_parallel_size,
        pp=m.pipeline_model_parallel_size,
        cp=m.context_parallel_size,
        vpp=m.virtual_pipeline_model_parallel_size,
        sequence_parallel=m.sequence_parallel,
        dtype_bytes=_dtype_bytes(m.dtype, device),
        distributed_optimizer=m.use_distributed_optimizer,
        offload_params=m.param_offload,
        offload_grads=m.grad_offload,
        offload_optimizer=m.optimizer_offload,
        ep=m.expert_model_parallel_size,
        **stage_layer_overrides(m.override_transformer_config),
        **kw,
    )


def _fsdp_role(name: str, f: "FSDPConfig", *, device: str, **kw) -> MegatronRole:
    """An FSDP2 role (strategy=fsdp2): DP over every rank, dtypes and offload from ``fsdp_config``."""
    compute = _dtype_bytes(f.mixed_precision.param_dtype, device)
    return MegatronRole(
        name=name, tp=1, pp=1, fsdp=True, fsdp_param_bytes=compute, fsdp_reshard_after_forward=f.reshard_after_forward,
        fsdp_size=f.fsdp_size,
        dtype_bytes=compute if f.model_dtype == "auto" else _dtype_bytes(f.model_dtype, device),
        offload_params=f.param_offload, offload_grads=f.param_offload, offload_optimizer=f.optimizer_offload, **kw,
    )


def _role(name: str, strategy: str, m: "MegatronConfig", f: "FSDPConfig", *, device: str, **kw) -> MegatronRole:
    """The role's memory layout on its strategy's engine."""
    if strategy == "fsdp2":
        return _fsdp_role(name, f, device=device, **kw)
    return _megatron_role(name, m, device=device, **kw)


def _lora_role_settings(model) -> dict:
    """A role's ``lora_rank`` / ``lora_targets`` from its model config (empty without LoRA)."""
    from verl.config.validation import LORA_TARGET_MODULES

    if model.lora_rank <= 0:
        return {}
    targets = model.target_modules
    names = LORA_TARGET_MODULES if targets == "all-linear" else (targets,) if isinstance(targets, str) else tuple(targets)
    return {"lora_rank": model.lora_rank, "lora_targets": tuple(n for n in LORA_TARGET_MODULES if n in names)}


def _micro_batches(mini_batch_prompts: int, n: int, dp: int, micro: int) -> int:
    return max(1, mini_batch_prompts * n // max(1, dp) // micro)


def inputs_from_config(
    cfg: "PPOConfig",
    *,
    spec: HFModelSpec,
    critic_spec: HFModelSpec | None = None,
    reward_spec: HFModelSpec | None = None,
    teacher_spec: HFModelSpec | None = None,
    gpu_memory_gib: float = 80.0,
    reserve_gib: float = DEFAULT_RESERVE_GIB,
    vision: VisionTower | None = None,
) -> PlanInputs:
    """The memory model's inputs for ``cfg`` on its declared cluster (``trainer.nnodes x n_gpus_per_node``).

    ``megatron.dtype=auto`` is bf16 unless ``trainer.device=cpu`` (the engine's own rule on a GPU).
    Recompute follows ``actor_rollout_ref.model.enable_gradient_checkpointing`` (critic: its own).
    With ``trainer.placement`` every role gets its ranks (``verl.parallel.placement.role_ranks``).
    """
    from verl.parallel.placement import role_ranks

    t = cfg.trainer
    world = t.nnodes * t.n_gpus_per_node
    device = t.device
    built = ["actor"] + [role for role, on in (
        ("ref", cfg.use_reference), ("critic", cfg.use_critic), ("reward_model", cfg.reward_model.enable),
        ("teacher", cfg.use_teacher)) if on]
    placed = role_ranks(t.placement, world, built) if t.placement else {}
    arr = cfg.actor_rollout_ref
    n = arr.rollout.n
    a = arr.actor
    trained_ranks = len(placed.get("actor", range(world)))
    a_dp = trained_ranks if a.strategy == "fsdp2" else trained_ranks // (
        a.megatron.tensor_model_parallel_size * a.megatron.pipeline_model_parallel_size * a.megatron.context_parallel_size
    )
    lora = _lora_role_settings(arr.model) if a.strategy != "fsdp2" else {}
    roles = [
        _role(
            "actor", a.strategy, a.megatron, a.fsdp_config, device=device, head="lm", trains=True, optimizer=a.optim.optimizer,
            **lora,
            recompute=arr.model.enable_gradient_checkpointing, micro_batch=a.ppo_micro_batch_size_per_gpu,
            micro_batches=_micro_batches(a.ppo_mini_batch_size, n, a_dp, a.ppo_micro_batch_size_per_gpu),
            forward_micro_batch=arr.rollout.log_prob_micro_batch_size_per_gpu, freeze_vision=a.freeze_vision_tower,
        )
    ]
    if cfg.use_reference and not lora:  # with adapters the reference is the actor with them off
        roles.append(_role(
            "ref", arr.ref.strategy, arr.ref.megatron, arr.ref.fsdp_config, device=device, head="lm", trains=False,
            forward_micro_batch=arr.ref.log_prob_micro_batch_size_per_gpu,
        ))
    if cfg.use_critic:
        c = cfg.critic
        c_ranks = len(placed.get("critic", range(world)))
        c_dp = c_ranks if c.strategy == "fsdp2" else c_ranks // (
            c.megatron.tensor_model_parallel_size * c.megatron.pipeline_model_parallel_size
            * c.megatron.context_parallel_size
        )
        roles.append(_role(
            "critic", c.strategy, c.megatron, c.fsdp_config, device=device, head="value", trains=True, optimizer=c.optim.optimizer,
            **(_lora_role_settings(c.model) if c.strategy != "fsdp2" else {}),
            recompute=c.model.enable_gradient_checkpointing, micro_batch=c.ppo_micro_batch_size_per_gpu,
            micro_batches=_micro_batches(c.ppo_mini_batch_size, n, c_dp, c.ppo_micro_batch_size_per_gpu),
            forward_micro_batch=c.forward_micro_batch_size_per_gpu,
        ))
    if cfg.reward_model.enable:
        rm = cfg.reward_model
        roles.append(_megatron_role(
            "reward_model", rm.megatron, device=device, head="reward", trains=False,
            forward_micro_batch=rm.micro_batch_size_per_gpu,
        ))
    if cfg.use_teacher:  # frozen: weights only, in its own layout (the actor's degrees and dtype unless set)
        tm = cfg.distillation.teacher_model
        roles.append(_megatron_role(
            "teacher", tm.megatron, device=device, head="lm", trains=False,
            forward_micro_batch=tm.log_prob_micro_batch_size_per_gpu,
        ))
    if placed:
        roles = [dataclasses.replace(role, ranks=placed[role.name]) for role in roles]
    r = arr.rollout
    rollout = RolloutSetup(
        tp=r.tensor_model_parallel_size,
        dtype_bytes=_dtype_bytes(r.dtype, device),
        sequences=cfg.data.train_batch_size * n,
        bucket_bytes=r.update_weights_bucket_megabytes * 2**20,
        gpu_memory_utilization=r.gpu_memory_utilization,
    )
    return PlanInputs(
        spec=spec, critic_spec=critic_spec, reward_spec=reward_spec, teacher_spec=teacher_spec, world_size=world, gpus_per_node=t.n_gpus_per_node,
        seq_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
        response_len=cfg.data.max_response_length, roles=tuple(roles), rollout=rollout,
        gpu_memory_gib=gpu_memory_gib, reserve_gib=reserve_gib, vision=vision,
    )
