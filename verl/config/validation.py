"""Whole-config checks: parallel layouts against the world size, batch divisibility, registry names.

Every check appends a message to one list, so a user sees all problems of a config at once.
Each layout message prints every degree involved and the world size.

Names that select a registered function (advantage estimator, policy loss, KL estimator, reward
manager, rollout engine) are checked against their registry whatever has been imported:
:data:`NAME_REGISTRIES` says which module lists each one, imported only when a config sets the
name to something other than its default (so the torch-free paths, such as printing a default
config, stay torch-free). Plugins can add checks of their own with :func:`register_choices`.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from verl.config.core import ConfigError, did_you_mean, is_section, leaf_default, schema
from verl.parallel.layout import LayoutNames, layout_problems

if TYPE_CHECKING:
    from verl.config.schema import MegatronConfig, PPOConfig, SFTConfig

__all__ = [
    "NAME_REGISTRIES",
    "deferred_validation",
    "register_choices",
    "registered_choices",
    "validate_ppo",
    "validate_sft",
    "validation_deferred",
]

logger = logging.getLogger(__name__)

#: dotted config path -> ("module:attribute" listing the registered names, what they are). The
#: attribute is a function returning the names or a mapping keyed by them.
NAME_REGISTRIES: dict[str, tuple[str, str]] = {
    "algorithm.adv_estimator": ("verl.algos.advantage:list_adv_estimators", "advantage estimator"),
    "algorithm.kl_penalty": ("verl.algos.kl:list_kl_estimators", "KL estimator"),
    "actor_rollout_ref.actor.policy_loss.loss_mode": ("verl.algos.policy_loss:list_policy_losses", "policy loss"),
    "actor_rollout_ref.actor.kl_loss_type": ("verl.algos.kl:list_kl_estimators", "KL estimator"),
    "actor_rollout_ref.rollout.name": ("verl.rollout.factory:ENGINES", "rollout engine"),
    "reward_model.reward_manager": ("verl.rewards.manager:REWARD_MANAGERS", "reward manager"),
    "algorithm.dpo.loss_type": ("verl.algos.preference:list_preference_losses", "preference loss"),
    "distillation.distillation_loss.policy_loss_mode": ("verl.algos.policy_loss:list_policy_losses", "policy loss"),
}

_CHOICES: dict[str, tuple[Callable[[], Iterable[str]], str]] = {}
_MISSING = object()
# Set while a loader builds a config that it validates against the launched world right after.
_DEFERRED: contextvars.ContextVar[bool] = contextvars.ContextVar("verl_config_deferred", default=False)


@contextlib.contextmanager
def deferred_validation() -> Iterator[None]:
    """Skip the validation that constructing a root config runs, inside this block.

    A loader that knows the launched world size builds the config here and then validates it
    once with that size, so a world-size mismatch is not first reported as whatever the
    declared ``nnodes x n_gpus_per_node`` breaks (batch divisibility, layout).
    """
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


_VALIDATED = "_verl_validated"  # on a root config: (world size, its settings as validated)


def validate_once(cfg: Any, world_size: int | None, check: Callable[[Any, int | None], None]) -> None:
    """``check(cfg, world_size)`` unless ``cfg`` passed it for this world size and no setting has
    changed since (compared as the settings' JSON, a few kilobytes)."""
    import dataclasses
    import json

    seen = getattr(cfg, _VALIDATED, None)
    if seen is not None and seen[0] == world_size and seen[1] == json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str):
        return
    check(cfg, world_size)
    setattr(cfg, _VALIDATED, (world_size, json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str)))


def validation_deferred() -> bool:
    """Whether a :func:`deferred_validation` block is active."""
    return _DEFERRED.get()


def register_choices(path: str, names: Callable[[], Iterable[str]], *, what: str) -> None:
    """Check the value at dotted ``path`` (e.g. ``"algorithm.adv_estimator"``) against ``names()``.

    ``names`` is called at validation time, so entries registered later still count; ``what``
    names the kind of thing in the message ("advantage estimator").
    """
    _CHOICES[path] = (names, what)


def registered_choices() -> dict[str, str]:
    """``{dotted path: what}`` of every registered name check."""
    return {path: what for path, (_, what) in _CHOICES.items()}


def _get(cfg: Any, path: str) -> Any:
    node = cfg
    for part in path.split("."):
        node = getattr(node, part, _MISSING)
        if node is _MISSING:
            return _MISSING
    return node


def _default(root: type, path: str) -> Any:
    """The schema default of the leaf at dotted ``path`` of ``root`` (section defaults applied)."""
    cls, section_defaults = root, {}
    *parents, leaf = path.split(".")
    for part in parents:
        f, hint = schema(cls)[part]
        assert is_section(hint), path
        cls, section_defaults = hint, f.metadata.get("defaults", {})
    f, _ = schema(cls)[leaf]
    return leaf_default(f, section_defaults)


def _registry_names(source: str) -> list[str] | None:
    """The names listed by ``"module:attribute"``; None (logged) when the module cannot be imported."""
    module_name, attr = source.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        logger.warning("cannot check names against %s (%s); the name is checked when it is looked up", source, exc)
        return None
    listed = getattr(module, attr)
    return list(listed() if callable(listed) else listed)


def _unknown_name(path: str, value: Any, known: Iterable[str], what: str) -> str:
    known = sorted(set(known))
    return (
        f"{path}={value!r} is not a registered {what}{did_you_mean(str(value), known)} "
        f"(registered: {', '.join(known)})"
    )


