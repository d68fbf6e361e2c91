"""What ``main_ppo`` checks before it builds any model, beyond the config's own validation.

``PPOConfig.validate`` (``verl.config.validation``) already refuses layouts that do not divide
the world, a rollout TP' that does not divide the actor's ranks and batch sizes that do not
divide. :func:`check_ppo_inputs` adds what needs files or the algorithm registries:

- the model directories and data files exist, and a custom dataset class (``data.custom_cls``)
  can be imported and is a ``torch.utils.data.Dataset``;
- the algorithm has the roles it needs: an estimator that reads critic values with the critic
  off, a KL estimator that needs whole distributions, pass@k with one sample per prompt;
- each role's TP/PP splits its model (heads, MLP, layers), and the rollout TP' divides the
  model's attention heads (the engine shards them);
- every ``data_source`` in the data files has a rule-based scorer (unless a reward model or a
  custom reward function scores them), and where one of them runs the model's code (``codecontests``,
  ``apps``, ...) the sandbox can confine it here (bubblewrap), or ``sandbox.allow_unconfined`` waives it;
  every row that one of verl's own scorers would score has a ``reward_model.ground_truth`` (a
  null one scored 0 in silence); with a custom dataset class (``data.custom_cls``) the
  class reads the files, in its own format and columns, so :func:`check_dataset_scorers` checks
  the data sources of the built dataset instead;
- a reward model reads the policy's token ids, so it must share the policy's tokenizer;
- on-policy distillation's teacher scores the policy's token ids: the same tokenizer and the same
  vocabulary size (``vocab_size``), and its layout splits its own model;
- the output locations can be written (``verl.trainer.run_checks``).

Every problem found is reported at once, each naming the setting at fault.

:func:`preflight` is the one entry: the config's validation against the launched world and
these checks, once per config and world size (``main_ppo`` runs it before the world starts, the
trainer again when the Python API built the config: each start checks, and scans the data
files, once).
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from verl.config.schema import PPOConfig
from verl.engine.torch_engine import registered_module
from verl.trainer.run_checks import as_file_list, check_run_outputs, missing_inputs

if TYPE_CHECKING:
    from torch.utils.data import Dataset

logger = logging.getLogger(__name__)

__all__ = [
    "check_dataset_scorers",
    "check_ppo_inputs",
    "data_sources",
    "missing_advantage_inputs",
    "needs_values",
    "preference_pairs_problem",
    "preflight",
    "sandbox_problems",
]

# The world size a config passed preflight() for (an attribute of the config object).
_PASSED = "_verl_preflight_world_size"

# Data sources listed in a message at most.
_SHOWN = 5


# What the step hands every advantage estimator (``RLTrainer.compute_advantage``); an estimator
# whose required arguments are not all here cannot run in main_ppo yet.
STEP_ADVANTAGE_INPUTS = frozenset(
    {"token_level_rewards", "response_mask", "index", "gamma", "lam", "norm_adv_by_std_in_grpo", "values", "reward_baselines"}
)


def missing_advantage_inputs(adv_estimator: str) -> list[str]:
    """The required arguments of the registered estimator that the step does not supply."""
    from verl.algos import get_adv_estimator

    params = inspect.signature(get_adv_estimator(adv_estimator)).parameters.values()
    return [p.name for p in params if p.default is inspect.Parameter.empty and p.name not in STEP_ADVANTAGE_INPUTS]


def needs_values(adv_estimator: str) -> bool:
    """Whether the registered advantage estimator reads critic ``values``."""
    from verl.algos import get_adv_estimator

    return "values" in inspect.signature(get_adv_estimator(adv_estimator)).parameters


def data_sources(files: str | list[str] | None, key: str) -> set[str]:
    """The distinct values of column ``key`` (``data.reward_fn_key``) in ``files``."""
    from verl.data.io import TableStore

    paths = as_file_list(files)
    if not paths:
        return set()
    store = TableStore(paths, columns=[key.split(".")[0]])
    store.require_columns([key])
    return {str(v) for _, _, values in store.iter_column(key) for v in values}


def preference_pairs_problem(where: str, columns: list[str], reward_fn_key: str, algorithm: str) -> str | None:
    """The problem of training reward-based ``algorithm`` on ``where``, whose ``columns`` are
    preference pairs (``chosen``, ``rejected``) with no reward-function column; None otherwise."""
    if not ("chosen" in columns and "rejected" in columns) or reward_fn_key.split(".")[0] in columns:
        return None
    return (
        f"{where} holds preference pairs (columns 'chosen' and 'rejected') and no {reward_fn_key!r} column "
        f"naming a reward function: {algorithm} learns from a reward given to each sampled response, and "
        "preference pairs give none. Train on pairs with DPO (verl.RLTrainer(algorithm=\"dpo\")), or give "
        "prompts with data_source and reward_model.ground_truth (verl.utils.load_hf_dataset remaps them), "
        "or score responses with a reward model (reward_model.enable=true)"
    )


def _preference_problems(cfg: PPOConfig) -> list[str]:
    from verl.data.io import TableStore

    if cfg.data.pairs:
        problems = []
        if cfg.data.val_files:
            problems.append(
                f"data.pairs=true: validation of preference pairs is not supported; set data.val_files=null "
                f"(got {cfg.data.val_files})"
            )
        if cfg.use_critic:
            problems.append("data.pairs=true trains with DPO, which has no critic; set critic.enable=false")
        if cfg.data.custom_cls.path:
            problems.append("data.pairs=true reads its pairs with the built-in dataset; unset data.custom_cls.path")
        return problems
    if cfg.data.custom_cls.path:
        return []
    problems = []
    algorithm = f"algorithm.adv_estimator={cfg.algorithm.adv_estimator!r}"
    for setting in ("train_files", "val_files"):
        for path in as_file_list(getattr(cfg.data, setting)):
            columns = TableStore([path], columns=[]).sources[0].column_names
            problem = preference_pairs_problem(f"data.{setting}: {path}", columns, cfg.data.reward_fn_key, algorithm)
            if problem:
                problems.append(problem)
    return problems


def _algorithm_problems(cfg: PPOConfig) -> list[str]:
    problems = []
    algo, actor = cfg.algorithm, cfg.actor_rollout_ref.actor
    if needs_values(algo.adv_estimator) and not cfg.use_critic and not cfg.data.pairs:  # DPO uses no estimator
        problems.append(
            f"algorithm.adv_estimator={algo.adv_estimator} reads critic values, but critic.enable=false; "
            "enable the critic (critic.enable=true, or leave it null) or choose an estimator without one "
            "(grpo, rloo, reinforce_plus_plus, ...)"
        )
    missing = [] if cfg.data.pairs else missing_advantage_inputs(algo.adv_estimator)
    if missing:
        problems.append(
            f"algorithm.adv_estimator={algo.adv_estimator} needs {missing}, which the PPO step does not compute "
            "yet (the actor's forward does not keep sum_pi_squared, nor hand old log-probabilities to the "
            "estimator); call verl.algos.compute_advantage yourself, or choose grpo, rloo, opo, ..."
        )
    if algo.use_kl_in_reward and algo.kl_penalty.startswith("full"):
        problems.append(
            f"algorithm.kl_penalty={algo.kl_penalty} needs whole distributions; the in-reward penalty has "
            "token log-probabilities only (use kl, abs, mse or low_var_kl)"
        )
    if actor.use_kl_loss and actor.kl_loss_type.startswith("full"):
        problems.append(
            f"actor_rollout_ref.actor.kl_loss_type={actor.kl_loss_type} needs whole distributions, which the "
            "trainer does not keep; use kl, abs, mse or low_var_kl"
        )
    if algo.adv_estimator == "grpo_passk" and cfg.actor_rollout_ref.rollout.n < 2:
        problems.append(
            "algorithm.adv_estimator=grpo_passk needs actor_rollout_ref.rollout.n >= 2 (a group per prompt)"
        )
    return problems


def _cp_problems(prefix: str, m, spec) -> list[str]:
    """A role's ``context_parallel_size`` against its model, each problem naming the key."""
    from verl.models.builder import context_parallel_problems

    cp = m.context_parallel_size
    return [f"{prefix}.context_parallel_size={cp}: {p}" for p in context_parallel_problems(spec, cp)]


