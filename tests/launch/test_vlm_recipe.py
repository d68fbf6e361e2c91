"""launch/grpo_vlm_tiny_cpu.sh: valid bash and valid Python, and a short form of it that runs its pieces (the
colour-square task and its control written, the SFT warm-up, GRPO with validation on both sets; the tiny Qwen2.5-VL
is made here beforehand with a smaller tokenizer corpus, which the launcher then reuses, to save a process start and
the tokenizer's training). The learning run itself (40 GRPO steps) is not in the suite: its figures are in
docs/vlm.md."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

from tests.processes import run_tree
from verl.parallel.bootstrap import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCHER = os.path.join(ROOT, "launch", "grpo_vlm_tiny_cpu.sh")


def test_the_launcher_is_bash_and_python():
    with open(LAUNCHER, encoding="utf-8") as f:
        text = f.read()
    tree = ast.parse(text)  # Python: the shell half is the module docstring
    assert isinstance(tree.body[0], ast.Expr) and isinstance(tree.body[0].value, ast.Constant)
    shell = text.split('":"""', 1)[0]
    subprocess.run(["bash", "-n"], input=shell, text=True, check=True)  # bash reads no further than its exit
    assert "verl_launch" in shell


@pytest.mark.slow
@pytest.mark.timeout(1260)
def test_the_vlm_recipe_runs_its_pieces(tmp_path):
    """One rank, 2 SFT steps, one GRPO step of 4 prompts x 2 with validation before and after on 8 + 8 prompts."""
    from verl.data.tiny_vlm import TinyVLMSpec, make_tiny_vlm

    out = tmp_path / "out"
    make_tiny_vlm(str(out / "model"), TinyVLMSpec(corpus_lines=500))
    overrides = [
        "trainer.total_training_steps=1", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.val_kwargs.n=1", "data.val_batch_size=16", "trainer.test_freq=1",
        "trainer.save_hf=false",
    ]
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHON": sys.executable, "OUT": str(out), "SFT_STEPS": "2",
           "TRAIN": "16", "VAL": "8", "NPROC_PER_NODE": "1", "MASTER_PORT": str(free_port())}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NNODES", "NODE_RANK"):
        env.pop(key, None)
    # A hang guard (tests/processes.py), sized for a loaded machine as the other recipe tests are.
    proc = run_tree(["bash", LAUNCHER, *overrides], timeout=1200, cwd=tmp_path, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert (out / "sft_model" / "config.json").is_file() and (out / "sft_model" / "preprocessor_config.json").is_file()
    assert "== SFT model on test.parquet: greedy accuracy" in proc.stdout
    with open(out / "logs" / "metrics.jsonl", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    for source in ("verl/colour_square", "verl/colour_square_blank"):
        key = f"val-core/{source}/reward/mean@1"
        assert [r["step"] for r in records if key in r] == [0, 1], key  # before GRPO and after its step
    step = next(r for r in records if r["step"] == 1 and "actor/ppo_kl" in r)
    # One mini-batch: the update's old and new log-probs come from the same weights, images included.
    assert step["actor/ppo_kl"] == 0.0
    # The rollout's log-probs (cached decode with the images) and the actor's one pass: fp32 rounding.
    assert step["training/rollout_logprob_diff_max"] < 1e-4
    assert "== validation reward, held-out images: " in proc.stdout
    assert "== validation reward, square left out (chance 0.25): " in proc.stdout