def _check_names(cfg: Any, problems: list[str]) -> None:
    root = type(cfg)
    for path, (source, what) in NAME_REGISTRIES.items():
        value = _get(cfg, path)
        if value is _MISSING or value is None or path in _CHOICES:
            continue
        # Defaults are registered (a test checks it); importing a registry (torch) for them
        # would slow every torch-free use of the config.
        if value == _default(root, path):
            continue
        known = _registry_names(source)
        if known is not None and value not in known:
            problems.append(_unknown_name(path, value, known, what))
    for path, (names, what) in _CHOICES.items():
        value = _get(cfg, path)
        if value is _MISSING or value is None:
            continue
        known = list(names())
        if value not in known:
            problems.append(_unknown_name(path, value, known, what))


def _world(trainer: Any, world_size: int | None, problems: list[str]) -> tuple[int, str] | None:
    """The world size to check against and how to print it; None when the launched world does not
    match ``nnodes x n_gpus_per_node`` (reported here): every check that depends on the world
    would then report a consequence of that one mistake."""
    declared = trainer.nnodes * trainer.n_gpus_per_node
    shape = f"trainer.nnodes={trainer.nnodes} x trainer.n_gpus_per_node={trainer.n_gpus_per_node}"
    if world_size is None:
        return declared, f"{declared} ({shape})"
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    if world_size != declared:
        if world_size % trainer.nnodes == 0:
            fix = f"set trainer.n_gpus_per_node={world_size // trainer.nnodes}"
        else:
            fix = f"set trainer.nnodes and trainer.n_gpus_per_node so that their product is {world_size}"
        problems.append(
            f"the launched world size {world_size} differs from {shape} = {declared}; launch "
            f"{declared} processes (torchrun --nnodes={trainer.nnodes} --nproc_per_node={trainer.n_gpus_per_node}) "
            f"or {fix} to match the launcher"
        )
        return None
    return world_size, f"{world_size} (launched)"


def _layout(
    role: str, prefix: str, m: MegatronConfig, world: int, world_text: str, problems: list[str], *, placed: bool = False
) -> tuple[int, str] | None:
    """Check one role's Megatron layout; return (data-parallel size, how it was derived) or None."""
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    found = layout_problems(
        ranks=world,
        ranks_text=world_text if placed else f"the world size {world_text}",
        tensor=tp,
        pipeline=pp,
        context=cp,
        virtual_pipeline=m.virtual_pipeline_model_parallel_size,
        sequence_parallel=m.sequence_parallel,
        names=LayoutNames(prefix=f"{prefix}."),
    )
    for problem in found:
        fits = "its ranks" if placed else "the world"
        lead = f"the {role} layout does not fit {fits}: " if problem.kind == "divide" else ""
        problems.append(lead + problem.text)
    if any(problem.kind in ("degree", "divide") for problem in found):
        return None
    dp = world // (tp * pp * cp)
    ranks = f"its {world} ranks" if placed else f"world {world}"
    return dp, f"{dp} ({ranks} / (tensor {tp} x pipeline {pp} x context {cp}))"


def _mini_batches(
    prefix: str, mini: int, micro: int | None, n: int, train_bs: int, dp: int, dp_text: str, problems: list[str]
) -> None:
    """PPO mini/micro-batch divisibility of one trained role (actor or critic); ``micro`` None: a
    token budget cuts the micro-batches (any row count works)."""
    if mini > train_bs:
        problems.append(
            f"{prefix}.ppo_mini_batch_size={mini} is larger than data.train_batch_size={train_bs}; "
            f"a step must hold at least one mini-batch"
        )
    elif train_bs % mini:
        problems.append(
            f"data.train_batch_size={train_bs} is not a multiple of {prefix}.ppo_mini_batch_size={mini}; "
            f"every mini-batch must be full"
        )
    seqs = mini * n
    if seqs % dp:
        problems.append(
            f"{prefix}.ppo_mini_batch_size={mini} x actor_rollout_ref.rollout.n={n} = {seqs} sequences per "
            f"mini-batch do not split evenly over the data-parallel size {dp_text}"
        )
    elif micro is not None and (seqs // dp) % micro:
        problems.append(
            f"{prefix}.ppo_micro_batch_size_per_gpu={micro} does not divide the {seqs // dp} sequences of a "
            f"mini-batch on one rank ({prefix}.ppo_mini_batch_size={mini} x actor_rollout_ref.rollout.n={n} / "
            f"data-parallel size {dp_text})"
        )


def _resume(trainer: Any, problems: list[str]) -> None:
    for key in ("save_freq", "test_freq"):  # 0 would silently mean never, even at the end
        if getattr(trainer, key) == 0:
            what = "saves no checkpoint, not even at the end" if key == "save_freq" else "never validates"
            problems.append(f"trainer.{key}=0 {what}; use -1 for never, or a number of steps >= 1")
    if trainer.resume_mode == "resume_path" and not trainer.resume_from_path:
        problems.append("trainer.resume_mode=resume_path needs trainer.resume_from_path")
    elif trainer.resume_mode != "resume_path" and trainer.resume_from_path:
        # An error, not a warning: ignoring it would train from scratch (disable) or from the
        # latest checkpoint in default_local_dir (auto) while the user believes otherwise.
        problems.append(
            f"trainer.resume_from_path={trainer.resume_from_path!r} is ignored with "
            f"trainer.resume_mode={trainer.resume_mode}; set trainer.resume_mode=resume_path to resume from it, "
            f"or drop trainer.resume_from_path"
        )


def _output_folders(trainer: Any, problems: list[str]) -> None:
    """An output folder of the run that is a file (or lies below one): nothing could be written there
    (the Python API's ``output_dir`` is ``trainer.default_local_dir``; its logs are under it)."""
    import os

    blocked: dict[str, str] = {}  # the file -> the first setting at or below it, and how
    for key in ("default_local_dir", "log_dir", "hf_export_dir"):
        value = getattr(trainer, key, None)
        if not value:
            continue
        target = path = os.path.abspath(os.path.expanduser(value))
        while not os.path.lexists(path) and os.path.dirname(path) != path:
            path = os.path.dirname(path)
        if os.path.lexists(path) and not os.path.isdir(path):
            where = "is" if path == target else f"lies inside {path}, which is"
            blocked.setdefault(path, f"trainer.{key}={value} {where}")
    for setting in blocked.values():
        problems.append(
            f"{setting} a file, not a folder (the Python API's output_dir is trainer.default_local_dir): "
            "the run writes its checkpoints and logs into a folder; choose a folder path, new or existing"
        )


def _data_files(data: Any, problems: list[str]) -> None:
    """Data file lists that name nothing (``[]``, ``''``); whether the files exist is checked at load."""
    for key in ("train_files", "val_files"):
        files = getattr(data, key)
        if files is None:
            continue
        names = [files] if isinstance(files, str) else files
        fix = "or null for no validation" if key == "val_files" else "to train on"
        if not any(name.strip() for name in names):
            problems.append(f"data.{key}={files!r} names no file; give parquet, arrow or jsonl file(s) {fix}")
        elif not all(name.strip() for name in names):
            problems.append(f"data.{key}={files!r} holds an empty file name; drop it")


def _raise(problems: list[str]) -> None:
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} problems in the config:\n  - " + "\n  - ".join(problems))