def _split_problems(cfg: PPOConfig) -> list[str]:
    """Each role's layout against its model's shapes (heads, MLP, layers), and the rollout TP'."""
    from verl.engine.build import load_model_spec
    from verl.hybrid.layout import check_rollout_degrees
    from verl.models.builder import split_problems
    from verl.models.pipeline_split import stage_layer_overrides

    arr = cfg.actor_rollout_ref
    if "fsdp2" in (arr.actor.strategy, arr.ref.strategy):
        replay = arr.actor.megatron.router_replay.mode
        refused = [] if replay == "disabled" else [
            f"actor_rollout_ref.actor.megatron.router_replay.mode={replay} with strategy=fsdp2: router replay is "
            "built in the Megatron engine only; set it to disabled"
        ]
        return _fsdp2_problems(cfg) + _fsdp2_critic_problems(cfg) + refused
    if registered_module(arr.model.path) is not None:
        return _plain_module_problems(cfg)
    spec = load_model_spec(arr.model)
    roles = [("actor_rollout_ref.actor.megatron", arr.actor.megatron, spec)]
    if cfg.use_reference:
        roles.append(("actor_rollout_ref.ref.megatron", arr.ref.megatron, spec))
    if cfg.use_critic and cfg.critic.strategy == "megatron":
        roles.append(("critic.megatron", cfg.critic.megatron, load_model_spec(cfg.critic.model)))
    problems = _fsdp2_critic_problems(cfg)
    for prefix, m, role_spec in roles:
        found = split_problems(
            role_spec,
            tp_size=m.tensor_model_parallel_size,
            pp_size=m.pipeline_model_parallel_size,
            vpp_size=m.virtual_pipeline_model_parallel_size,
            ep_size=m.expert_model_parallel_size, **stage_layer_overrides(m.override_transformer_config),
        )
        problems += [
            f"{prefix}.tensor_model_parallel_size={m.tensor_model_parallel_size} x "
            f"pipeline_model_parallel_size={m.pipeline_model_parallel_size} cannot split the model: {p}"
            for p in found
        ]
        # The reference follows the actor's CP unless set: one mistake, reported once (at the actor's key).
        if prefix == "actor_rollout_ref.actor.megatron" or m.context_parallel_size != arr.actor.megatron.context_parallel_size:
            problems += _cp_problems(prefix, m, role_spec)
    tp = arr.rollout.tensor_model_parallel_size
    problems += [
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}: {p}"
        for p in check_rollout_degrees(spec, tp)
    ]
    if spec.is_moe and arr.rollout.name == "vllm":
        world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
        ranks = len(cfg.trainer.placement.get("rollout", range(world)))
        if ranks != tp:
            problems.append(
                f"actor_rollout_ref.rollout.name=vllm with a Mixture-of-Experts model ({spec.model_type}) runs one "
                f"engine replica: set actor_rollout_ref.rollout.tensor_model_parallel_size={ranks} (the rollout's "
                f"ranks; it is {tp}). vLLM couples the data-parallel replicas of a MoE model (its experts split over "
                "every replica's ranks, each forward gathering across them), which verl's independent replicas "
                "cannot follow; or use actor_rollout_ref.rollout.name=hf"
            )
    return problems + _router_replay_problems(cfg, spec)


def _lora_size_problems(cfg: PPOConfig) -> list[str]:
    """A LoRA rank above the model's hidden size: an adapter of rank r on a d-wide layer has rank
    min(r, d) at most, so the rest is memory and time spent on nothing (and no longer low-rank)."""
    from verl.engine.build import load_model_spec

    problems = []
    models = [("actor_rollout_ref.model", cfg.actor_rollout_ref.model)]
    if cfg.use_critic:
        models.append(("critic.model", cfg.critic.model))
    for key, model in models:
        if model.lora_rank <= 0 or registered_module(model.path) is not None:
            continue
        hidden = load_model_spec(model, key=f"{key}.path").hidden_size
        if model.lora_rank > hidden:
            problems.append(
                f"{key}.lora_rank={model.lora_rank} is larger than the model's hidden size ({hidden}, {model.path}): an "
                f"adapter cannot have a rank above its layer's width, so it trains nothing more than a full update "
                f"would, with more memory; set {key}.lora_rank <= {hidden} (usually 8 to 64)"
            )
    return problems


def _runs_on_cuda(device: str) -> bool:
    """Whether ``trainer.device`` resolves to CUDA here (``auto``: when torch sees a GPU)."""
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device == "cuda"


