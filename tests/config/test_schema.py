"""The dataclasses themselves: docs on every field, sane defaults, checks at construction."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from verl.config import (
    ActorConfig,
    ConfigError,
    CriticConfig,
    MegatronConfig,
    OptimConfig,
    PPOConfig,
    RolloutConfig,
    SFTConfig,
    TrainerConfig,
    all_paths,
    load_config,
)
from verl.config.core import is_section, schema


def _section_classes(root: type) -> set[type]:
    out = {root}
    for _, hint in schema(root).values():
        if is_section(hint):
            out |= _section_classes(hint)
    return out


ALL_SECTIONS = sorted(_section_classes(PPOConfig) | _section_classes(SFTConfig), key=lambda c: c.__name__)


@pytest.mark.parametrize("cls", ALL_SECTIONS, ids=lambda c: c.__name__)
def test_every_field_is_keyword_only_and_documented(cls):
    for f in dataclasses.fields(cls):
        assert f.kw_only, f"{cls.__name__}.{f.name} is not keyword-only"
        doc = f.metadata.get("help", "")
        assert doc and "\n" not in doc, f"{cls.__name__}.{f.name} needs a one-line help"
    with pytest.raises(TypeError):
        cls(*[None])  # positional arguments are refused


def test_data_section_has_exactly_the_agreed_fields():
    expected = {
        "train_files", "val_files", "prompt_key", "reward_fn_key", "max_prompt_length", "max_response_length",
        "train_batch_size", "val_batch_size", "return_raw_chat", "shuffle", "seed", "truncation",
        "filter_overlong_prompts", "tokenizer", "custom_cls", "dataloader_num_workers", "apply_chat_template",
        "pairs",  # DPO's preference pairs (verl.DPOUpdateOperator)
        "tool_config_path",  # the reference's: tool schemas rendered into prompts (docs/agents.md)
        "image_key",  # the reference's: the column of a vision-language model's images (docs/vlm.md)
    }
    actual = {f.name for f in dataclasses.fields(PPOConfig().data)}
    assert actual == expected
    data = PPOConfig().data
    assert (data.prompt_key, data.reward_fn_key, data.max_prompt_length, data.max_response_length) == (
        "prompt", "data_source", 512, 512)
    assert (data.train_batch_size, data.return_raw_chat, data.shuffle, data.seed, data.truncation) == (
        1024, False, True, 1, "error")
    assert typing.get_args(typing.get_type_hints(type(data))["truncation"]) == ("error", "left", "right", "middle")


def test_reference_key_names_exist():
    paths = set(all_paths(PPOConfig))
    for key in [
        "actor_rollout_ref.model.enable_gradient_checkpointing",
        "actor_rollout_ref.actor.policy_loss.loss_mode",
        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio",
        "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.rollout.val_kwargs.do_sample",
        "critic.cliprange_value",
        "reward_model.overlong_buffer.penalty_factor",
        "custom_reward_function.name",
        "algorithm.kl_ctrl.target_kl",
        "algorithm.filter_groups.max_num_gen_batches",
        "trainer.max_actor_ckpt_to_keep",
    ]:
        assert key in paths, key
    assert {"data.multiturn.messages_key", "model.path", "megatron.tensor_model_parallel_size",
            "trainer.resume_mode"} <= set(all_paths(SFTConfig))


def test_defaults_build_and_validate():
    ppo, sft = PPOConfig(), SFTConfig()
    ppo.validate(world_size=1)
    sft.validate(world_size=1)
    # section-level defaults: critic and SFT optimizers start from their own learning rate
    assert ppo.actor_rollout_ref.actor.optim.lr == 1e-6
    assert ppo.critic.optim.lr == 1e-5
    assert sft.optim.lr == 1e-5
    assert OptimConfig().lr == 1e-6


def test_linked_fields_default_to_their_sources_default():
    """A link only fires when the source is set, so unset pairs must already agree."""
    cfg = PPOConfig()
    for target, source in PPOConfig.LINKS.items():
        get = lambda path: _get(cfg, path)  # noqa: E731
        assert get(target) == get(source), f"{target} default {get(target)!r} != {source} default {get(source)!r}"


def _get(cfg, path):
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_direct_construction_is_type_checked():
    with pytest.raises(ConfigError, match=r"RolloutConfig\.n: expected int, got 'abc'"):
        RolloutConfig(n="abc")
    with pytest.raises(ConfigError, match=r"RolloutConfig\.top_p: got 1\.5; it must be <= 1\.0"):
        RolloutConfig(top_p=1.5)
    with pytest.raises(ConfigError, match=r"MegatronConfig\.dtype: expected auto\|bfloat16\|float16\|float32, got 'bf16'"):
        MegatronConfig(dtype="bf16")
    assert RolloutConfig(temperature=1).temperature == 1.0 and isinstance(RolloutConfig(temperature=1).temperature, float)
    with pytest.raises(ConfigError, match=r"ActorRolloutRefConfig\.actor: expected a ActorConfig"):
        from verl.config import ActorRolloutRefConfig

        ActorRolloutRefConfig(actor={"ppo_epochs": 2})


def test_grad_clip_alias_replaces_optim_clip_grad():
    actor = ActorConfig(grad_clip=0.5)
    assert (actor.optim.clip_grad, actor.grad_clip) == (0.5, None)
    critic = CriticConfig(grad_clip=2.0)
    assert critic.optim.clip_grad == 2.0
    assert ActorConfig().optim.clip_grad == 1.0


def test_checkpoint_dir_fills_run_names():
    assert TrainerConfig(project_name="p", experiment_name="e").default_local_dir == "checkpoints/p/e"
    assert TrainerConfig(default_local_dir="/ckpt/{x}").default_local_dir == "/ckpt/{x}"
    cfg = load_config(PPOConfig, overrides=["trainer.project_name=proj", "trainer.experiment_name=run1"])
    assert cfg.trainer.default_local_dir == "checkpoints/proj/run1"


def test_use_critic_and_reference_follow_the_algorithm():
    cfg = PPOConfig()
    assert cfg.use_critic and not cfg.use_reference
    cfg = load_config(PPOConfig, overrides=["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=true"])
    assert not cfg.use_critic and cfg.use_reference
    cfg = load_config(PPOConfig, overrides=["algorithm.adv_estimator=grpo", "critic.enable=true"])
    assert cfg.use_critic