def validate_ppo(cfg: PPOConfig, world_size: int | None) -> None:
    """Check a PPO config as a whole; raise one ConfigError listing every problem."""
    problems: list[str] = []
    world = _world(cfg.trainer, world_size, problems)
    if world is not None:
        _ppo_layouts(cfg, *world, problems)
    rollout = cfg.actor_rollout_ref.rollout
    actor = cfg.actor_rollout_ref.actor
    if cfg.reward_model.enable and not cfg.reward_model.model.path:
        problems.append("reward_model.enable=true needs reward_model.model.path")
    if rollout.max_num_batched_tokens < rollout.prompt_length + rollout.response_length:
        problems.append(
            f"actor_rollout_ref.rollout.max_num_batched_tokens={rollout.max_num_batched_tokens} is smaller than "
            f"prompt_length={rollout.prompt_length} + response_length={rollout.response_length}; raise it"
        )
    if rollout.prompt_length < cfg.data.max_prompt_length:
        problems.append(
            f"actor_rollout_ref.rollout.prompt_length={rollout.prompt_length} is shorter than "
            f"data.max_prompt_length={cfg.data.max_prompt_length}; the engine would reject long prompts"
        )
    low = actor.clip_ratio if actor.clip_ratio_low is None else actor.clip_ratio_low
    if low >= 1.0:
        problems.append(
            f"the actor's lower clip range {low} (clip_ratio_low, else clip_ratio) must be < 1: "
            f"the ratio is clipped at 1 - clip_ratio_low"
        )
    _old_log_prob(cfg, problems)
    _rollout_mode(cfg, problems)
    if rollout.update_weights_mode != "full":
        key = f"actor_rollout_ref.rollout.update_weights_mode={rollout.update_weights_mode}"
        if not cfg.trainer.placement.get("rollout"):
            problems.append(f"{key} sends deltas to a rollout on ranks of its own (trainer.placement.rollout); a "
                            "colocated engine takes the weights in place, nothing crosses the wire: set it to full")
        elif actor.strategy != "megatron":
            problems.append(f"{key} needs the Megatron actor's reshard plan (actor.strategy=megatron; fsdp2 sends "
                            "whole gathered tensors): set it to full")
    _policy_loss(cfg, problems)
    _token_budgets(cfg, problems)
    if cfg.algorithm.filter_groups.enable and not cfg.algorithm.filter_groups.metric:
        problems.append("algorithm.filter_groups.enable=true needs algorithm.filter_groups.metric (e.g. acc or score)")
    _step_kind(cfg, problems)
    _distillation(cfg, problems)
    _data_files(cfg.data, problems)
    _resume(cfg.trainer, problems)
    _output_folders(cfg.trainer, problems)
    _check_names(cfg, problems)
    _lora_targets({"actor_rollout_ref.model": cfg.actor_rollout_ref.model, "critic.model": cfg.critic.model}, problems)
    _lora_without_rank(cfg, ("actor_rollout_ref.model", "critic.model"), problems)
    _moe_aux_loss(cfg, problems)
    if cfg.actor_rollout_ref.model.lora_rank > 0 and cfg.actor_rollout_ref.actor.strategy != "megatron":
        problems.append(
            f"actor_rollout_ref.model.lora_rank={cfg.actor_rollout_ref.model.lora_rank} with "
            f"actor_rollout_ref.actor.strategy={cfg.actor_rollout_ref.actor.strategy}: LoRA adapters are built on "
            "verl's Megatron models; use strategy=megatron, or lora_rank=0"
        )
    _raise(problems)


