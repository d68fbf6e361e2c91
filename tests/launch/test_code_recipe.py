"""The code recipe, shortened, end to end (its own file, so that a test worker runs it beside
test_launchers.py's two-node launch: each is a minute or more)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.processes import run_tree
from verl.parallel.bootstrap import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
# Longer than the recipe's own limit below, so a slow or stuck recipe is reported with its output,
# not cut off by pytest (suite12: still running at 600 s; suite17, load 39: at 900 s). The limit is a
# hang guard (tests/processes.py): the recipe takes 58 s quiet and 393-900+ s beside two busy loops.
@pytest.mark.timeout(1860)
def test_the_code_recipe_runs_its_pieces(tmp_path):
    """launch/grpo_code_tiny_cpu.sh, shortened: the model, the code task's data, 25 SFT steps (the warm-up is 20), two
    GRPO steps whose rewards come from running the sampled programs in the sandbox, validation (on 16
    held-out problems: 200 sandboxed programs for the recipe's 100 held-out ones, where the check is that both
    validations ran and scored every program)."""
    from verl.config.schema import SandboxConfig
    from verl.sandbox import Sandbox, SandboxUnavailable

    try:
        if not Sandbox(SandboxConfig(slots_dir=str(tmp_path / "slots"))).confined:
            pytest.skip("bubblewrap cannot confine here")
    except (SandboxUnavailable, ValueError) as exc:
        pytest.skip(f"no confinement on this machine ({exc}); tools/setup_env.sh installs bubblewrap as root")
    out = tmp_path / "out"
    overrides = [
        "actor_rollout_ref.rollout.name=hf", "trainer.total_training_steps=2", "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.val_kwargs.n=1", "data.val_batch_size=16",
        "trainer.test_freq=2", "trainer.save_freq=-1", "trainer.save_hf=false",
    ]
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHON": sys.executable, "OUT": str(out), "SFT_STEPS": "25",
           "TRAIN": "64", "VAL": "16", "NPROC_PER_NODE": "1", "MASTER_PORT": str(free_port())}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NNODES", "NODE_RANK"):
        env.pop(key, None)
    try:
        proc = run_tree(["bash", os.path.join(ROOT, "launch", "grpo_code_tiny_cpu.sh"), *overrides], timeout=1800,
                        cwd=tmp_path, env=env)
    except subprocess.TimeoutExpired as exc:  # (its message has the output's tail and the stacks at the limit)
        pytest.fail(f"the code recipe ran past 1800 s: {exc}")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    with open(out / "logs" / "metrics.jsonl", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    val = [r["val-core/verl/arithmetic_code/acc/mean@1"] for r in records if "val-core/verl/arithmetic_code/acc/mean@1" in r]
    assert len(val) == 2  # before training and at step 2
    # Every sampled program of both steps was run and scored (one test each).
    assert [r["step"] for r in records if "critic/score/mean" in r] == [1, 2]
    assert all(r["reward/num_failed"] == 0 for r in records if "reward/num_failed" in r)
    assert (out / "sft_model" / "config.json").is_file()
    assert "== validation reward (val-core/verl/arithmetic_code/acc/mean@1)" in proc.stdout
