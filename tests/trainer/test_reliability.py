"""The long run: kills at random moments, a stop signal, non-finite updates, out-of-memory
micro-batches, each through ``main_ppo`` with a fault injected (``faults.py``); the lost rank is
test_lost_rank.py (its own file, so that a test worker runs it beside these).

The runs are worlds of one (the transformers rollout engine, the raw tiny model, 1-digit
addition).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAULTS = os.path.join(ROOT, "tests", "trainer", "faults.py")

BASE = [
    "--config",
    "grpo_tiny_cpu",
    "trainer.n_gpus_per_node=1",
    "actor_rollout_ref.rollout.name=hf",
    "data.max_prompt_length=24",
    "data.max_response_length=8",
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.optim.lr=1e-3",
    "trainer.total_training_steps=6",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.save_freq=1",
    "trainer.save_hf=false",
    "trainer.logger=[jsonl]",
    "trainer.report_freq=0",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.entropy_coeff=0.01",  # the raw model never scores: this moves the weights
    "data.val_files=null",
]

# Metrics that measure time or memory, not the computation.
_NOT_COMPARED = ("timing_s/", "perf/", "rollout/tokens_per_s", "rollout/time_s", "update_weights/")


def _micro(size: int) -> list[str]:
    return [
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={size}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={size}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={size}",
    ]


def _env(faults: list[dict] | None = None) -> dict[str, str]:
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"
    )
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env["VERL_TEST_FAULTS"] = json.dumps(faults or [])
    return env


def _run(args: list[str], faults: list[dict] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, FAULTS, *args], env=_env(faults), cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def _metrics(log_dir: str) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    with open(os.path.join(log_dir, "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            step = record.pop("step")
            assert step not in out, f"step {step} logged twice"
            out[step] = {k: v for k, v in record.items() if not k.startswith(_NOT_COMPARED)}
    return out


def _run_args(files, model_dir, root, name, *more):
    return [
        *BASE,
        f"actor_rollout_ref.model.path={model_dir}",
        f"data.train_files={files['train']}",
        f"trainer.default_local_dir={root}/{name}",
        f"trainer.log_dir={root}/{name}/logs",
        *more,
    ]


@pytest.mark.timeout(900)
def test_killed_at_random_moments_then_resumed_equals_the_uninterrupted_run(tiny_model_dir, arithmetic_files, tmp_path):
    """SIGKILL at seeded random phases and in the middle of a checkpoint write, and a SIGTERM;
    every run resumed with resume_mode=auto. Every segment also runs out of memory at
    micro-batch 4 (injected, in the forward and in the update) and halves to 2, which the
    uninterrupted run uses from the start: the metrics of every step must be the uninterrupted
    run's, number for number."""
    # The reference saves no checkpoint (each save is a second of the run): a run that saves none
    # must have the same numbers as one stopped and resumed from its checkpoints.
    whole = _run(_run_args(arithmetic_files, tiny_model_dir, tmp_path, "whole", *_micro(2), "trainer.save_freq=-1"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    expected = _metrics(f"{tmp_path}/whole/logs")
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]

    rng = random.Random(1403)  # the kill points: fixed seeds, random phases
    phases = ["gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "end_of_step"]
    oom = [{"kind": "oom", "where": "update", "above": 2}, {"kind": "oom", "where": "forward", "above": 2}]
    schedule = [
        ("kill", {"kind": "kill", "phase": rng.choice(phases), "after_step": 2}),
        ("kill", {"kind": "kill_in_checkpoint", "step": 3}),
        ("kill", {"kind": "kill", "phase": rng.choice(phases), "after_step": 4}),
        ("term", {"kind": "term", "phase": "update_actor", "after_step": 5}),
        ("end", None),
    ]
    args = _run_args(arithmetic_files, tiny_model_dir, tmp_path, "parts", *_micro(4), "trainer.resume_mode=auto")
    logs = []
    for what, fault in schedule:
        proc = _run(args, oom + ([fault] if fault else []))
        logs.append(proc.stderr)
        if what == "kill":
            assert proc.returncode == -signal.SIGKILL, (fault, proc.returncode, proc.stderr[-3000:])
        else:
            # A run a stop signal ended exits 128 + its number (143): not the 0 of a finished run.
            assert proc.returncode == (128 + signal.SIGTERM if what == "term" else 0), (fault, proc.stderr[-3000:])
            assert "out of memory at micro-batch size 4; now 2" in proc.stderr, proc.stderr[-3000:]
    # The checkpoint killed mid-write was not taken for a complete one: the next run resumed from 2.
    assert re.search(r"resumed from \S*global_step_2 \(step 2\)", logs[2]), logs[2][-3000:]
    # The SIGTERM: the step finished, its checkpoint was written and named, the run exited 143.
    assert re.search(r"SIGTERM: stopped after step 5; checkpoint \S*global_step_5", logs[3]), logs[3][-3000:]
    assert re.search(r"resumed from \S*global_step_5 \(step 5\)", logs[4]), logs[4][-3000:]
    got = _metrics(f"{tmp_path}/parts/logs")
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for step in expected:
        assert got[step] == expected[step], step
    assert not [n for n in os.listdir(f"{tmp_path}/parts") if n.startswith(".")], "a staging directory was left"


@pytest.mark.timeout(600)
def test_non_finite_updates_are_skipped_counted_and_stop_the_run(tiny_model_dir, arithmetic_files, tmp_path):
    """A NaN loss at step 2 is skipped and counted; at steps 4 and 5 (two in a row, the limit) the
    run stops naming them and the last good checkpoint."""
    args = _run_args(
        arithmetic_files, tiny_model_dir, tmp_path, "nan", *_micro(2), "trainer.max_consecutive_skipped_steps=2"
    )
    proc = _run(args, [{"kind": "nan_loss", "steps": [2, 4, 5]}])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (
        "steps 4-5: 2 updates in a row were skipped for a non-finite loss or gradient norm "
        "(trainer.max_consecutive_skipped_steps=2); the last good checkpoint is"
    ) in proc.stderr, proc.stderr[-3000:]
    assert re.search(r"last good checkpoint is \S*global_step_4\b", proc.stderr), proc.stderr[-3000:]
    m = _metrics(f"{tmp_path}/nan/logs")
    assert sorted(m) == [1, 2, 3, 4]
    assert m[1]["training/skipped_steps"] == 0 and m[2]["training/skipped_steps"] == 1
    assert m[2]["actor/num_skipped_updates"] == 2  # both mini-batches of step 2
    assert m[3]["training/consecutive_skipped_steps"] == 0 and m[4]["training/consecutive_skipped_steps"] == 1
    # A skipped update leaves the weights as they were: step 2's second mini-batch still sees the
    # ratio 1 (its first mini-batch's update was not applied), unlike the steps around it.
    assert m[2]["actor/ppo_kl"] == 0.0
    assert m[1]["actor/ppo_kl"] != 0.0 and m[3]["actor/ppo_kl"] != 0.0


def test_non_finite_reward_names_the_sample_and_data_source():
    import torch

    from verl.trainer.resilience import check_finite_rewards

    mask = torch.ones(3, 4)
    mask[2, 3] = 0
    rewards = torch.zeros(3, 4)
    rewards[2, 3] = float("nan")  # outside the response: ignored
    check_finite_rewards(7, {"token_level_rewards": rewards}, mask, ["a", "b", "c"])
    rewards[1, 0] = float("inf")
    rewards[2, 1] = float("nan")
    with pytest.raises(ValueError, match=r"step 7: token_level_rewards is inf for sample 1 \(data_source='b'\) and 1 more"):
        check_finite_rewards(7, {"token_level_rewards": rewards}, mask, ["a", "b", "c"])