# The Hugging Face linear modules LoRA adapts (verl.models.lora.HF_TARGETS is keyed by these, checked
# there at import): named here so that the config layer checks them without importing verl.models.
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _lora_targets(models: dict[str, Any], problems: list[str]) -> None:
    """``{key}.target_modules`` of each model with adapters (``lora_rank`` > 0) names real modules."""
    for key, model in models.items():
        if model.lora_rank > 0:
            value = model.target_modules
            names = list(LORA_TARGET_MODULES) if value == "all-linear" else ([value] if isinstance(value, str) else list(value))
            unknown = [n for n in names if n not in LORA_TARGET_MODULES]
            if unknown or not names:
                problems.append(
                    f"{key}.target_modules={value!r}: LoRA targets are Hugging Face module names of the "
                    f"Llama/Qwen2/Mistral layers, one or more of {list(LORA_TARGET_MODULES)}, or 'all-linear'"
                    + (f" (unknown: {unknown})" if unknown else " (the list is empty)")
                )


def _lora_without_rank(cfg: Any, keys: Iterable[str], problems: list[str]) -> None:
    """LoRA settings given to a model without adapters (``lora_rank=0``): every weight would train
    while the user believes adapters do."""
    for key in keys:
        model = _get(cfg, key)
        if model.lora_rank > 0:
            continue
        given = [
            f"{key}.{name}={getattr(model, name)!r}"
            for name in ("lora_alpha", "target_modules", "lora_dropout")
            if getattr(model, name) != _default(type(cfg), f"{key}.{name}")
        ]
        if given:
            problems.append(
                f"{' and '.join(given)} set, but {key}.lora_rank=0 builds no adapters and trains every weight: set "
                f"{key}.lora_rank (e.g. {key}.lora_rank=16) to train LoRA adapters, or drop the LoRA settings"
            )


def _moe_aux_loss(cfg: PPOConfig, problems: list[str]) -> None:
    """The Mixture-of-Experts load-balancing loss weight is a number >= 0 wherever it is set (a negative
    one turned the loss off in silence: Megatron balances only with a positive weight)."""
    arr, d = cfg.actor_rollout_ref, cfg.distillation
    settings = [
        (f"{prefix}.override_transformer_config.moe_aux_loss_coeff", m.override_transformer_config.get("moe_aux_loss_coeff"))
        for prefix, m in (("actor_rollout_ref.actor.megatron", arr.actor.megatron),
                          ("actor_rollout_ref.ref.megatron", arr.ref.megatron), ("critic.megatron", cfg.critic.megatron),
                          ("reward_model.megatron", cfg.reward_model.megatron),
                          ("distillation.teacher_model.megatron", d.teacher_model.megatron))
    ] + [
        (f"{prefix}.override_config.router_aux_loss_coef", overrides.get("router_aux_loss_coef"))
        for prefix, overrides in (("actor_rollout_ref.model", arr.model.override_config),
                                  ("critic.model", cfg.critic.model.override_config),
                                  ("reward_model.model", cfg.reward_model.model.override_config),
                                  ("distillation.teacher_model", d.teacher_model.override_config))
    ]
    for key, value in settings:
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            problems.append(
                f"{key}={value!r}: the Mixture-of-Experts load-balancing loss weight must be a number >= 0 (0 turns "
                f"the loss off; the usual weight is 0.001): set {key}=0.001, or drop it to keep the model config's"
            )


def _step_kind(cfg: PPOConfig, problems: list[str]) -> None:
    """The step kinds (``verl.trainer.step.build_step``) are one each: DPO on pairs, the hybrid
    PPO/DPO step, DAPO's dynamic sampling, or the plain RL step."""
    a = cfg.algorithm
    kinds = [
        name
        for name, on in (
            ("data.pairs=true (DPO)", cfg.data.pairs),
            ("algorithm.hybrid.enable=true", a.hybrid.enable),
            ("algorithm.filter_groups.enable=true", a.filter_groups.enable),
        )
        if on
    ]
    if len(kinds) > 1:
        problems.append(f"{' and '.join(kinds)} are different steps; choose one of them")
    elif a.hybrid.enable:
        if not cfg.use_reference:
            problems.append(
                "algorithm.hybrid.enable=true: the DPO half needs the reference policy; set "
                "actor_rollout_ref.actor.use_kl_loss=true (or algorithm.use_kl_in_reward=true)"
            )
        if cfg.actor_rollout_ref.rollout.n < 2:
            problems.append(
                f"algorithm.hybrid.enable=true pairs the best and worst sample of each prompt for DPO, but "
                f"actor_rollout_ref.rollout.n={cfg.actor_rollout_ref.rollout.n}; sample several (e.g. rollout.n=4)"
            )


