"""Dotted command-line overrides: every value kind, unknown keys, wrong types."""

from __future__ import annotations

import pytest

from verl.config import ConfigError, PPOConfig, SFTConfig, load_config, parse_value


def _load(*overrides: str) -> PPOConfig:
    return load_config(PPOConfig, overrides=list(overrides))


def test_scalar_kinds():
    cfg = _load(
        "actor_rollout_ref.actor.optim.lr=1e-6",  # YAML 1.1 would keep this a string
        "critic.optim.lr=3",  # an int for a float field
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "data.shuffle=False",
        "data.val_batch_size=null",
        "data.tokenizer=/tmp/tok",
        "trainer.experiment_name=2024",  # text, not the int 2024
        "trainer.project_name='true'",  # quoted: the string, not the bool
        "custom_reward_function.name=[a]: b",  # a string field takes the text as written
        "actor_rollout_ref.rollout.top_k=-1",
        "algorithm.adv_estimator=grpo",
    )
    arr = cfg.actor_rollout_ref
    assert arr.actor.optim.lr == 1e-6 and isinstance(arr.actor.optim.lr, float)
    assert cfg.critic.optim.lr == 3.0 and isinstance(cfg.critic.optim.lr, float)
    assert arr.rollout.n == 4
    assert arr.actor.use_kl_loss is True and cfg.data.shuffle is False
    assert cfg.data.val_batch_size is None
    assert cfg.data.tokenizer == "/tmp/tok"
    assert cfg.trainer.experiment_name == "2024"
    assert cfg.trainer.project_name == "true"
    assert cfg.custom_reward_function.name == "[a]: b"
    assert arr.rollout.top_k == -1
    assert cfg.algorithm.adv_estimator == "grpo"


def test_lists_unions_and_later_wins():
    cfg = _load(
        "trainer.logger=[console,jsonl]",
        "actor_rollout_ref.rollout.stop_token_ids=[1, 2]",
        "actor_rollout_ref.rollout.stop=['</s>', '###']",
        "actor_rollout_ref.actor.optim.betas=[0.9,0.95]",
        "data.train_files=[a.parquet,b.parquet]",
        "data.val_files=c.parquet",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.n=8",
    )
    assert cfg.trainer.logger == ["console", "jsonl"]
    assert cfg.actor_rollout_ref.rollout.stop_token_ids == [1, 2]
    assert cfg.actor_rollout_ref.rollout.stop == ["</s>", "###"]
    assert cfg.actor_rollout_ref.actor.optim.betas == [0.9, 0.95]
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    assert cfg.data.val_files == "c.parquet"
    assert cfg.actor_rollout_ref.rollout.n == 8
    # a single value for a list field is a one-element list (as the reference's loggers accept)
    assert _load("trainer.logger=tensorboard").trainer.logger == ["tensorboard"]
    assert _load("data.val_files=null").data.val_files is None


def test_dict_fields_take_new_keys():
    cfg = _load(
        "+actor_rollout_ref.model.override_config.rope_theta=1e6",
        "+actor_rollout_ref.model.override_config.attention_dropout=0.0",
        "actor_rollout_ref.model.override_config.nested.a=1",  # without '+' too
        "++actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full",
    )
    assert cfg.actor_rollout_ref.model.override_config == {
        "rope_theta": 1e6, "attention_dropout": 0.0, "nested": {"a": 1}}
    assert cfg.actor_rollout_ref.actor.megatron.override_transformer_config == {"recompute_granularity": "full"}
    # a whole mapping replaces the dict
    cfg = _load("+critic.model.override_config.a=1", "critic.model.override_config={b: 2}")
    assert cfg.critic.model.override_config == {"b": 2}


def test_section_mapping_and_section_level_defaults():
    cfg = _load("critic.optim={weight_decay: 0.1}")
    assert cfg.critic.optim.weight_decay == 0.1
    assert cfg.critic.optim.lr == 1e-5  # the critic's own default survives a partial section
    sft = load_config(SFTConfig, overrides=["optim.weight_decay=0"])
    assert sft.optim.lr == 1e-5


