"""``verl.RLTrainer``, the keyword facade: fit drives verl.trainer.rl_trainer.RLTrainer.fit."""

from __future__ import annotations

import json
import math
import os

import pytest


@pytest.fixture
def restore_env():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_fit_runs_steps_and_writes_checkpoints(tiny_model_dir, arithmetic_files, tmp_path, restore_env):
    import torch.distributed as dist

    import verl

    trainer = verl.RLTrainer(
        tiny_model_dir,
        algorithm="grpo",
        use_vllm=False,
        rollout_batch_size=4,
        n_samples=4,
        micro_batch_size=16,
        learning_rate=1e-4,
        max_prompt_length=24,
        max_response_length=8,
        device="cpu",
    )
    out = tmp_path / "run"
    metrics = trainer.fit(
        dataset_path=arithmetic_files["train"], max_steps=2, save_steps=1, output_dir=str(out), save_hf=False
    )
    assert not dist.is_initialized()  # the world of one fit started is torn down
    assert metrics["global_step"] == 2
    for key in ("reward_mean", "loss", "final_kl"):
        assert math.isfinite(metrics[key]), key
    assert metrics["checkpoint"] == str(out / "global_step_2")
    for step in (1, 2):
        with open(out / f"global_step_{step}" / "trainer_state.json", encoding="utf-8") as f:
            assert json.load(f)["global_step"] == step
        assert (out / f"global_step_{step}" / "actor").is_dir()
    with open(out / "logs" / "metrics.jsonl", encoding="utf-8") as f:
        logged = [json.loads(line) for line in f if line.strip()]
    assert [r["step"] for r in logged] == [1, 2]
    cfg = trainer.last_config
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.actor_rollout_ref.rollout.name == "hf"
    assert cfg.data.train_batch_size == 4 and cfg.actor_rollout_ref.actor.use_kl_loss


def test_ppo_maps_to_gae_with_a_critic(tiny_model_dir, arithmetic_files, tmp_path):
    import verl

    cfg = verl.RLTrainer(tiny_model_dir, algorithm="ppo", use_vllm=False, device="cpu").build_config(
        dataset_path=arithmetic_files["train"], max_steps=1, output_dir=str(tmp_path)
    )
    assert cfg.algorithm.adv_estimator == "gae" and cfg.use_critic


def test_unknown_algorithm_names_the_choices():
    import verl

    with pytest.raises(ValueError, match=r"unknown algorithm='sac'; choose one of \[.*'grpo'.*'ppo'.*'rloo'"):
        verl.RLTrainer("model", algorithm="sac")
    with pytest.raises(ValueError, match="'dpo' is not available in verl.RLTrainer yet"):
        verl.RLTrainer("model", algorithm="dpo")


def test_import_verl_is_light():
    import subprocess
    import sys

    code = "import sys, verl; print(verl.__version__, 'torch' in sys.modules)"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, env={**os.environ, "PYTHONPATH": root}
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [verl_version(), "False"] and proc.stderr == ""


def verl_version() -> str:
    import verl

    return verl.__version__
