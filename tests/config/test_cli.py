"""parse_cli and `python -m verl.config`: --help, --config, exit codes, stderr."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from verl.config import CONFIG_DIR, PPOConfig, SFTConfig, describe, from_dict, load_config, parse_cli
from verl.config.core import is_section, schema

REPO = Path(__file__).resolve().parents[2]


def _leaf_paths(cls: type, prefix: str = "") -> list[str]:
    out = []
    for name, (_, hint) in schema(cls).items():
        out += _leaf_paths(hint, f"{prefix}{name}.") if is_section(hint) else [prefix + name]
    return out


@pytest.mark.parametrize(
    ("root", "header"),
    [(PPOConfig, "actor_rollout_ref.actor.optim: Actor optimizer (reference default lr 1e-6)."),
     (SFTConfig, "data.multiturn: Multi-turn conversations.")],
    ids=["PPOConfig", "SFTConfig"],
)
def test_help_lists_every_leaf_with_type_default_and_doc(root, header, capsys):
    with pytest.raises(SystemExit) as info:
        parse_cli(root, ["trainer.seed=1", "--help"], prog="trainer", default_config_file=None)
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: trainer [-h] [--config FILE | --config-path FILE] [key=value ...]")
    leaves = _leaf_paths(root)
    assert len(describe(root)) == len(leaves)
    assert {d.path for d in describe(root)} == set(leaves)
    lines = out.splitlines()
    for doc in describe(root):
        (index,) = [i for i, line in enumerate(lines) if line.startswith(f"  {doc.path}: ")]
        assert f": {doc.type} = " in lines[index]
        assert lines[index + 1].strip() == doc.help
    # grouped by section, each under a header with the section's doc
    assert header in lines
    for leaf in leaves:
        section = leaf.rpartition(".")[0]
        (index,) = [i for i, line in enumerate(lines) if line.startswith(f"  {leaf}: ")]
        above = [line for line in lines[:index] if line and not line.startswith(" ")]
        assert above[-1].startswith(f"{section}:"), (leaf, above[-1])


def test_help_shows_section_specific_defaults_bounds_and_links(capsys):
    with pytest.raises(SystemExit):
        parse_cli(PPOConfig, ["-h"], prog="p", default_config_file=None)
    out = capsys.readouterr().out
    assert "  critic.optim.lr: float = 1e-05  [>= 0.0]" in out
    assert "  actor_rollout_ref.actor.optim.lr: float = 1e-06  [>= 0.0]" in out
    assert "  trainer.logger: list[console|tensorboard|jsonl|wandb|mlflow] = [console]" in out
    assert "  critic.ppo_mini_batch_size: int = 256  [>= 1; follows actor_rollout_ref.actor.ppo_mini_batch_size]" in out
    assert "  trainer.default_local_dir: str = checkpoints/{project_name}/{experiment_name}" in out
    assert "  trainer.async_training.partial_rollout: bool = false" in out
    assert "  trainer.async_training.partial_rollout_tokens: int = 16  [>= 1]" in out
    assert "  trainer.async_training.stale_samples: wait|drop = wait" in out


def test_parse_cli_builds_the_config(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("trainer: {seed: 5}\n")
    cfg = parse_cli(PPOConfig, ["--config", str(f), "trainer.total_epochs=2"], prog="p", default_config_file="missing")
    assert (cfg.trainer.seed, cfg.trainer.total_epochs) == (5, 2)
    cfg = parse_cli(PPOConfig, [f"--config={f}"], prog="p", default_config_file=None)
    assert cfg.trainer.seed == 5
    cfg = parse_cli(PPOConfig, ["trainer.seed=7"], prog="p", default_config_file=f)  # the default file is used
    assert (cfg.trainer.seed, cfg.trainer.total_epochs) == (7, 30)


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["actor_rollout_ref.rollout.n=abc"], "actor_rollout_ref.rollout.n (in command-line override"),
        (["--config"], "--config needs a FILE"),
        (["--config", "a", "--config", "b"], "--config given twice"),
        (["--verbose"], "unknown option '--verbose'"),
        (["trainer.seed"], "unexpected argument 'trainer.seed'; settings are given as key=value"),
        (["--config", "does_not_exist"], "config file 'does_not_exist' not found"),
        (["trainer.n_gpus_per_node=2"], "the launched world size 4 differs"),
    ],
)
def test_parse_cli_errors_go_to_stderr_with_exit_2(argv, pattern, capsys):
    with pytest.raises(SystemExit) as info:
        parse_cli(PPOConfig, argv, prog="prog", default_config_file=None, world_size=4)
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("prog: error: ")
    assert pattern in captured.err
    assert "prog --help" in captured.err


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "verl.config", *args], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=300)  # a hang guard: 60 s was hit at load 27


def test_module_prints_the_resolved_config_and_exits_0():
    proc = _run("--config", "grpo_tiny_cpu", "trainer.total_training_steps=3", "+actor_rollout_ref.model.override_config.x=1")
    assert proc.returncode == 0, proc.stderr
    actual = from_dict(PPOConfig, yaml.safe_load(proc.stdout))
    expected = load_config(PPOConfig, config_file=CONFIG_DIR / "grpo_tiny_cpu.yaml",
                           overrides=["trainer.total_training_steps=3", "+actor_rollout_ref.model.override_config.x=1"])
    assert actual == expected
    assert actual.trainer.total_training_steps == 3


def test_module_exits_2_on_errors_and_0_on_help():
    proc = _run("actor_rollout_ref.actor.optim.lrr=1e-6")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "did you mean 'actor_rollout_ref.actor.optim.lr'?" in proc.stderr
    proc = _run("--help")
    assert proc.returncode == 0
    assert "usage: python -m verl.config" in proc.stdout
    assert "default: configs/ppo_trainer.yaml" in proc.stdout or "ppo_trainer.yaml" in proc.stdout


def test_option_docs_are_plain_records():
    doc = next(d for d in describe(PPOConfig) if d.path == "actor_rollout_ref.rollout.n")
    assert dataclasses.asdict(doc) == {
        "path": "actor_rollout_ref.rollout.n", "section": "actor_rollout_ref.rollout", "type": "int", "default": 1,
        "help": "Responses sampled per prompt (the GRPO group size).", "bounds": ">= 1", "follows": None,
    }


TUTORIAL_SETTINGS = ["model.pretrained_model_name_or_path=/models/qwen", "data.train_files=/data/train.parquet",
                     "data.val_files=/data/test.parquet", "trainer.num_epochs=1", "trainer.batch_size_per_device=8"]


@pytest.mark.parametrize("where", ["repository root", "another folder"])
def test_the_tutorials_config_path_is_main_ppos_default_ppo_config(where, tmp_path, monkeypatch):
    """`--config-path="configs/ppo/default.yaml"` (the tutorials' line) is PPO with a critic: main_ppo's
    default config under its own experiment name, found from the repository root and from elsewhere."""
    monkeypatch.chdir(REPO if where == "repository root" else tmp_path)
    actual = parse_cli(PPOConfig, ["--config-path=configs/ppo/default.yaml", *TUTORIAL_SETTINGS], prog="p",
                       default_config_file=CONFIG_DIR / "ppo_trainer.yaml")
    expected = load_config(PPOConfig, config_file=CONFIG_DIR / "ppo_trainer.yaml",
                           overrides=[*TUTORIAL_SETTINGS, "trainer.experiment_name=ppo_default"])
    assert actual == expected
    assert actual.algorithm.adv_estimator == "gae"  # PPO: advantages from a critic
    assert actual.actor_rollout_ref.model.path == "/models/qwen"
    assert actual.trainer.default_local_dir == "checkpoints/verl/ppo_default"


def _run_module(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=120)


def test_main_fastrl_runs_main_ppo_with_the_same_arguments(tmp_path):
    """The tutorials' `python3 -m verl.trainer.main_fastrl data.train_files=... data.val_files=...` is
    main_ppo under another name: one line says so, then main_ppo's own checks and exit status."""
    missing = [f"data.train_files={tmp_path}/train.parquet", f"data.val_files={tmp_path}/test.parquet"]
    proc = _run_module("verl.trainer.main_fastrl", "--config-path=configs/ppo/default.yaml", *missing, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert ("python -m verl.trainer.main_fastrl is an alias of python -m verl.trainer.main_ppo: running it with "
            "the same arguments") in proc.stderr
    assert "python -m verl.trainer.main_ppo: error:" in proc.stderr
    assert f"data.train_files: {tmp_path}/train.parquet does not exist" in proc.stderr
    assert f"data.val_files: {tmp_path}/test.parquet does not exist" in proc.stderr
    proc = _run_module("verl.trainer.main_fastrl", "--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "usage: python -m verl.trainer.main_ppo" in proc.stdout