def _router_replay_problems(cfg: PPOConfig, spec) -> list[str]:
    """``megatron.router_replay`` (verl.models.router_replay): R2 or R3 on the actor of a MoE model, where it is built."""
    arr = cfg.actor_rollout_ref
    problems = [
        f"{key}.megatron.router_replay.mode={m.router_replay.mode}: only the actor replays routing; set it to disabled"
        for key, m in (("actor_rollout_ref.ref", arr.ref.megatron), ("critic", cfg.critic.megatron))
        if m.router_replay.mode != "disabled"
    ]
    mode, m = arr.actor.megatron.router_replay.mode, arr.actor.megatron
    key = "actor_rollout_ref.actor.megatron.router_replay.mode"
    if mode == "disabled":
        return problems
    why = []
    if not spec.is_moe:
        why.append(f"{spec.model_type} is a dense model")
    if arr.actor.strategy != "megatron":
        why.append(f"actor.strategy={arr.actor.strategy} (the Megatron engine only)")
    if mode == "R2" and cfg.old_log_prob_source != "recompute":
        why.append(f"actor.old_log_prob resolves to {cfg.old_log_prob_source} (R2 records in the recompute pass: set recompute)")
    if mode == "R3":  # the rollout engine records the experts while it generates (hf_engine; vllm_engine on GPU)
        if arr.rollout.name == "vllm" and not _runs_on_cuda(cfg.trainer.device):
            why.append("rollout.name=vllm on CPU does not return the experts it routed to (vLLM 0.32 returns them only "
                       "under its Model Runner V2, which needs Triton, absent from the CPU build): set "
                       "actor_rollout_ref.rollout.name=hf, or use R2")
        elif arr.rollout.name not in ("hf", "vllm"):
            why.append(f"rollout.name={arr.rollout.name} does not return the experts it routed to (the transformers "
                       "engine records them, and vLLM on GPU): set actor_rollout_ref.rollout.name=hf, or use R2")
        if arr.rollout.multi_turn.enable:
            why.append("rollout.multi_turn.enable=true: the agent loop assembles its turns itself and the recording does "
                       "not follow them (single-turn only), or use R2")
        if cfg.trainer.rollout_mode == "async" and cfg.trainer.async_training.partial_rollout:
            why.append("trainer.async_training.partial_rollout=true: a resumed segment reads its tokens so far as a "
                       "prompt, so their routing would be recomputed, not the one that sampled them; turn it off, or use R2")
    if m.context_parallel_size > 1:
        why.append(f"CP {m.context_parallel_size} (1 only; tensor, sequence, pipeline and expert parallel are fine): "
                   "set context_parallel_size=1")
    if arr.model.enable_gradient_checkpointing:
        why.append("model.enable_gradient_checkpointing=true (Megatron's backward replay is not wired)")
    if why:
        problems.append(f"{key}={mode} cannot run here: " + "; ".join(why))
    return problems


def _model_folder_problems(cfg: PPOConfig) -> list[str]:
    """Each Hugging Face model folder against its config.json and the policy's tokenizer
    (``verl.models.safetensors_io.weight_problems``: missing shards, truncated or absent weights,
    an embedding of another size, a tokenizer larger than the embedding), and the vLLM engine's
    length against the policy's positions: found here, before the engines start, instead of as a
    library traceback (or vLLM's refusal) after."""
    from verl.data.tokenizer import load_tokenizer
    from verl.engine.build import load_model_spec
    from verl.models.safetensors_io import weight_problems

    arr = cfg.actor_rollout_ref
    if registered_module(arr.model.path) is not None:
        return []
    policy = arr.model
    tokenizer = load_tokenizer(
        os.path.expanduser(policy.tokenizer_path or policy.path), trust_remote_code=policy.trust_remote_code
    )
    # strategy=fsdp2 loads any transformers family (verl.engine.fsdp), which checks its weights as it loads.
    models = [] if arr.actor.strategy == "fsdp2" else [("actor_rollout_ref.model.path", policy)]
    if cfg.use_critic and registered_module(cfg.critic.model.path) is None and cfg.critic.strategy == "megatron":
        models.append(("critic.model.path", cfg.critic.model))
    if cfg.reward_model.enable and cfg.reward_model.model.path and cfg.reward_model.strategy == "megatron":
        models.append(("reward_model.model.path", cfg.reward_model.model))
    problems = []
    if arr.rollout.multi_turn.enable:  # the agent loop adds turns with the chat template: can it?
        from verl.rollout.agent.templates import check_template

        try:
            check_template(tokenizer)
        except ValueError as exc:
            problems.append(f"actor_rollout_ref.model.tokenizer_path={policy.tokenizer_path or policy.path}: {exc}")
    for key, model in models:
        spec = load_model_spec(model, key=key)
        found = weight_problems(os.path.expanduser(model.path), spec, tokenizer_size=len(tokenizer))
        problems += [f"{key}={model.path}: {p}" for p in found]
        if key == "actor_rollout_ref.model.path" and arr.rollout.name == "vllm" and not found:
            problems += _vllm_length_problems(cfg, spec)
    return problems


def _megatron_vlm_problems(cfg: PPOConfig) -> list[str]:
    """A vision-language policy on the Megatron actor pushes its weights, the vision tower's included,
    into a rollout on its own ranks only (``verl.hybrid.hf_push``); the send to a rollout on ranks of
    its own carries the decoder's alone, so that layout is refused before anything is built."""
    arr = cfg.actor_rollout_ref
    rollout_ranks = cfg.trainer.placement.get("rollout")
    if arr.actor.strategy != "megatron" or not rollout_ranks or registered_module(arr.model.path) is not None:
        return []
    from verl.models.megatron_vlm import is_vlm_config

    if not is_vlm_config(os.path.expanduser(arr.model.path)):
        return []
    return [
        f"trainer.placement.rollout={list(rollout_ranks)}: the Megatron actor of the vision-language model "
        f"{arr.model.path} pushes its weights (the vision tower's included) only into a rollout on its own ranks; "
        "a rollout on ranks of its own is not built for it: drop trainer.placement.rollout (docs/vlm.md)"
    ]


