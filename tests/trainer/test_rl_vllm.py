"""GRPO with the CPU vLLM engine on 2 ranks: the engine agrees with the trainer, and the reward rises.

ONE call on the persistent 2-rank pool: a short SFT warm-up of the tiny model on 1-digit
addition (it learns the answer format and roughly the sums), then GRPO through ``PPOTrainer``
with the Megatron actor at TP=2 and the vLLM engine at TP'=2 (one engine over both ranks,
weights pushed by the hybrid engine every step), validation sampled at temperature 1 before
and after. The task is scored by a dense custom reward (``arithmetic_distance_reward.py``:
partial credit for near misses), through ``custom_reward_function``: the exact-match scorer is
too sparse for a visible rise within a few steps of a tiny model.
"""

from __future__ import annotations

import json
import os

import pytest

from verl.testing.distributed import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SFT_STEPS = 60
RL_STEPS = 20
REWARD_FN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "arithmetic_distance_reward.py")
# vLLM's float32 kernels (TP'=2) against the Megatron actor's (TP=2) on the same samples:
# rounding only, the bound of the rollout tests (tests/rollout/test_vllm_tp.py).
LOGPROB_ATOL = 1e-4
# The validation reward (64 problems x 4 samples at temperature 1, the dense reward) must rise
# by at least this much over RL_STEPS steps. Measured with these seeds: 0.259 -> 0.355 (+0.096).
# Between two validations of an unchanged policy (fresh samples each time) it moves by ~0.02;
# the margin is half the measured rise, for float rounding differences between CPUs.
MARGIN = 0.05


def _body(model_dir: str, files: dict[str, str], root: str) -> dict[str, object]:
    from verl.config import PPOConfig, SFTConfig, load_config
    from verl.trainer.ppo_trainer import PPOTrainer
    from verl.trainer.sft_trainer import SFTTrainer

    data = [f"data.train_files={files['train']}", f"data.val_files={files['val']}"]
    sft = load_config(
        SFTConfig,
        config_file="sft_tiny_cpu",
        world_size=2,
        overrides=[
            f"model.path={model_dir}",
            *data,
            "data.train_batch_size=64",
            "data.micro_batch_size_per_gpu=32",
            f"trainer.total_training_steps={SFT_STEPS}",
            "optim.lr_warmup_steps=10",
            "trainer.test_freq=-1",
            "trainer.save_freq=-1",
            "trainer.logger=[]",
            "trainer.resume_mode=disable",
            "trainer.n_gpus_per_node=2",
            f"trainer.default_local_dir={root}/sft",
            f"trainer.hf_export_dir={root}/sft_model",
        ],
    )
    with SFTTrainer(sft) as trainer:
        trainer.fit()
    grpo = load_config(
        PPOConfig,
        config_file="grpo_tiny_cpu",
        world_size=2,
        overrides=[
            f"actor_rollout_ref.model.path={root}/sft_model",
            *data,
            "data.max_prompt_length=24",
            "data.max_response_length=12",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            "actor_rollout_ref.rollout.cpu_kv_cache_gib=0.25",
            "data.train_batch_size=32",
            "actor_rollout_ref.actor.ppo_mini_batch_size=32",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
            "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
            "actor_rollout_ref.rollout.val_kwargs.n=4",
            f"custom_reward_function.path={REWARD_FN}",
            "actor_rollout_ref.rollout.n=8",
            "actor_rollout_ref.actor.optim.lr=2e-4",
            "actor_rollout_ref.actor.optim.lr_warmup_steps=2",
            f"trainer.total_training_steps={RL_STEPS}",
            f"trainer.test_freq={RL_STEPS}",
            "trainer.save_freq=-1",
            "trainer.save_hf=false",
            "trainer.logger=[jsonl]",
            "trainer.report_freq=10",
            "trainer.resume_mode=disable",
            f"trainer.default_local_dir={root}/grpo",
            f"trainer.log_dir={root}/grpo/logs",
        ],
    )
    with PPOTrainer(grpo) as trainer:
        trainer.fit()
    logs = os.path.join(root, "grpo", "logs")
    out: dict[int, dict[str, float]] = {}
    with open(os.path.join(logs, "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            out.setdefault(record.pop("step"), {}).update(record)

    def records(name: str) -> list[dict]:
        with open(os.path.join(logs, name), encoding="utf-8") as f:
            return [json.loads(line) for line in f]

    return {
        "steps": out,
        "scores": records("scores.jsonl"),
        "samples": records("samples.jsonl"),
        "files": sorted(os.listdir(logs)),
        "report": open(os.path.join(logs, "report.html"), encoding="utf-8").read(),
    }


@pytest.mark.timeout(600)
def test_grpo_with_vllm_agrees_with_the_trainer_and_learns(tiny_model_dir, arithmetic_files, tmp_path):
    [run, _] = run_distributed(_body, 2, tiny_model_dir, arithmetic_files, str(tmp_path), timeout=560)
    steps = run["steps"]
    key = "val-core/verl/arithmetic/reward/mean@4"
    before, after = steps[0][key], steps[RL_STEPS][key]
    print(
        f"validation reward {before:.3f} -> {after:.3f}; training reward by step",
        [round(steps[s]["critic/score/mean"], 3) for s in range(1, RL_STEPS + 1)],
    )
    for step in range(1, RL_STEPS + 1):
        m = steps[step]
        assert m["training/rollout_logprob_diff_max"] < LOGPROB_ATOL, (
            step,
            m["training/rollout_logprob_diff_max"],
        )
        assert m["training/token_mult_prob_error"] < 1.0 + LOGPROB_ATOL, step
    assert steps[1]["actor/ppo_kl"] == 0.0
    # the actor's and the reference's engines agree to float rounding (test_rl_trainer's docstring)
    assert abs(steps[1]["actor/kl_loss"]) <= 1e-6
    assert after >= before + MARGIN, (
        f"validation reward {before:.3f} -> {after:.3f}, expected a rise of {MARGIN}"
    )
    # The run report, written by the trainer (every 10 steps and at the end) from what it logged:
    # each step's sequence scores, each validation's generations as text, the config.
    assert {"report.html", "scores.jsonl", "samples.jsonl", "config.json", "metrics.jsonl"} <= set(run["files"])
    assert [r["step"] for r in run["scores"]] == list(range(1, RL_STEPS + 1))
    assert all(len(r["scores"]) == 32 * 8 for r in run["scores"])
    assert sorted({r["step"] for r in run["samples"]}) == [0, RL_STEPS]  # before and after training
    assert len(run["samples"]) == 2 * 64 * 4
    first = run["samples"][0]
    assert first["data_source"] == "verl/arithmetic" and "+" in first["prompt"] and first["response"]
    assert any(r["reward"] > 0 for r in run["samples"] if r["step"] == RL_STEPS)
    page = run["report"]
    assert page.count("<svg") >= 8 and 'id="plot-reward"' in page and 'id="samples"' in page
    assert "val-core/verl/arithmetic/reward/mean@4" in page or "verl/arithmetic" in page