def _distillation(cfg: PPOConfig, problems: list[str]) -> None:
    """On-policy distillation: a teacher is named, the step can carry it, the loss is one we have."""
    d = cfg.distillation
    key = "distillation"
    if not d.enabled:
        if d.teacher_model.model_path:
            problems.append(
                f"{key}.teacher_model.model_path={d.teacher_model.model_path} is set, but {key}.enabled=false builds no "
                f"teacher and distils nothing: set {key}.enabled=true, or {key}.teacher_model.model_path=null to train "
                "without a teacher"
            )
        elif "teacher" in cfg.trainer.placement:
            problems.append(f"trainer.placement.teacher places a teacher, but {key}.enabled=false; set it true")
        return
    if not d.teacher_model.model_path:
        problems.append(f"{key}.enabled=true needs {key}.teacher_model.model_path (the teacher's Hugging Face directory)")
    if cfg.data.pairs or cfg.algorithm.hybrid.enable:
        what = "data.pairs=true (DPO)" if cfg.data.pairs else "algorithm.hybrid.enable=true"
        problems.append(
            f"{key}.enabled=true distils on the student's own samples, which {what} does not train on; "
            "turn one of them off"
        )
    loss = d.distillation_loss
    from verl.algos.distill import TOPK_LOSS_MODES, UNPROVIDED_TOPK_LOSS_MODES

    if loss.loss_mode in TOPK_LOSS_MODES:
        pass  # the teacher hands its top-k (distillation_loss.topk) and the student scores those ids
    elif loss.loss_mode in UNPROVIDED_TOPK_LOSS_MODES:
        problems.append(
            f"{key}.distillation_loss.loss_mode={loss.loss_mode} is not provided: of the reference's top-k losses "
            f"verl has {', '.join(TOPK_LOSS_MODES)} (the reference's later releases register only that one too); "
            "use forward_kl_topk, or a sampled-token estimator (k1 with use_policy_gradient=true, or k3)"
        )
    elif loss.loss_mode not in _registry_names("verl.algos.kl:list_kl_estimators"):
        problems.append(_unknown_name(f"{key}.distillation_loss.loss_mode", loss.loss_mode,
                                      [*(_registry_names("verl.algos.kl:list_kl_estimators") or []), *TOPK_LOSS_MODES],
                                      "distillation loss"))
    elif loss.loss_mode.startswith("full"):
        problems.append(
            f"{key}.distillation_loss.loss_mode={loss.loss_mode} needs whole distributions; the teacher hands "
            "the sampled tokens' log-probabilities only (use k1, k3, k2 or abs)"
        )
    if not loss.use_task_rewards and loss.distillation_loss_coef != 1.0:
        problems.append(
            f"{key}.distillation_loss.distillation_loss_coef={loss.distillation_loss_coef} weighs the distillation "
            "loss beside the task's, but use_task_rewards=false trains on the distillation loss alone (weight 1, "
            "as the reference); set use_task_rewards=true or drop the coefficient (scale the learning rate instead)"
        )


def _token_budgets(cfg: PPOConfig, problems: list[str]) -> None:
    """Each token budget that is switched on is set and holds the longest sequence; a Megatron role's
    context-parallel ranks each hold 1/CP of a micro-batch, so there CP times the budget must hold it."""
    arr = cfg.actor_rollout_ref
    actor, rollout, ref, critic = arr.actor, arr.rollout, arr.ref, cfg.critic
    longest = cfg.data.max_prompt_length + rollout.response_length
    longest_text = (
        f"data.max_prompt_length={cfg.data.max_prompt_length} + actor_rollout_ref.rollout.response_length="
        f"{rollout.response_length} = {longest} tokens"
    )
    a, r, f = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.ref"
    def cp(prefix: str, role: Any) -> tuple[str, int]:  # the engine that runs the budget's passes
        return f"{prefix}.megatron.context_parallel_size", (
            role.megatron.context_parallel_size if role.strategy == "megatron" else 1)

    budgets = [
        (f"{a}.use_dynamic_bsz", actor.use_dynamic_bsz, f"{a}.ppo_max_token_len_per_gpu", actor.ppo_max_token_len_per_gpu,
         cp(a, actor)),
        (f"{r}.log_prob_use_dynamic_bsz", rollout.log_prob_use_dynamic_bsz, f"{r}.log_prob_max_token_len_per_gpu",
         rollout.log_prob_max_token_len_per_gpu, cp(a, actor)),  # the actor's old log-probabilities
    ]
    if cfg.use_reference:
        budgets.append((f"{f}.log_prob_use_dynamic_bsz", ref.log_prob_use_dynamic_bsz,
                        f"{f}.log_prob_max_token_len_per_gpu", ref.log_prob_max_token_len_per_gpu, cp(f, ref)))
    if cfg.use_critic:
        budgets += [
            ("critic.use_dynamic_bsz", critic.use_dynamic_bsz, "critic.ppo_max_token_len_per_gpu",
             critic.ppo_max_token_len_per_gpu, cp("critic", critic)),
            ("critic.use_dynamic_bsz", critic.use_dynamic_bsz, "critic.forward_max_token_len_per_gpu",
             critic.forward_max_token_len_per_gpu, cp("critic", critic)),
        ]
    for flag, on, key, budget, (cp_key, cp_size) in budgets:
        if not on:
            continue
        if budget is None:
            problems.append(
                f"{flag}=true needs {key}: the real tokens one micro-batch may hold on one rank, at least the "
                f"longest sequence ({longest_text}); set it, or {flag}=false"
            )
        elif budget * cp_size < longest and cp_size > 1:
            problems.append(
                f"{key}={budget} x {cp_key}={cp_size} = {budget * cp_size} tokens per micro-batch (each "
                f"context-parallel rank holds 1/{cp_size} of it) is smaller than the longest sequence ({longest_text}); "
                f"a micro-batch must hold one whole sequence: raise {key} to at least {-(-longest // cp_size)}"
            )
        elif budget * cp_size < longest:
            problems.append(
                f"{key}={budget} is smaller than the longest sequence ({longest_text}); a micro-batch must "
                f"hold one whole sequence: raise {key} to at least {longest}"
            )


