"""Whole-config checks: parallel layouts against the world size, batch divisibility, registry names.

Every check appends a message to one list, so a user sees all problems of a config at once.
Each layout message prints every degree involved and the world size.

Registries elsewhere in verl (advantage estimators, policy losses, reward managers) can make
names in the config checked at load time with :func:`register_choices`; a name whose registry
was never imported is left to that registry to reject when it is looked up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from verl.config.core import ConfigError, did_you_mean
from verl.parallel.layout import LayoutNames, layout_problems

if TYPE_CHECKING:
    from verl.config.schema import MegatronConfig, PPOConfig, SFTConfig

__all__ = ["register_choices", "registered_choices", "validate_ppo", "validate_sft"]

_CHOICES: dict[str, tuple[Callable[[], Iterable[str]], str]] = {}
_MISSING = object()


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


def _check_names(cfg: Any, problems: list[str]) -> None:
    for path, (names, what) in _CHOICES.items():
        value = _get(cfg, path)
        if value is _MISSING or value is None:
            continue
        known = sorted(set(names()))
        if value not in known:
            problems.append(
                f"{path}={value!r} is not a registered {what}{did_you_mean(str(value), known)} "
                f"(registered: {', '.join(known)})"
            )


def _world(trainer: Any, world_size: int | None, problems: list[str]) -> tuple[int, str]:
    """The world size to check against and how to print it."""
    declared = trainer.nnodes * trainer.n_gpus_per_node
    shape = f"trainer.nnodes={trainer.nnodes} x trainer.n_gpus_per_node={trainer.n_gpus_per_node}"
    if world_size is None:
        return declared, f"{declared} ({shape})"
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    if world_size != declared:
        per_node = f"{world_size // trainer.nnodes}" if world_size % trainer.nnodes == 0 else "WORLD/nnodes"
        problems.append(
            f"the launched world size {world_size} differs from {shape} = {declared}; "
            f"set trainer.n_gpus_per_node={per_node} (and trainer.nnodes) to match the launcher"
        )
    return world_size, f"{world_size} (launched)"


def _layout(role: str, prefix: str, m: MegatronConfig, world: int, world_text: str, problems: list[str]) -> tuple[int, str] | None:
    """Check one role's Megatron layout; return (data-parallel size, how it was derived) or None."""
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    found = layout_problems(
        ranks=world,
        ranks_text=f"the world size {world_text}",
        tensor=tp,
        pipeline=pp,
        context=cp,
        virtual_pipeline=m.virtual_pipeline_model_parallel_size,
        sequence_parallel=m.sequence_parallel,
        names=LayoutNames(prefix=f"{prefix}."),
    )
    for problem in found:
        lead = f"the {role} layout does not fit the world: " if problem.kind == "divide" else ""
        problems.append(lead + problem.text)
    if any(problem.kind in ("degree", "divide") for problem in found):
        return None
    dp = world // (tp * pp * cp)
    return dp, f"{dp} (world {world} / (tensor {tp} x pipeline {pp} x context {cp}))"


def _mini_batches(
    prefix: str, mini: int, micro: int, n: int, train_bs: int, dp: int, dp_text: str, problems: list[str]
) -> None:
    """PPO mini/micro-batch divisibility of one trained role (actor or critic)."""
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
    elif (seqs // dp) % micro:
        problems.append(
            f"{prefix}.ppo_micro_batch_size_per_gpu={micro} does not divide the {seqs // dp} sequences of a "
            f"mini-batch on one rank ({prefix}.ppo_mini_batch_size={mini} x actor_rollout_ref.rollout.n={n} / "
            f"data-parallel size {dp_text})"
        )


def _resume(trainer: Any, problems: list[str]) -> None:
    if trainer.resume_mode == "resume_path" and not trainer.resume_from_path:
        problems.append("trainer.resume_mode=resume_path needs trainer.resume_from_path")


def _raise(problems: list[str]) -> None:
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} problems in the config:\n  - " + "\n  - ".join(problems))


def validate_ppo(cfg: PPOConfig, world_size: int | None) -> None:
    """Check a PPO config as a whole; raise one ConfigError listing every problem."""
    problems: list[str] = []
    world, world_text = _world(cfg.trainer, world_size, problems)
    arr = cfg.actor_rollout_ref
    actor, rollout = arr.actor, arr.rollout
    n, train_bs = rollout.n, cfg.data.train_batch_size

    layout = _layout("actor", "actor_rollout_ref.actor.megatron", actor.megatron, world, world_text, problems)
    if layout is not None:
        _mini_batches("actor_rollout_ref.actor", actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu,
                      n, train_bs, *layout, problems)
    if cfg.use_reference:
        _layout("reference", "actor_rollout_ref.ref.megatron", arr.ref.megatron, world, world_text, problems)
    if cfg.use_critic:
        critic = cfg.critic
        layout = _layout("critic", "critic.megatron", critic.megatron, world, world_text, problems)
        if layout is not None:
            _mini_batches("critic", critic.ppo_mini_batch_size, critic.ppo_micro_batch_size_per_gpu,
                          n, train_bs, *layout, problems)
    if cfg.reward_model.enable:
        _layout("reward model", "reward_model.megatron", cfg.reward_model.megatron, world, world_text, problems)
        if not cfg.reward_model.model.path:
            problems.append("reward_model.enable=true needs reward_model.model.path")

    if world % rollout.tensor_model_parallel_size:
        problems.append(
            f"the rollout layout does not fit the world: actor_rollout_ref.rollout.tensor_model_parallel_size="
            f"{rollout.tensor_model_parallel_size} does not divide the world size {world_text}"
        )
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
    if cfg.algorithm.filter_groups.enable and not cfg.algorithm.filter_groups.metric:
        problems.append("algorithm.filter_groups.enable=true needs algorithm.filter_groups.metric (e.g. acc or score)")
    _resume(cfg.trainer, problems)
    _check_names(cfg, problems)
    _raise(problems)


def validate_sft(cfg: SFTConfig, world_size: int | None) -> None:
    """Check an SFT config as a whole; raise one ConfigError listing every problem."""
    problems: list[str] = []
    world, world_text = _world(cfg.trainer, world_size, problems)
    layout = _layout("model", "megatron", cfg.megatron, world, world_text, problems)
    data = cfg.data
    if layout is not None:
        dp, dp_text = layout
        if data.train_batch_size % (data.micro_batch_size_per_gpu * dp):
            problems.append(
                f"data.train_batch_size={data.train_batch_size} is not a multiple of "
                f"data.micro_batch_size_per_gpu={data.micro_batch_size_per_gpu} x data-parallel size {dp_text}"
            )
    _resume(cfg.trainer, problems)
    _check_names(cfg, problems)
    _raise(problems)
