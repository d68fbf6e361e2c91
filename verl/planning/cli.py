"""``main_ppo --dry-run``: print the per-GPU memory plan of a config's cluster; exit 1 if it does not fit."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, TextIO

from verl.planning.hardware import GPUPreset, gpu_preset
from verl.utils.logging import warn_once

if TYPE_CHECKING:
    from verl.config.schema import PPOConfig
    from verl.planning.memory import MemoryPlan, PlanInputs

__all__ = ["DRY_RUN_FLAGS", "pop_dry_run_flags", "config_inputs", "run_dry_run", "write_report"]

logger = logging.getLogger(__name__)

DRY_RUN_FLAGS = {
    "--dry-run": "build the placement on meta tensors and print each GPU's memory plan; exit 1 if it does not fit",
    "--gpu-memory-gb": "GPU memory (GiB) the plan is checked against (default 80)",
    "--gpu": "A100, H100 or H200: the step-time estimate's figures (default H100)",
    "--model-config": "a config.json (or a name under configs/models) when model.path is not on this machine",
    "--teacher-model-config": "the same for distillation.teacher_model.model_path (on-policy distillation's teacher)",
}


def pop_dry_run_flags(argv: Sequence[str]) -> tuple[dict[str, str | bool] | None, list[str]]:
    """Split the dry-run flags off ``argv``: (their values, or None without ``--dry-run``; the rest)."""
    args, rest, found = list(argv), [], {}
    i = 0
    while i < len(args):
        flag, _, value = args[i].partition("=")
        if flag == "--dry-run":
            found["dry_run"] = True
        elif flag in DRY_RUN_FLAGS:
            if not value:
                if i + 1 >= len(args):
                    raise ValueError(f"{flag} needs a value")
                i += 1
                value = args[i]
            found[flag[2:].replace("-", "_")] = value
        else:
            rest.append(args[i])
        i += 1
    if not found.get("dry_run"):
        if found:
            raise ValueError(f"{', '.join('--' + k.replace('_', '-') for k in found)} only go with --dry-run")
        return None, rest
    return found, rest


def _spec_for(path: str | None, fallback, what: str):
    from verl.planning.inputs import load_spec

    if path and os.path.isfile(os.path.join(os.path.expanduser(path), "config.json")):
        return load_spec(os.path.expanduser(path), what=what)
    return fallback


def run_dry_run(cfg: "PPOConfig", flags: dict[str, str | bool]) -> int:
    """Print the plan of ``cfg`` (stdout) and, when it does not fit, the fastest layouts that do; 0 fits, 1 not."""
    from verl.planning.dry_run import dry_run_plan

    gib = float(flags.get("gpu_memory_gb", 80.0))
    gpu = gpu_preset(str(flags.get("gpu", "H100")))
    model_config, teacher_config = flags.get("model_config"), flags.get("teacher_model_config")
    inputs = config_inputs(cfg, model_config=str(model_config) if model_config else None, gpu_memory_gib=gib,
                           teacher_model_config=str(teacher_config) if teacher_config else None)
    return write_report(dry_run_plan(inputs), gpu, sys.stdout)


def config_inputs(
    cfg: "PPOConfig", *, model_config: str | None, gpu_memory_gib: float, teacher_model_config: str | None = None
) -> "PlanInputs":
    """The memory model's inputs for ``cfg``: the models from ``model_config`` (a config.json, a model
    directory or a name under configs/models) or else the configured paths, the teacher's from
    ``teacher_model_config`` or else ``distillation.teacher_model.model_path``; ValueError when the
    layout cannot split them."""
    from verl.planning.dry_run import check_inputs
    from verl.planning.inputs import inputs_from_config, load_spec

    if gpu_memory_gib <= 0:
        raise ValueError(f"--gpu-memory-gb={gpu_memory_gib:g}; it must be > 0")
    apart = sorted(set(cfg.trainer.placement) - {"actor", "teacher"})
    if apart:
        raise ValueError(
            f"trainer.placement={dict(cfg.trainer.placement)}: the memory plan models colocated roles (every role "
            "on every GPU) and a distillation teacher on GPUs of its own; "
            f"{', '.join(apart)} on GPUs of their own are not planned yet. Plan without trainer.placement (an upper "
            "bound: each GPU then holds every role)"
        )
    arr = cfg.actor_rollout_ref
    if model_config:
        spec = load_spec(model_config, override=arr.model.override_config, what="--model-config")
    else:
        path = os.path.expanduser(arr.model.path or "")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(
                f"actor_rollout_ref.model.path={arr.model.path!r} has no config.json on this machine; pass "
                "--model-config FILE (or a name under configs/models, e.g. llama3_70b)"
            )
        spec = load_spec(path, override=arr.model.override_config, what="actor_rollout_ref.model.path")
    critic_spec = _spec_for(cfg.critic.model.path, None, "critic.model.path") if cfg.use_critic else None
    reward_spec = None
    if cfg.reward_model.enable:
        reward_spec = _spec_for(cfg.reward_model.model.path, None, "reward_model.model.path")
        if reward_spec is None:
            warn_once(logger, "dry run: reward_model.model.path has no config.json here; planning it as the actor's model")
    teacher_spec = _teacher_spec(cfg, teacher_model_config) if cfg.use_teacher else None
    from verl.planning.vision import VisionTower

    source = model_config or os.path.expanduser(arr.model.path or "")
    source = source if os.path.isdir(source) else os.path.dirname(source) if os.path.isfile(source) else None
    # A vision-language actor's tower (its image processor's pixel budget per image, one image a sequence).
    vision = VisionTower.from_model_dir(source) if source and os.path.isfile(os.path.join(source, "config.json")) else None
    inputs = inputs_from_config(
        cfg, spec=spec, critic_spec=critic_spec, reward_spec=reward_spec, teacher_spec=teacher_spec,
        gpu_memory_gib=gpu_memory_gib, vision=vision,
    )
    problems = check_inputs(inputs, spec)
    if problems:
        raise ValueError("the layout cannot split the model: " + "; ".join(problems))
    return inputs


def _teacher_spec(cfg: "PPOConfig", teacher_model_config: str | None):
    """On-policy distillation's teacher: ``teacher_model_config`` or ``distillation.teacher_model.model_path``
    (a model directory, a config.json or a name under configs/models), with its ``override_config``."""
    from verl.planning.inputs import load_spec

    tm = cfg.distillation.teacher_model
    if teacher_model_config:
        return load_spec(teacher_model_config, override=dict(tm.override_config), what="--teacher-model-config")
    path = os.path.expanduser(tm.model_path or "")
    try:
        return load_spec(path, override=dict(tm.override_config), what="distillation.teacher_model.model_path")
    except ValueError as exc:
        raise ValueError(
            f"{exc}; the plan counts the teacher's weights from its config.json: pass --teacher-model-config FILE "
            "(or a name under configs/models) when the teacher is not on this machine"
        ) from None


def write_report(plan: "MemoryPlan", gpu: GPUPreset, out: TextIO) -> int:
    """Write ``plan``'s table, its estimated step time and, when it does not fit, the fastest layouts
    of the same cluster that do (formula plans), first the context-parallel degree that makes this layout
    fit when there is one; returns 0 when it fits, else 1."""
    from verl.planning.search import (
        context_parallel_suggestion,
        estimate_step_seconds,
        grow_cluster,
        search_layouts,
        suggestion_overrides,
    )

    inputs = plan.inputs
    out.write(plan.table() + "\n")
    times = estimate_step_seconds(plan, gpu)
    out.write(f"estimated step time on {gpu.name}: " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items())
              + " (assumptions: verl.planning.search)\n")
    if plan.fits:
        out.flush()
        return 0
    apart = [r.name for r in inputs.roles if r.ranks is not None and r.ranks != inputs.rollout_ranks()]
    if apart:  # the search varies one layout of every role over the whole world
        out.write(f"no layout search: {', '.join(apart)} on GPUs of its own (trainer.placement); the search tries "
                  "colocated layouts: plan without trainer.placement to see them\n")
        out.flush()
        return 1
    cp = context_parallel_suggestion(plan)
    if cp is not None:
        out.write(cp.describe() + "\n")
    found = search_layouts(inputs, gpu)
    if found:
        out.write("layouts of this cluster that fit (formula plans, fastest first):\n")
        for c in found:
            out.write(f"  {c.describe()}\n")
        out.write("suggested overrides: " + " ".join(suggestion_overrides(found[0])) + "\n")
    else:
        out.write(f"no layout of {inputs.world_size} GPUs fits in {inputs.gpu_memory_gib:g} GiB\n")
        nodes, found = grow_cluster(inputs, gpu)
        if found:
            out.write(f"on {nodes} nodes these fit (formula plans, fastest first):\n")
            for c in found:
                out.write(f"  {c.describe()}\n")
            out.write("suggested overrides: " + " ".join(suggestion_overrides(found[0])) + "\n")
        else:
            out.write("nor on up to 8 times as many nodes: lower the micro-batches or the sequence length, or use "
                      "GPUs with more memory\n")
    out.flush()
    return 1