def _policy_loss(cfg: PPOConfig, problems: list[str]) -> None:
    """The hyper-parameters the chosen policy loss needs are set and consistent."""
    loss = cfg.actor_rollout_ref.actor.policy_loss
    key = "actor_rollout_ref.actor.policy_loss"
    if loss.loss_mode == "dro" and loss.dro_beta is None:
        problems.append(f"{key}.loss_mode=dro needs {key}.dro_beta (> 0, e.g. 0.1); it has no default")
    if loss.loss_mode == "clip_cov" and not loss.clip_cov_lb < loss.clip_cov_ub:
        problems.append(
            f"{key}.clip_cov_lb={loss.clip_cov_lb} must be below {key}.clip_cov_ub={loss.clip_cov_ub}: "
            "no token's covariance could fall between them"
        )
    if loss.loss_mode == "bypass_mode":
        from verl.algos.rollout_correction import parse_is_threshold, parse_rs

        rc = loss.rollout_correction
        try:
            if rc.rollout_is is not None:
                parse_is_threshold(rc.rollout_is_threshold, f"{key}.rollout_correction.rollout_is_threshold")
            if rc.rollout_rs is not None:
                parse_rs(rc.rollout_rs, rc.rollout_rs_threshold)
        except ValueError as exc:
            problems.append(f"{key}.rollout_correction: {exc}")


def _rs_threshold_alone(key: str, rc: Any, problems: list[str]) -> None:
    """A rejection bound with no rejection test to bound: nothing would be rejected."""
    if rc.rollout_rs_threshold is not None and rc.rollout_rs is None:
        problems.append(
            f"{key}.rollout_rs_threshold={rc.rollout_rs_threshold} is set, but {key}.rollout_rs=null runs no rejection "
            f"test, so nothing is rejected: set {key}.rollout_rs (e.g. token_k1 or seq_max_k2), or drop the threshold"
        )


def _old_log_prob(cfg: PPOConfig, problems: list[str]) -> None:
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    key = "actor_rollout_ref.actor.old_log_prob"
    if actor.old_log_prob == "current":
        if not cfg.one_actor_update:
            problems.append(
                f"{key}=current needs each batch to be one optimizer step (ppo_epochs={actor.ppo_epochs}, "
                f"ppo_mini_batch_size={actor.ppo_mini_batch_size} of data.train_batch_size="
                f"{cfg.data.train_batch_size}): after the first update the current policy is no longer the "
                f"one that sampled; use ppo_epochs=1 and ppo_mini_batch_size=data.train_batch_size, or "
                f"{key}=recompute (or rollout)"
            )
        if cfg.algorithm.use_kl_in_reward:
            problems.append(
                f"{key}=current leaves no old log-probabilities before the update, and "
                f"algorithm.use_kl_in_reward=true needs them for the reward; use {key}=recompute"
            )
    truncated = rollout.top_p < 1.0 or rollout.top_k > 0
    if cfg.old_log_prob_source == "rollout" and truncated and not actor.replay_sampling_mask:
        problems.append(
            f"{key}=rollout takes the engine's log-probabilities, which with top_p={rollout.top_p} / "
            f"top_k={rollout.top_k} are of the truncated distribution, while actor_rollout_ref.actor."
            f"replay_sampling_mask=false makes the update's full-vocabulary ones; set replay_sampling_mask=true, "
            f"turn top_p/top_k off or use {key}=recompute"
            + (" (algorithm.rollout_correction.bypass_mode=true chose rollout)" if actor.old_log_prob == "auto" else "")
        )
    _rollout_correction(cfg, problems)


def _rollout_mode(cfg: PPOConfig, problems: list[str]) -> None:
    """``trainer.rollout_mode``: the streaming rollout heads the PPO/GRPO step only."""
    mode = cfg.trainer.rollout_mode
    at, rollout = cfg.trainer.async_training, cfg.actor_rollout_ref.rollout
    key = "trainer.async_training"
    if mode != "async":
        for name, on in (("partial_rollout=true", at.partial_rollout), ("stale_samples=drop", at.stale_samples == "drop")):
            if on:
                problems.append(f"{key}.{name} applies to the async rollout: set trainer.rollout_mode=async (it is {mode})")
    if at.partial_rollout:
        why = ("actor_rollout_ref.rollout.stop (stop strings: one spanning two segments would go unseen; use stop_token_ids)"
               if rollout.stop else "actor_rollout_ref.rollout.multi_turn.enable=true (the agent loop makes its own engine calls)"
               if rollout.multi_turn.enable else "algorithm.adv_estimator=remax (its greedy baseline is one whole call)"
               if cfg.algorithm.adv_estimator == "remax" else None)
        if why is not None:
            problems.append(f"{key}.partial_rollout=true generates in segments, which does not fit {why}: set partial_rollout=false")
    if at.fill_update_window:
        rollout_ranks = cfg.trainer.placement.get("rollout", [])
        why = (f"trainer.rollout_mode=async (it is {mode})" if mode != "async" else "partial_rollout=true"
               if not at.partial_rollout else "the rollout on ranks of its own (trainer.placement.rollout; colocated "
               "there is no update to overlap)" if not rollout_ranks else None)
        if why is not None:
            problems.append(f"{key}.fill_update_window=true needs {why}: set fill_update_window=false")
    if at.free_running:
        why = (f"trainer.rollout_mode=async (it is {mode})" if mode != "async" else "the rollout on ranks of its own "
               "(trainer.placement.rollout)" if not cfg.trainer.placement.get("rollout") else None)
        if why is not None:
            problems.append(f"{key}.free_running=true needs {why}: set free_running=false")
        elif at.fill_update_window:
            problems.append(f"{key}.free_running=true already generates through the update window: set fill_update_window=false")
    if mode == "sync":
        return
    kind = ("data.pairs=true (DPO)" if cfg.data.pairs else "algorithm.hybrid.enable=true" if cfg.algorithm.hybrid.enable
            else "algorithm.filter_groups.enable=true (dynamic sampling)" if cfg.algorithm.filter_groups.enable else None)
    if kind is not None:
        problems.append(
            f"trainer.rollout_mode={mode} streams the PPO/GRPO step's rollout; {kind} draws its batches another way: "
            "use trainer.rollout_mode=sync"
        )