def _vllm_length_problems(cfg: PPOConfig, spec: Any) -> list[str]:
    """vLLM refuses a ``max_model_len`` (the rollout's prompt + response length) beyond the
    positions the model's config derives (``max_position_embeddings``, times a ``linear`` RoPE
    factor, as vLLM computes it)."""
    rollout = cfg.actor_rollout_ref.rollout
    limit = spec.max_position_embeddings * (spec.rope.factor if spec.rope.rope_type == "linear" else 1)
    length = rollout.prompt_length + rollout.response_length
    if length <= limit:
        return []
    return [
        f"actor_rollout_ref.rollout.prompt_length={rollout.prompt_length} + response_length={rollout.response_length} "
        f"= {length} tokens is above the {int(limit)} positions of the model "
        f"({cfg.actor_rollout_ref.model.path}/config.json max_position_embeddings={spec.max_position_embeddings}), "
        "which vLLM refuses; lower data.max_prompt_length / data.max_response_length (the rollout's lengths follow "
        "them) so that they sum to at most that"
    ]


def _data_parallel_only(cfg: PPOConfig, why: str, why_vpp_sp: str) -> list[str]:
    """The actor's (and reference's) Megatron degrees other than 1, each with ``why`` (the engine
    shards over data-parallel ranks only); ``why_vpp_sp`` for virtual pipeline / sequence parallelism."""
    arr = cfg.actor_rollout_ref
    roles = [("actor_rollout_ref.actor.megatron", arr.actor.megatron)]
    if cfg.use_reference:
        roles.append(("actor_rollout_ref.ref.megatron", arr.ref.megatron))
    problems = []
    for prefix, m in roles:
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
            if getattr(m, key) != 1:
                problems.append(f"{prefix}.{key}={getattr(m, key)}: {why}")
        if m.virtual_pipeline_model_parallel_size is not None or m.sequence_parallel:
            problems.append(f"{prefix}: {why_vpp_sp}")
    return problems


def _fsdp2_problems(cfg: PPOConfig) -> list[str]:
    """strategy=fsdp2 (``verl.engine.fsdp``): data parallelism only, padded rows; the actor and the
    reference on the same strategy."""
    arr = cfg.actor_rollout_ref
    problems = []
    if arr.actor.strategy != arr.ref.strategy and cfg.use_reference:
        problems.append(
            f"actor_rollout_ref.actor.strategy={arr.actor.strategy} but actor_rollout_ref.ref.strategy="
            f"{arr.ref.strategy}: the reference runs on the actor's engine; set both to the same strategy"
        )
    problems += _data_parallel_only(
        cfg, "strategy=fsdp2 shards over data-parallel ranks only; set it to 1 (or strategy=megatron)",
        "no virtual pipeline or sequence parallelism with strategy=fsdp2",
    )
    problems += _fsdp_size_problems(cfg, "actor_rollout_ref.actor", "actor", arr.actor.fsdp_config.fsdp_size)
    if cfg.use_reference:
        problems += _fsdp_size_problems(cfg, "actor_rollout_ref.ref", "ref", arr.ref.fsdp_config.fsdp_size)
    if arr.model.use_remove_padding:
        problems.append(
            "actor_rollout_ref.model.use_remove_padding=true: packed sequences run in Megatron models; strategy=fsdp2 "
            "feeds padded rows (the all-pad trailing columns cut); set it to false"
        )
    module = registered_module(arr.model.path)
    if module is not None:  # the module given generates whole; the actor trains a sharded copy of it
        problems += _module_rollout_problems(cfg, type(module).__name__)
    tp = arr.rollout.tensor_model_parallel_size
    if tp > 1 and module is None:
        from verl.utils.paths import load_json_object

        raw = load_json_object(os.path.join(os.path.expanduser(arr.model.path), "config.json"))
        raw.update(arr.model.override_config)
        for key in ("num_attention_heads", "num_key_value_heads"):
            heads = raw.get(key)
            if isinstance(heads, int) and heads % tp:
                problems.append(
                    f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} does not divide the model's {key}={heads}"
                )
    # The critic is a Megatron role of its own (a plain module's path as the critic is reported above).
    if cfg.use_critic and cfg.critic.strategy == "megatron" and registered_module(cfg.critic.model.path) is None:
        from verl.engine.build import load_model_spec
        from verl.models.builder import split_problems
        from verl.models.pipeline_split import stage_layer_overrides

        m = cfg.critic.megatron
        critic_spec = load_model_spec(cfg.critic.model)
        problems += [
            f"critic.megatron.tensor_model_parallel_size={m.tensor_model_parallel_size} x pipeline_model_parallel_size="
            f"{m.pipeline_model_parallel_size} cannot split the model: {p}"
            for p in split_problems(critic_spec, tp_size=m.tensor_model_parallel_size,
                                    pp_size=m.pipeline_model_parallel_size,
                                    vpp_size=m.virtual_pipeline_model_parallel_size,
                                    ep_size=m.expert_model_parallel_size, **stage_layer_overrides(m.override_transformer_config))
        ] + _cp_problems("critic.megatron", m, critic_spec)
    return problems


def _fsdp_size_problems(cfg: PPOConfig, key: str, role: str, fsdp_size: int) -> list[str]:
    """``<key>.fsdp_config.fsdp_size`` (HSDP) against the role's ranks: a divisor of them, the role on every rank."""
    world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    ranks = len(cfg.trainer.placement.get(role, range(world)))
    if fsdp_size in (-1, ranks):
        return []
    if fsdp_size < 1 or ranks % fsdp_size:
        return [f"{key}.fsdp_config.fsdp_size={fsdp_size} does not divide the role's {ranks} ranks; set a divisor of "
                f"{ranks} (HSDP) or -1 (shard over all)"]
    if ranks != world:
        return [f"{key}.fsdp_config.fsdp_size={fsdp_size}: HSDP needs the role on every rank ({ranks} of {world} "
                f"with trainer.placement.{role}); set fsdp_size=-1 or drop its placement"]
    return []


def _fsdp2_reward_model_problems(cfg: PPOConfig) -> list[str]:
    """reward_model.strategy=fsdp2: data parallelism only (the reward model scores padded rows)."""
    rm = cfg.reward_model
    if not rm.enable or rm.strategy != "fsdp2":
        return []
    why = "reward_model.strategy=fsdp2 shards over data-parallel ranks only; set it to 1 (or strategy=megatron)"
    problems = [f"reward_model.megatron.{key}={getattr(rm.megatron, key)}: {why}"
                for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")
                if getattr(rm.megatron, key) != 1]
    return problems + _fsdp_size_problems(cfg, "reward_model", "reward_model", rm.fsdp_config.fsdp_size)


