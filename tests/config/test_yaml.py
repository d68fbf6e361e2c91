"""YAML files: round trip, key and type checks naming the file, base: layering, the shipped configs."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from verl.config import (
    CONFIG_DIR,
    ConfigError,
    PPOConfig,
    SFTConfig,
    from_dict,
    load_config,
    to_dict,
    to_flat_dict,
    to_yaml,
)


def _write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.parametrize("root", [PPOConfig, SFTConfig], ids=lambda c: c.__name__)
def test_round_trip_of_defaults(tmp_path, root):
    expected = root()
    actual = load_config(root, config_file=_write(tmp_path / "out.yaml", to_yaml(expected)))
    assert actual == expected
    assert to_yaml(actual) == to_yaml(expected)


def test_round_trip_of_a_changed_config(tmp_path):
    expected = load_config(
        PPOConfig,
        overrides=[
            "actor_rollout_ref.actor.optim.lr=3e-7",
            "trainer.logger=[console,tensorboard]",
            "data.train_files=[x.parquet,y.parquet]",
            "+actor_rollout_ref.model.override_config.rope_scaling={type: linear, factor: 2.0}",
            "actor_rollout_ref.rollout.stop=['\\n\\n', 'END']",
            "trainer.experiment_name=exp: 1",
            "critic.optim.lr=1e-5",
            "algorithm.kl_ctrl.type=adaptive",
        ],
    )
    text = to_yaml(expected)
    actual = load_config(PPOConfig, config_file=_write(tmp_path / "changed.yaml", text))
    assert actual == expected
    # and through plain dicts
    assert from_dict(PPOConfig, to_dict(expected)) == expected
    assert yaml.safe_load(text) == to_dict(expected)


def test_flat_dict_has_every_leaf():
    flat = to_flat_dict(PPOConfig())
    assert flat["actor_rollout_ref.actor.optim.lr"] == 1e-6
    assert flat["trainer.logger"] == ["console"]
    assert not any(isinstance(v, PPOConfig) for v in flat.values())


def test_yaml_values_and_float_notation(tmp_path):
    f = _write(
        tmp_path / "a.yaml",
        """
        actor_rollout_ref:
          actor:
            optim: {lr: 1e-6, betas: [0.9, 0.95]}
          rollout:
            n: 4
        trainer:
          logger: [console, jsonl]
          experiment_name: 2024
        critic:
        """,
    )
    cfg = load_config(PPOConfig, config_file=f)
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6
    assert cfg.actor_rollout_ref.rollout.n == 4
    assert cfg.trainer.logger == ["console", "jsonl"]
    assert cfg.trainer.experiment_name == "2024"


def test_unknown_yaml_key_names_file_and_suggests(tmp_path):
    f = _write(tmp_path / "bad.yaml", "actor_rollout_ref:\n  rollout:\n    temprature: 0.7\n")
    with pytest.raises(ConfigError) as info:
        load_config(PPOConfig, config_file=f)
    msg = str(info.value)
    assert "unknown config key 'actor_rollout_ref.rollout.temprature'" in msg
    assert str(f) in msg
    assert "did you mean 'actor_rollout_ref.rollout.temperature'?" in msg


def test_wrong_yaml_type_names_file_field_and_type(tmp_path):
    f = _write(tmp_path / "bad.yaml", "actor_rollout_ref:\n  rollout:\n    n: four\n")
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.rollout\.n \(in .*bad\.yaml\): expected int, got 'four'"):
        load_config(PPOConfig, config_file=f)
    g = _write(tmp_path / "bad2.yaml", "trainer: [1, 2]\n")
    with pytest.raises(ConfigError, match=r"trainer \(in .*bad2\.yaml\): expected a mapping of TrainerConfig fields"):
        load_config(PPOConfig, config_file=g)


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("a: [1, 2\n", r"f\.yaml is not valid YAML \(line 2, column 1: expected ',' or '\]', but got '<stream end>'\)$"),
        ("trainer:\n\tseed: 1\n", r"is not valid YAML \(line 2, column 1: found character '\\t' that cannot start any token\)$"),
        ("- 1\n- 2\n", r"the top level must be a mapping"),
        ("trainer:\n  seed: 1\n  seed: 2\n", r"duplicate key 'seed'"),
        ("base: 3\n", r"'base' must be a file name or a list"),
        ("base: missing.yaml\n", r"base config 'missing\.yaml' not found"),
    ],
)
def test_malformed_files(tmp_path, text, pattern):
    with pytest.raises(ConfigError, match=pattern) as info:
        load_config(PPOConfig, config_file=_write(tmp_path / "f.yaml", text))
    assert "\n" not in str(info.value)  # one line, naming the file and the place


def test_a_directory_given_as_the_config_file(tmp_path):
    with pytest.raises(ConfigError, match=f"config file '{tmp_path}' is a directory; give a YAML file"):
        load_config(PPOConfig, config_file=tmp_path)


def test_base_layering_and_precedence(tmp_path):
    _write(tmp_path / "root.yaml", "trainer: {seed: 1, total_epochs: 2}\nactor_rollout_ref: {rollout: {n: 2}}\n")
    _write(tmp_path / "mid.yaml", "base: root.yaml\ntrainer: {seed: 2}\nactor_rollout_ref: {model: {override_config: {a: 1}}}\n")
    top = _write(
        tmp_path / "top.yaml",
        "base: mid\ntrainer: {seed: 3}\nactor_rollout_ref: {model: {override_config: {b: 2}}}\n",
    )
    cfg = load_config(PPOConfig, config_file=top, overrides=["actor_rollout_ref.rollout.n=5"])
    assert cfg.trainer.seed == 3  # the file beats its bases
    assert cfg.trainer.total_epochs == 2  # untouched base values survive
    assert cfg.actor_rollout_ref.rollout.n == 5  # overrides beat files
    assert cfg.actor_rollout_ref.model.override_config == {"a": 1, "b": 2}  # dict fields merge across files


def test_base_cycle_and_bad_key_in_base_names_the_base(tmp_path):
    _write(tmp_path / "a.yaml", "base: b.yaml\n")
    _write(tmp_path / "b.yaml", "base: a.yaml\n")
    with pytest.raises(ConfigError, match="include each other"):
        load_config(PPOConfig, config_file=tmp_path / "a.yaml")
    _write(tmp_path / "base.yaml", "trainer: {sed: 1}\n")
    _write(tmp_path / "child.yaml", "base: base.yaml\n")
    with pytest.raises(ConfigError, match=r"base\.yaml.*did you mean 'trainer\.seed'"):
        load_config(PPOConfig, config_file=tmp_path / "child.yaml")


def test_missing_file_lists_where_it_looked(tmp_path):
    with pytest.raises(ConfigError, match=r"config file 'nope' not found \(looked for: .*nope\.yaml"):
        load_config(PPOConfig, config_file="nope")


def test_shipped_configs_load():
    assert {"ppo_trainer.yaml", "sft_trainer.yaml", "grpo_tiny_cpu.yaml"} <= {p.name for p in CONFIG_DIR.glob("*.yaml")}
    load_config(PPOConfig, config_file=CONFIG_DIR / "ppo_trainer.yaml", world_size=1)
    load_config(SFTConfig, config_file="sft_trainer", world_size=1)
    tiny = load_config(PPOConfig, config_file="grpo_tiny_cpu", world_size=2)
    assert tiny.algorithm.adv_estimator == "grpo"
    assert tiny.actor_rollout_ref.rollout.prompt_length == tiny.data.max_prompt_length == 64
    assert tiny.trainer.device == "cpu" and tiny.use_reference and not tiny.use_critic