def _rollout_correction(cfg: PPOConfig, problems: list[str]) -> None:
    """``algorithm.rollout_correction``: bounds parse; bypass and decoupled modes fit the old log-probs' source."""
    rc = cfg.algorithm.rollout_correction
    key, old_key = "algorithm.rollout_correction", "actor_rollout_ref.actor.old_log_prob"
    _rs_threshold_alone(key, rc, problems)
    _rs_threshold_alone(
        "actor_rollout_ref.actor.policy_loss.rollout_correction", cfg.actor_rollout_ref.actor.policy_loss.rollout_correction,
        problems,
    )
    old, loss_mode = cfg.actor_rollout_ref.actor.old_log_prob, cfg.actor_rollout_ref.actor.policy_loss.loss_mode
    if rc.rollout_is is not None or rc.rollout_rs is not None:  # (a default config imports no registry)
        from verl.algos.rollout_correction import parse_is_threshold, parse_rs

        try:
            if rc.rollout_is is not None:
                parse_is_threshold(rc.rollout_is_threshold, f"{key}.rollout_is_threshold")
            if rc.rollout_rs is not None:
                parse_rs(rc.rollout_rs, rc.rollout_rs_threshold)
        except ValueError as exc:
            problems.append(f"{key}: {exc}")
    if rc.bypass_mode:
        if loss_mode != "bypass_mode":
            problems.append(
                f"{key}.bypass_mode=true makes the policy loss bypass_mode (loss_type={rc.loss_type}), but "
                f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}; drop one of the two"
            )
        if old in ("recompute", "current"):
            problems.append(
                f"{key}.bypass_mode=true takes the engine's log-probs as the old ones, but {old_key}={old}; "
                f"leave {old_key}=auto (or rollout), or set bypass_mode=false"
            )
    elif rc.active and old in ("current", "rollout"):
        problems.append(
            f"{key}.rollout_is/rollout_rs (decoupled mode) compare the trainer's old log-probs with the engine's "
            f"before the update, but {old_key}={old} "
            + ("gives none before it" if old == "current" else "makes them the engine's own (every weight 1)")
            + f"; use {old_key}=auto (or recompute), or {key}.bypass_mode=true"
        )


def _free_running_ranks(ranks: dict[str, tuple[int, ...]], problems: list[str]) -> None:
    """``free_running``: the rollout's ranks run no pass of the step (the generator thread holds
    the engine beside the main thread's collectives): none of the actor and critic. (A reference on
    them owns the same ranks, as placement allows only, so it computes with the batch:
    ``RLWorld.ref_ahead``.)"""
    from verl.parallel.placement import show_ranks

    rollout = set(ranks["rollout"])
    shared = [role for role in ("actor", "critic") if role in ranks and rollout & set(ranks[role])]
    if shared:
        problems.append(
            f"trainer.async_training.free_running=true needs ranks that only generate, but the rollout's ranks "
            f"{show_ranks(ranks['rollout'])} also hold the {' and the '.join(shared)} (trainer.placement); place "
            f"{'it' if len(shared) == 1 else 'them'} on other ranks (the reference may share the rollout's), or set "
            "free_running=false"
        )