def _fsdp2_critic_problems(cfg: PPOConfig) -> list[str]:
    """critic.strategy=fsdp2 (``verl.engine.fsdp``: a ``*ForSequenceClassification`` of any family, or a
    vision-language model's decoder and tower with verl's value head, ``verl.models.vlm.VLMValueModel``):
    data parallelism only, padded rows, a Hugging Face model directory; the reward model's on FSDP2 too."""
    if not cfg.use_critic or cfg.critic.strategy != "fsdp2":
        return _fsdp2_reward_model_problems(cfg)
    critic = cfg.critic
    m = critic.megatron
    why = "critic.strategy=fsdp2 shards over data-parallel ranks only; set it to 1 (or critic.strategy=megatron)"
    problems = [f"critic.megatron.{key}={getattr(m, key)}: {why}"
                for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")
                if getattr(m, key) != 1]
    problems += _fsdp_size_problems(cfg, "critic", "critic", critic.fsdp_config.fsdp_size)
    if m.virtual_pipeline_model_parallel_size is not None or m.sequence_parallel:
        problems.append("critic.megatron: no virtual pipeline or sequence parallelism with critic.strategy=fsdp2")
    if critic.model.use_remove_padding:
        problems.append(
            "critic.model.use_remove_padding=true: packed sequences run in Megatron models; critic.strategy=fsdp2 "
            "feeds padded rows; set it to false"
        )
    if critic.model.lora_rank > 0:
        problems.append(f"critic.model.lora_rank={critic.model.lora_rank}: LoRA runs on strategy=megatron; set it to 0")
    module = registered_module(critic.model.path)
    if module is not None:
        problems.append(
            f"critic.strategy=fsdp2: critic.model.path stands for the plain nn.Module {type(module).__name__}; a "
            "critic is a Hugging Face model directory (its *ForSequenceClassification, or a vision-language model)"
        )
    return problems + _fsdp2_reward_model_problems(cfg)


def _plain_module_problems(cfg: PPOConfig) -> list[str]:
    """A plain ``nn.Module`` policy (``verl.engine.torch_engine``): data parallelism only, no critic
    built from it."""
    arr = cfg.actor_rollout_ref
    module = type(registered_module(arr.model.path)).__name__
    problems = _data_parallel_only(
        cfg, f"the policy {module} is a plain nn.Module, which the plain PyTorch engine trains with data "
        "parallelism only; set it to 1", f"no virtual pipeline or sequence parallelism for the plain nn.Module {module}",
    )
    if arr.model.use_remove_padding:
        problems.append(
            f"actor_rollout_ref.model.use_remove_padding=true: packed sequences run in Megatron models; the plain "
            f"PyTorch engine feeds {module} its padded rows (the all-pad trailing columns cut); set it to false"
        )
    return problems + _module_rollout_problems(cfg, module)


def _module_rollout_problems(cfg: PPOConfig, module: str) -> list[str]:
    """A plain ``nn.Module`` policy generates with its own ``generate()`` on every rank of the actor
    (on the plain engine or FSDP2): no rollout TP' or placement apart, no critic made from it."""
    arr = cfg.actor_rollout_ref
    problems = []
    if arr.rollout.tensor_model_parallel_size != 1:
        problems.append(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={arr.rollout.tensor_model_parallel_size}: the "
            f"plain nn.Module {module} generates on its own rank; set it to 1"
        )
    if cfg.trainer.placement:
        problems.append(
            f"trainer.placement={dict(cfg.trainer.placement)}: the plain nn.Module {module} trains and generates "
            "itself on every rank (it is the rollout too); drop trainer.placement (device_map) to run it colocated"
        )
    if cfg.use_critic and registered_module(cfg.critic.model.path) is not None:
        problems.append(
            f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} trains a critic, and critic.model.path is the plain "
            f"nn.Module {module}, which has no value head; give the critic a Hugging Face model of a supported family "
            "(PPOUpdateOperator(critic=...)), or use a critic-free estimator (grpo, rloo, reinforce_plus_plus, ...)"
        )
    return problems


def _needs_rule_scorers(cfg: PPOConfig) -> bool:
    return not (cfg.custom_reward_function.path or cfg.reward_model.enable)


def _unscored(cfg: PPOConfig, setting: str, found: set[str]) -> list[str]:
    """The problem (at most one) of the data sources ``found`` in ``data.<setting>``."""
    from verl.rewards import known_data_sources
    from verl.roles.reward_model import has_rule_scorer

    key = cfg.data.reward_fn_key
    unknown = sorted(s for s in found if not has_rule_scorer(s))
    if not unknown:
        return []
    shown = ", ".join(repr(s) for s in unknown[:_SHOWN]) + (" ..." if len(unknown) > _SHOWN else "")
    return [
        f"data.{setting}: data.reward_fn_key={key!r} values {shown} have no rule-based scorer "
        f"(known: {', '.join(known_data_sources())}); register one (verl.rewards.register_scorer), "
        "set custom_reward_function.path/name, or enable a reward model"
    ]


def _scorer_problems(cfg: PPOConfig) -> list[str]:
    # A custom dataset class reads the files its own way: check_dataset_scorers checks what it built.
    if not _needs_rule_scorers(cfg) or cfg.data.custom_cls.path:
        return []
    from verl.data.io import TableStore

    problems = []
    every: set[str] = set()
    key = cfg.data.reward_fn_key
    for setting in ("train_files", "val_files"):
        paths = as_file_list(getattr(cfg.data, setting))
        if not paths:
            continue
        try:
            store = TableStore(paths, columns=[key.split(".")[0], _GROUND_TRUTH_COLUMN])
            store.require_columns([key])
            found, missing = _scan_rule_rows(store, key)
        except ValueError as exc:
            problems.append(f"data.{setting}: {exc}")
            continue
        problems += _unscored(cfg, setting, found) or _missing_ground_truths(setting, missing)
        every |= found
    return problems + sandbox_problems(cfg, every)


# Where the rule-based scorers find a row's ground truth: reward_model.ground_truth (the
# reference verl's record layout; RLHFDataset carries the column, the reward manager reads it).
_GROUND_TRUTH_COLUMN = "reward_model"


def _needs_ground_truth(data_source: str) -> bool:
    """Whether verl's own scorer serves ``data_source``: each compares a response with the row's
    ground truth (a null one scores every response 0, with no error). A scorer a user registered
    may not read it, and is trusted."""
    from verl.rewards import get_scorer

    try:
        scorer = get_scorer(data_source)
    except ValueError:
        return False
    return getattr(scorer, "__module__", "").startswith("verl.rewards")