def test_links_follow_unless_set():
    cfg = _load(
        "data.max_prompt_length=1024",
        "actor_rollout_ref.actor.ppo_mini_batch_size=128",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.sequence_parallel=true",
        "actor_rollout_ref.model.path=/models/m",
        "critic.ppo_micro_batch_size_per_gpu=8",
        "trainer.n_gpus_per_node=2",
    )
    assert cfg.actor_rollout_ref.rollout.prompt_length == 1024
    assert cfg.critic.ppo_mini_batch_size == 128
    assert cfg.critic.model.path == "/models/m"
    assert cfg.critic.forward_micro_batch_size_per_gpu == 8
    ref = cfg.actor_rollout_ref.ref.megatron
    assert (ref.tensor_model_parallel_size, ref.sequence_parallel) == (2, True)
    assert cfg.critic.megatron.tensor_model_parallel_size == 1  # the critic's layout is its own
    # an explicit setting wins over the link, wherever it appears
    cfg = _load("critic.ppo_mini_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=128")
    assert cfg.critic.ppo_mini_batch_size == 64


def test_parse_value():
    assert parse_value("1e-6") == 1e-6
    assert parse_value("-2.5E+3") == -2500.0
    assert parse_value("7") == 7
    assert parse_value("[a, 1]") == ["a", 1]
    assert parse_value("~") is None
    assert parse_value("a: b: c") == "a: b: c"  # not YAML: kept as text


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ("actor_rollout_ref.actor.optim.lrr=1e-6",
         r"unknown config key 'actor_rollout_ref\.actor\.optim\.lrr'.*did you mean 'actor_rollout_ref\.actor\.optim\.lr'\?"),
        ("actor_rollout_ref.actr.optim.lr=1",
         r"'actor_rollout_ref' has no field 'actr'; did you mean 'actor_rollout_ref\.actor\.optim\.lr'\?"),
        ("actor.optim.lr=1",  # missing prefix
         r"unknown config key 'actor\.optim\.lr'.*did you mean 'actor_rollout_ref\.actor\.optim\.lr'\?"),
        ("trainer.total_epoch=3", r"did you mean 'trainer\.total_epochs'\?"),
        ("trainer.zzz=3", r"'trainer' has no field 'zzz' \(its fields: total_epochs, "),
        ("+trainer.new_key=1", r"unknown config key 'trainer\.new_key'.*'\+' only adds keys inside dict fields"),
        ("+trainer.seed=1", r"'trainer\.seed' already exists; drop the '\+'"),
        ("data.train_batch_size.x=1", r"'data\.train_batch_size' is a value of type int, not a section"),
        ("trainer=3", r"trainer is a section; set one of its fields"),
    ],
)
def test_unknown_keys(override, pattern):
    with pytest.raises(ConfigError, match=pattern) as info:
        _load(override)
    assert f"command-line override {override!r}" in str(info.value)


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ("actor_rollout_ref.rollout.n=abc", r"actor_rollout_ref\.rollout\.n .*: expected int, got 'abc'"),
        ("actor_rollout_ref.rollout.n=1.5", r"expected int, got 1\.5"),
        ("actor_rollout_ref.rollout.n=true", r"expected int, got True"),
        ("data.shuffle=1", r"data\.shuffle .*: expected bool, got 1"),
        ("actor_rollout_ref.actor.optim.lr=fast", r"expected float, got 'fast'"),
        ("data.max_prompt_length=null", r"expected int, got None"),
        ("data.truncation=lefft", r"expected error\|left\|right\|middle, got 'lefft'; did you mean 'left'\?"),
        ("trainer.logger=[console,jsonll]", r"item 1, 'jsonll', is not .*did you mean 'jsonl'\?"),
        ("actor_rollout_ref.rollout.stop_token_ids=[1,x]", r"expected list\[int\]"),
        ("actor_rollout_ref.model.override_config=3", r"expected dict, got 3"),
        ("actor_rollout_ref.rollout.n=0", r"actor_rollout_ref\.rollout\.n .*got 0; it must be >= 1"),
        ("actor_rollout_ref.rollout.top_p=0", r"it must be > 0\.0"),
    ],
)
def test_wrong_types_name_field_and_type(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        _load(override)


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ("actor_rollout_ref.rollout.n", r"not of the form key=value"),
        ("a..b=1", r"is not a dotted key"),
        ("~trainer.seed=1", r"deleting keys with '~' is not supported"),
    ],
)
def test_malformed_overrides(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        _load(override)


def test_overrides_must_be_a_sequence_of_strings():
    with pytest.raises(TypeError, match="sequence"):
        load_config(PPOConfig, overrides="trainer.seed=1")