def _ppo_layouts(cfg: PPOConfig, world: int, world_text: str, problems: list[str]) -> None:
    """Every check of a PPO config that depends on the world size (and ``trainer.placement``)."""
    from verl.parallel.placement import placement_problems, show_ranks

    arr = cfg.actor_rollout_ref
    actor, rollout = arr.actor, arr.rollout
    n, train_bs = rollout.n, cfg.data.train_batch_size
    roles = ["actor"] + [
        role for role, on in (("ref", cfg.use_reference), ("critic", cfg.use_critic),
                              ("reward_model", cfg.reward_model.enable), ("teacher", cfg.use_teacher)) if on
    ]
    ranks, placed = placement_problems(cfg.trainer.placement, world, roles)
    if placed:
        problems.extend(placed)
        return

    if cfg.trainer.async_training.free_running and cfg.trainer.placement.get("rollout"):
        _free_running_ranks(ranks, problems)

    placed = bool(cfg.trainer.placement)

    def size(role: str) -> tuple[int, str]:  # the ranks a role's layout must fit
        if not cfg.trainer.placement:
            return world, world_text
        return len(ranks[role]), f"{len(ranks[role])} (the {role}'s ranks {show_ranks(ranks[role])}, trainer.placement)"

    layout = _layout("actor", "actor_rollout_ref.actor.megatron", actor.megatron, *size("actor"), problems, placed=placed)
    if layout is not None:
        _mini_batches("actor_rollout_ref.actor", actor.ppo_mini_batch_size,
                      None if actor.use_dynamic_bsz else actor.ppo_micro_batch_size_per_gpu, n, train_bs, *layout,
                      problems)
    if cfg.use_reference:
        _layout("reference", "actor_rollout_ref.ref.megatron", arr.ref.megatron, *size("ref"), problems, placed=placed)
    if cfg.use_critic:
        critic = cfg.critic
        layout = _layout("critic", "critic.megatron", critic.megatron, *size("critic"), problems, placed=placed)
        if layout is not None:
            _mini_batches("critic", critic.ppo_mini_batch_size,
                          None if critic.use_dynamic_bsz else critic.ppo_micro_batch_size_per_gpu, n, train_bs,
                          *layout, problems)
    if cfg.reward_model.enable:
        _layout("reward model", "reward_model.megatron", cfg.reward_model.megatron, *size("reward_model"), problems, placed=placed)
    if cfg.use_teacher:
        _layout("teacher", "distillation.teacher_model.megatron", cfg.distillation.teacher_model.megatron,
                *size("teacher"), problems, placed=placed)
    _ulysses(cfg, roles, size, problems)
    rollout_ranks, rollout_text = size("rollout")  # the actor's ranks unless the rollout is placed apart
    if rollout_ranks % rollout.tensor_model_parallel_size:
        fits = "its ranks" if cfg.trainer.placement else "the world"
        problems.append(
            f"the rollout layout does not fit {fits}: actor_rollout_ref.rollout.tensor_model_parallel_size="
            f"{rollout.tensor_model_parallel_size} does not divide {'' if cfg.trainer.placement else 'the world size '}"
            f"{rollout_text}"
        )


def _attention_heads(path: str | None) -> int | None:
    """``num_attention_heads`` of the Hugging Face config.json in ``path`` (its text config's for a
    vision-language model), or None when there is none to read."""
    import json
    import os

    file = os.path.join(os.path.expanduser(path), "config.json") if path else ""
    if not os.path.isfile(file):
        return None
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None  # the model loader reports an unreadable config
    heads = config.get("num_attention_heads", (config.get("text_config") or {}).get("num_attention_heads"))
    return heads if isinstance(heads, int) else None


def _ulysses(cfg: PPOConfig, roles: list[str], size: Callable[[str], tuple[int, str]], problems: list[str]) -> None:
    """Ulysses sequence parallelism (``<role>.fsdp_config.ulysses_sequence_parallel_size``): an FSDP2 role
    only, a divisor of the role's ranks and of the model's attention heads."""
    arr = cfg.actor_rollout_ref
    settings = {  # role -> (its key prefix, strategy, FSDP config, model path)
        "actor": ("actor_rollout_ref.actor", arr.actor.strategy, arr.actor.fsdp_config, arr.model.path),
        "ref": ("actor_rollout_ref.ref", arr.ref.strategy, arr.ref.fsdp_config, arr.model.path),
        "critic": ("critic", cfg.critic.strategy, cfg.critic.fsdp_config, cfg.critic.model.path),
        "reward_model": ("reward_model", cfg.reward_model.strategy, cfg.reward_model.fsdp_config,
                         cfg.reward_model.model.path),
    }
    for role, (prefix, strategy, fsdp, path) in settings.items():
        sp = fsdp.ulysses_sequence_parallel_size
        if role not in roles or sp == 1:
            continue
        key = f"{prefix}.fsdp_config.ulysses_sequence_parallel_size={sp}"
        if strategy != "fsdp2":
            if role == "ref":  # follows the actor's size; a Megatron reference reads neither
                continue
            problems.append(f"{key} splits sequences on the FSDP2 engine; set {prefix}.strategy=fsdp2, or use "
                            f"{prefix}.megatron.context_parallel_size on Megatron")
            continue
        ranks, ranks_text = size(role)
        if ranks % sp:
            problems.append(f"{key} does not divide the {role}'s ranks, {ranks_text}; set it to a divisor of {ranks}")
        heads = _attention_heads(path)
        if heads is not None and heads % sp:
            problems.append(f"{key} does not divide the model's {heads} attention heads (num_attention_heads in "
                            f"{path}/config.json); set it to a divisor of {heads}")


def validate_sft(cfg: SFTConfig, world_size: int | None) -> None:
    """Check an SFT config as a whole; raise one ConfigError listing every problem."""
    problems: list[str] = []
    world = _world(cfg.trainer, world_size, problems)
    layout = None if world is None else _layout("model", "megatron", cfg.megatron, *world, problems)
    data = cfg.data
    if layout is not None:
        dp, dp_text = layout
        if data.train_batch_size % (data.micro_batch_size_per_gpu * dp):
            problems.append(
                f"data.train_batch_size={data.train_batch_size} is not a multiple of "
                f"data.micro_batch_size_per_gpu={data.micro_batch_size_per_gpu} x data-parallel size {dp_text}"
            )
    _data_files(cfg.data, problems)
    _resume(cfg.trainer, problems)
    _output_folders(cfg.trainer, problems)
    _check_names(cfg, problems)
    _lora_targets({"model": cfg.model}, problems)
    _lora_without_rank(cfg, ("model",), problems)
    _raise(problems)