def _scan_rule_rows(store: Any, key: str) -> tuple[set[str], dict[str, dict[str, Any]]]:
    """One pass over ``store``: (its distinct ``key`` values, and per file the rows whose data source
    a built-in scorer serves but whose ``reward_model.ground_truth`` is null or absent:
    ``{path: {"rows": [first rows], "count": n, "total": rows of the file, "sources": {...},
    "column": whether the file has the column}}``)."""
    found: set[str] = set()
    missing: dict[str, dict[str, Any]] = {}
    needs: dict[str, bool] = {}
    cursors: dict[int, _ColumnCursor] = {}
    for source, rows, values in store.iter_column(key):
        has_column = _GROUND_TRUTH_COLUMN in source.column_names
        if has_column:
            cursor = cursors.setdefault(id(source), _ColumnCursor(source, _GROUND_TRUTH_COLUMN))
            truths = cursor.take(rows.tolist())
        else:
            truths = [None] * len(values)
        for row, value, rm in zip(rows.tolist(), values, truths):
            ds = str(value)
            found.add(ds)
            if ds not in needs:
                needs[ds] = _needs_ground_truth(ds)
            if not needs[ds] or (isinstance(rm, Mapping) and rm.get("ground_truth") is not None):
                continue
            entry = missing.setdefault(
                source.path, {"rows": [], "count": 0, "total": source.num_rows, "sources": set(), "column": has_column}
            )
            entry["count"] += 1
            entry["sources"].add(ds)
            if len(entry["rows"]) < _SHOWN:
                entry["rows"].append(row)
    return found, missing


class _ColumnCursor:
    """The values of one column of a file at increasing rows, read once in file order."""

    def __init__(self, source: Any, column: str) -> None:
        self._batches = source.iter_column(column)
        self._start, self._values = 0, []

    def take(self, rows: list[int]) -> list[Any]:
        out = []
        for row in rows:
            while row >= self._start + len(self._values):
                self._start += len(self._values)
                self._values = next(self._batches)
            out.append(self._values[row - self._start])
        return out


def _missing_ground_truths(setting: str, missing: dict[str, dict[str, Any]]) -> list[str]:
    problems = []
    for path, e in missing.items():
        sources = ", ".join(repr(s) for s in sorted(e["sources"])[:_SHOWN])
        fix = (
            "fill them in, or score these rows with a reward model (reward_model.enable=true) or a "
            "custom_reward_function.path/name"
        )
        if not e["column"]:
            problems.append(
                f"data.{setting}: {path} has no reward_model column, and the rule-based scorer of data_source "
                f"{sources} compares each response with reward_model.ground_truth: add the column "
                "({'style': 'rule', 'ground_truth': ...}) to every row, or score with a reward model "
                "(reward_model.enable=true) or a custom_reward_function.path/name"
            )
            continue
        rows = ", ".join(str(r) for r in e["rows"]) + (" ..." if e["count"] > len(e["rows"]) else "")
        problems.append(
            f"data.{setting}: {path}: reward_model.ground_truth is null or missing in {e['count']} of {e['total']} "
            f"rows (row {rows}) of data_source {sources}, whose rule-based scorer compares each response with it "
            f"(every response of those rows would score 0, silently): {fix}"
        )
    return problems


def sandbox_problems(cfg: PPOConfig, sources: set[str]) -> list[str]:
    """The code scorers' data sources among ``sources`` run the model's programs in the sandbox
    (``verl.sandbox``): it must confine them here (bubblewrap installed and able to start, probed
    with a trial run), or ``sandbox.allow_unconfined=true`` must waive it. Checked before any model
    is built, so a missing bubblewrap is not first met at the first step's reward."""
    from verl.rewards.code import DATA_SOURCES as CODE_SOURCES

    code = sorted(s for s in sources if s in CODE_SOURCES)
    if not code:
        return []
    from verl.sandbox import Sandbox, SandboxUnavailable

    try:
        confined = Sandbox(cfg.sandbox).confined
    except (SandboxUnavailable, ValueError) as exc:
        return [
            f"data_source {', '.join(repr(s) for s in code)} is scored by running the model's programs in the "
            f"sandbox, which cannot start here: {exc}"
        ]
    if not confined:
        logger.warning(
            "data_source %s: the model's programs will run UNCONFINED (sandbox.allow_unconfined=true)", ", ".join(code)
        )
    return []


def check_dataset_scorers(cfg: PPOConfig, datasets: Mapping[str, Dataset | None]) -> None:
    """Every data source of the built datasets (``{"train_files": ds, "val_files": ds}``) has a
    rule-based scorer, and every row verl's own scorers score has a ground truth, as
    :func:`check_ppo_inputs` checks the files of the built-in dataset.

    For a dataset built on ``RLPromptDataset`` (``verl.utils.dataset.RLHFDataset`` subclasses)
    the data sources are read from its rows, one column; any other ``torch`` Dataset is not read
    here (a data source without a scorer then fails when its batch is scored).
    """
    from verl.data.rl_dataset import RLPromptDataset

    if not _needs_rule_scorers(cfg):
        return
    problems = []
    for setting, dataset in datasets.items():
        if dataset is None:
            continue
        if not isinstance(dataset, RLPromptDataset):
            logger.info(
                "data.%s: %s is not an RLHFDataset; its data sources are checked when scored",
                setting,
                type(dataset).__name__,
            )
            continue
        found, missing = _scan_rule_rows(dataset.store, dataset.reward_fn_key)
        problems += _unscored(cfg, setting, found) or _missing_ground_truths(setting, missing)
        problems += sandbox_problems(cfg, found)
    if problems:
        _raise(problems)


def _raise(problems: list[str]) -> None:
    if len(problems) == 1:
        raise ValueError(problems[0])
    raise ValueError(f"{len(problems)} problems:\n  - " + "\n  - ".join(problems))


def _reward_model_problems(cfg: PPOConfig) -> list[str]:
    rm = cfg.reward_model
    if not rm.enable or not rm.model.path:
        return []
    problems = []
    if rm.max_length is not None:
        problems.append(
            f"reward_model.max_length={rm.max_length}: truncating the reward model's inputs is not "
            "supported; leave it null (the reward model reads whole prompt + response sequences)"
        )
    if rm.model.input_tokenizer is not None:
        problems.append(
            f"reward_model.model.input_tokenizer={rm.model.input_tokenizer}: re-tokenising responses for the "
            "reward model is not supported; leave it null (the reward model must share the policy's "
            "tokenizer)"
        )
    from verl.data.tokenizer import load_tokenizer

    policy = cfg.actor_rollout_ref.model
    policy_tok = load_tokenizer(
        os.path.expanduser(policy.tokenizer_path or policy.path), trust_remote_code=policy.trust_remote_code
    )
    rm_tok = load_tokenizer(os.path.expanduser(rm.model.path), trust_remote_code=rm.model.trust_remote_code)
    if policy_tok.get_vocab() != rm_tok.get_vocab():
        problems += [
            f"reward_model.model.path={rm.model.path}: its tokenizer differs from the policy's; the reward "
            "model scores the policy's token ids, so it must use the same tokenizer (re-tokenising is not "
            "supported)"
        ]
    return problems


def _teacher_problems(cfg: PPOConfig) -> list[str]:
    """On-policy distillation's teacher reads the student's token ids: same tokenizer, same vocabulary
    size; its own layout splits its model."""
    if not cfg.use_teacher:
        return []
    from verl.config.schema import ModelConfig
    from verl.data.tokenizer import load_tokenizer
    from verl.engine.build import load_model_spec
    from verl.models.builder import split_problems
    from verl.models.pipeline_split import stage_layer_overrides

    teacher = cfg.distillation.teacher_model
    key = "distillation.teacher_model"
    policy = cfg.actor_rollout_ref.model
    problems = []
    policy_tok = load_tokenizer(
        os.path.expanduser(policy.tokenizer_path or policy.path), trust_remote_code=policy.trust_remote_code
    )
    teacher_tok = load_tokenizer(os.path.expanduser(teacher.model_path), trust_remote_code=teacher.trust_remote_code)
    if policy_tok.get_vocab() != teacher_tok.get_vocab():
        problems.append(
            f"{key}.model_path={teacher.model_path}: its tokenizer differs from the policy's; the teacher scores the "
            "student's token ids, so it must use the same tokenizer (distilling across tokenizers is not supported)"
        )
    spec = load_model_spec(
        ModelConfig(path=teacher.model_path, override_config=dict(teacher.override_config)), key=f"{key}.model_path"
    )
    if registered_module(policy.path) is None:
        student = load_model_spec(policy, key="actor_rollout_ref.model.path")
        if spec.vocab_size != student.vocab_size:
            problems.append(
                f"{key}.model_path={teacher.model_path}: the teacher's vocabulary (vocab_size={spec.vocab_size}) differs "
                f"from the student's (vocab_size={student.vocab_size}); their log-probabilities would be over "
                "different token sets. Use a teacher of the student's tokenizer and vocabulary"
            )
    loss = cfg.distillation.distillation_loss
    from verl.algos.distill import teacher_topk

    topk = teacher_topk(loss.loss_mode, loss.topk)
    if topk is not None and topk > spec.vocab_size:
        problems.append(
            f"distillation.distillation_loss.topk={topk} exceeds the teacher's vocabulary (vocab_size="
            f"{spec.vocab_size}); {loss.loss_mode} takes the teacher's topk most probable tokens: set topk <= "
            f"{spec.vocab_size}"
        )
    m = teacher.megatron
    problems += [
        f"{key}.megatron.tensor_model_parallel_size={m.tensor_model_parallel_size} x pipeline_model_parallel_size="
        f"{m.pipeline_model_parallel_size} cannot split the teacher: {p}"
        for p in split_problems(
            spec,
            tp_size=m.tensor_model_parallel_size,
            pp_size=m.pipeline_model_parallel_size,
            vpp_size=m.virtual_pipeline_model_parallel_size,
            ep_size=m.expert_model_parallel_size, **stage_layer_overrides(m.override_transformer_config),
        )
    ] + _cp_problems(f"{key}.megatron", m, spec)
    return problems


def preflight(cfg: PPOConfig, world_size: int | None = None, *, whole_run: bool = False) -> None:
    """Every check of ``cfg`` and its inputs before any model is built: ``cfg.validate`` against
    ``world_size`` (the launched world; None: ``trainer.nnodes x n_gpus_per_node``), then
    :func:`check_ppo_inputs` (``whole_run``: ``main_ppo``'s config, to which no Python operator adds
    tools). Runs once per config object and world size; a later call returns at once. Raises
    ``ConfigError``/``ValueError`` listing every problem."""
    if getattr(cfg, _PASSED, object()) == world_size:
        return
    cfg.validate(world_size=world_size)
    check_ppo_inputs(cfg, whole_run=whole_run)
    setattr(cfg, _PASSED, world_size)


def _multi_turn_problems(cfg: PPOConfig, *, whole_run: bool = False) -> list[str]:
    """The agent loop's tool, interaction and agent loop configs load (file, YAML, each class or
    function), every ``extra_info.agent_name`` of the data names a known agent loop, and with
    ``whole_run`` (``main_ppo``: no Python operator adds tools later) the agent loop has something
    to do (a tool, an interaction or an agent loop) and every tool ``extra_info.tools_kwargs`` names
    is configured."""
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if not mt.enable:
        return []
    key = "actor_rollout_ref.rollout.multi_turn"
    problems = []
    from verl.rollout.agent.parser import tool_call_parser

    try:
        tool_call_parser(mt.format)  # a name, or a parser's dotted path that imports
    except ValueError as exc:
        problems.append(str(exc))
    tool_names: list[str] | None = []  # None: the file did not load (reported)
    if mt.tool_config_path:
        from verl.rollout.agent import load_tool_config

        try:
            tool_names = [t.name for t in load_tool_config(os.path.expanduser(mt.tool_config_path))]
        except ValueError as exc:
            problems.append(f"{key}.tool_config_path: {exc}")
            tool_names = None
    if mt.interaction_config_path:
        from verl.rollout.agent import load_interaction_config

        try:
            load_interaction_config(os.path.expanduser(mt.interaction_config_path))
        except ValueError as exc:
            problems.append(f"{key}.interaction_config_path: {exc}")
    from verl.rollout.agent import known_agent_names, load_agent_loop_config

    loops: dict[str, Any] = {}
    path = cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path
    if path:
        try:
            loops = load_agent_loop_config(os.path.expanduser(path))
        except ValueError as exc:
            problems.append(f"actor_rollout_ref.rollout.agent.agent_loop_config_path: {exc}")
    if cfg.data.custom_cls.path:  # a custom dataset class reads the files its own way
        return problems
    known = known_agent_names(loops)
    scan = _extra_info_scan(cfg)
    for (setting, file), (names, tools) in scan.items():
        for name, first in names.items():
            if name not in known:
                problems.append(
                    f"data.{setting}: {file} row {first}: extra_info.agent_name={name!r} is not an agent loop; "
                    f"known: {known} (register one with verl.rollout.agent.register or list it in "
                    "actor_rollout_ref.rollout.agent.agent_loop_config_path)"
                )
        if whole_run and tool_names is not None:
            for tool, first in tools.items():
                if tool not in tool_names:
                    problems.append(
                        f"data.{setting}: {file} row {first}: extra_info.tools_kwargs names the tool {tool!r}, which is "
                        f"not configured (tools: {tool_names or 'none'}; {key}.tool_config_path="
                        f"{mt.tool_config_path}): add it to the tool config, or fix the name in the data"
                    )
    default = cfg.actor_rollout_ref.rollout.agent.default_agent_loop
    if default is not None and default not in known:
        problems.append(
            f"actor_rollout_ref.rollout.agent.default_agent_loop={default!r} is not an agent loop or program; known: "
            f"{known} (register one, or list it in actor_rollout_ref.rollout.agent.agent_loop_config_path)"
        )
    named = {name for names, _ in scan.values() for name in names} - {"tool_agent"}
    if default is not None:
        named.add(default)
    from verl.rollout.agent.agents import AGENT_PROGRAMS, AgentProgram

    programs = sorted(n for n in named if isinstance(loops.get(n), AgentProgram) or (n not in loops and n in AGENT_PROGRAMS))
    if programs and not cfg.data.return_raw_chat:
        problems.append(
            f"agent program(s) {programs} start from the prompts' chat messages: set data.return_raw_chat=true"
        )
    if whole_run and not (mt.tool_config_path or mt.interaction_config_path or path or named):
        problems.append(
            f"{key}.enable=true, but no tool, interaction or agent loop is configured: the agent loop would sample "
            f"one plain response per prompt. Set {key}.tool_config_path (tools the model may call), "
            f"{key}.interaction_config_path or actor_rollout_ref.rollout.agent.agent_loop_config_path, or "
            f"{key}.enable=false"
        )
    return problems


def _extra_info_scan(cfg: PPOConfig) -> dict[tuple[str, str], tuple[dict[str, int], dict[str, int]]]:
    """{(setting, file): ({extra_info.agent_name: its first row}, {tool named in extra_info.tools_kwargs:
    its first row})} of the data files, in one pass over the ``extra_info`` column (files without
    it, or that do not read, are left to the other checks)."""
    from verl.data.io import TableStore

    found = {}
    for setting in ("train_files", "val_files"):
        paths = as_file_list(getattr(cfg.data, setting))
        if not paths:
            continue
        try:
            store = TableStore(paths, columns=["extra_info"])
        except (ValueError, OSError):
            continue
        for source in store.sources:
            if "extra_info" not in source.column_names:
                continue
            names: dict[str, int] = {}
            tools: dict[str, int] = {}
            row = 0
            for values in source.iter_column("extra_info"):
                for value in values.to_pylist() if hasattr(values, "to_pylist") else values:
                    if isinstance(value, Mapping):
                        if value.get("agent_name") is not None:
                            names.setdefault(str(value["agent_name"]), row)
                        kwargs = value.get("tools_kwargs")
                        for tool in kwargs if isinstance(kwargs, Mapping) else ():
                            if kwargs[tool] is not None:  # parquet structs fill absent tools with null
                                tools.setdefault(str(tool), row)
                    row += 1
            found[(setting, source.path)] = (names, tools)
    return found


def check_ppo_inputs(cfg: PPOConfig, *, whole_run: bool = False) -> None:
    """Fail (ValueError listing every problem, each naming its setting) before any model is built.
    ``whole_run``: the config is the whole run (``main_ppo``), no Python operator adds tools to it."""
    arr = cfg.actor_rollout_ref
    # A plain nn.Module's directory holds its tokenizer, not a config.json (verl.engine.torch_engine).
    models = {} if registered_module(arr.model.path) is not None else {"actor_rollout_ref.model.path": arr.model.path}
    if cfg.use_critic and registered_module(cfg.critic.model.path) is None:
        models["critic.model.path"] = cfg.critic.model.path
    if cfg.reward_model.enable:
        models["reward_model.model.path"] = cfg.reward_model.model.path
    if cfg.use_teacher:
        models["distillation.teacher_model.model_path"] = cfg.distillation.teacher_model.model_path
    problems = missing_inputs(
        models=models, data={"data.train_files": cfg.data.train_files, "data.val_files": cfg.data.val_files}
    )
    problems += _algorithm_problems(cfg)
    if cfg.data.custom_cls.path:
        from verl.data.rl_dataset import load_dataset_class

        try:  # the file exists, defines the class, and it is a torch Dataset
            load_dataset_class(cfg.data.custom_cls.path, cfg.data.custom_cls.name)
        except ValueError as exc:
            problems.append(str(exc))
    problems += _multi_turn_problems(cfg, whole_run=whole_run)
    if not problems:  # the files below exist
        problems += _preference_problems(cfg)
    if not problems:
        problems += _model_folder_problems(cfg)
        problems += _megatron_vlm_problems(cfg)
    if not problems:
        problems += _lora_size_problems(cfg)
        problems += _split_problems(cfg)
        if not cfg.data.pairs:  # pairs have no data sources to score
            problems += _scorer_problems(cfg)
        problems += _reward_model_problems(cfg)
        problems += _teacher_problems(cfg)
    if problems:
        _raise(problems)
    check_run_outputs(
        cfg.trainer,
        inputs={
            "actor_rollout_ref.model.path": arr.model.path,
            "actor_rollout_ref.model.tokenizer_path": arr.model.tokenizer_path,
            "critic.model.path": cfg.critic.model.path if cfg.use_critic else None,
            "reward_model.model.path": cfg.reward_model.model.path if cfg.reward_model.enable else None,
            "distillation.teacher_model.model_path": cfg.distillation.teacher_model.model_path if cfg.use_teacher else None,
            "data files": as_file_list(cfg.data.train_files) + as_file_list(cfg.data.val_files),
        },
    )
