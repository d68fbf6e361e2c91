"""The RL trainer on 2 ranks: GRPO and PPO at TP=2, PP=2 and DP=2; resume; the metric keys.

The layout runs use the transformers rollout engine (a replica per rank, cheap to start; the
vLLM engine is covered by test_rl_vllm.py) and the raw tiny model: the first step's numbers do
not need a trained one. Each case runs in ONE call on the persistent 2-rank pool.

Invariants of the first update (one mini-batch per step, one PPO epoch, the same micro-batch
size for every forward pass): the actor's old log-probabilities, the reference's and the
update's come from the same weights with the same arithmetic, so the policy ratio is exactly 1
(``actor/ppo_kl`` 0, nothing clipped) and the KL to the reference is 0 to float rounding (1e-6):
the reference's log-probabilities come from another engine than the actor's (GRPO's KL loss,
PPO's KL in the reward), whose activations sit at different addresses, and the CPU BLAS picks
its kernels (so its summation order) by alignment: measured on packed rows at TP=2, the same
inputs and weights gave query/key/value projections 1.8e-7 apart and a KL of -1.9e-8.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from verl.testing.distributed import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# Shapes that keep a step fast: 8 prompts x 4 samples, one mini-batch per step, micro-batches of 8.
FAST = [
    "data.max_prompt_length=24",
    "data.max_response_length=12",
    "data.train_batch_size=8",
    "actor_rollout_ref.rollout.name=hf",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
    "critic.ppo_micro_batch_size_per_gpu=8",
    "critic.forward_micro_batch_size_per_gpu=8",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    "trainer.save_hf=false",
    "trainer.resume_mode=disable",
    "trainer.n_gpus_per_node=2",
]

LAYOUTS = {
    "tp2": [
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "critic.megatron.tensor_model_parallel_size=2",
    ],
    "pp2": [
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
        "critic.megatron.pipeline_model_parallel_size=2",
    ],
    "dp2": [],
}

# The metric keys (reference verl names) every step reports; critic keys with a critic.
COMMON_KEYS = [
    "critic/score/mean",
    "critic/score/max",
    "critic/score/min",
    "critic/rewards/mean",
    "critic/advantages/mean",
    "critic/returns/mean",
    "response_length/mean",
    "response_length/max",
    "response_length/min",
    "response_length/clip_ratio",
    "prompt_length/mean",
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/pg_clipfrac_lower",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/grad_norm",
    "actor/lr",
    "timing_s/data",
    "timing_s/gen",
    "timing_s/reward",
    "timing_s/ref",
    "timing_s/adv",
    "timing_s/update_actor",
    "timing_s/update_weights",
    "timing_s/records",
    "timing_s/step",
    "perf/throughput",
    "perf/total_num_tokens",
    "perf/time_per_step",
    "perf/max_memory_allocated_gb",
    "perf/cpu_memory_used_gb",
    # model FLOPs utilisation per phase and of the step (verl.trainer.perf), two ranks sharing the FLOPs
    "perf/mfu/gen",
    "perf/mfu/ref",
    "perf/mfu/update_actor",
    "perf/mfu/step",
    "perf/tflops/step",
    "training/global_step",
    "training/epoch",
    "training/rollout_probs_diff_max",
    "training/rollout_probs_diff_mean",
    "training/token_mult_prob_error",
]
CRITIC_KEYS = [
    "critic/values/mean",
    "critic/vf_explained_var",
    "critic/vf_loss",
    "critic/vf_clipfrac",
    "critic/grad_norm",
    "timing_s/values",
    "timing_s/update_critic",
    # PPO's in-reward KL reads the old log-probabilities before the update: a separate pass (GRPO
    # here is one optimizer step per batch, so its update's own forward gives them)
    "timing_s/old_log_prob",
    "perf/mfu/values",
    "perf/mfu/update_critic",
    "perf/mfu/old_log_prob",
]

# The transformers engine and the Megatron actor compute the same float32 log-probabilities with
# different kernels (and TP=2 splits the vocabulary): rounding only; the rollout tests' bound.
LOGPROB_ATOL = 1e-4


def _config(config: str, model_dir: str, files: dict[str, str], *extra: str):
    from verl.config import PPOConfig, load_config

    return load_config(
        PPOConfig,
        config_file=config,
        overrides=[
            f"actor_rollout_ref.model.path={model_dir}",
            f"data.train_files={files['train']}",
            f"data.val_files={files.get('val_for_run', 'null')}",
            *FAST,
            *extra,
        ],
        world_size=2,
    )


def _layouts_body(model_dir: str, files: dict[str, str], root: str) -> dict[str, list[dict[str, float]]]:
    from verl.trainer.ppo_trainer import PPOTrainer

    out = {}
    for algo, config in (("grpo", "grpo_tiny_cpu"), ("ppo", "ppo_tiny_cpu")):
        for name, layout in LAYOUTS.items():
            cfg = _config(
                config,
                model_dir,
                files,
                *layout,
                "trainer.logger=[]",
                f"trainer.default_local_dir={root}/{algo}-{name}",
            )
            with PPOTrainer(cfg) as trainer:
                out[f"{algo}-{name}"] = [trainer.train_step() for _ in range(2)]
    return out


@pytest.mark.timeout(600)
def test_grpo_and_ppo_at_every_layout(tiny_model_dir, arithmetic_files, tmp_path):
    [results, _] = run_distributed(
        _layouts_body, 2, tiny_model_dir, arithmetic_files, str(tmp_path), timeout=560
    )
    for name, steps in results.items():
        first, second = steps
        # The first update's ratio is exactly 1 and its KL to the reference exactly 0.
        assert first["actor/ppo_kl"] == 0.0, name
        assert first["actor/pg_clipfrac"] == 0.0 and first["actor/pg_clipfrac_lower"] == 0.0, name
        if name.startswith("grpo"):
            assert abs(first["actor/kl_loss"]) <= 1e-6, name  # two engines: rounding (docstring)
        else:
            assert abs(first["actor/reward_kl_penalty"]) <= 1e-6, name  # two engines: rounding (docstring)
        keys = COMMON_KEYS + (CRITIC_KEYS if name.startswith("ppo") else [])
        missing = [k for k in keys if k not in first]
        assert not missing, (name, missing)
        for step in steps:
            assert step["training/rollout_logprob_diff_max"] < LOGPROB_ATOL, (
                name,
                step["training/rollout_logprob_diff_max"],
            )
            assert all(math.isfinite(v) for v in step.values()), name
        assert second["training/global_step"] == 2.0
    # The rollout layout (one engine per rank) is the same in every run, so the first step sees the
    # same samples; TP=2 and PP=2 must then take DP=2's step: float32 rounding of the split matmuls
    # and reductions apart (measured < 1e-5 relative).
    for algo in ("grpo", "ppo"):
        ref = results[f"{algo}-dp2"][0]
        for name in ("tp2", "pp2"):
            got = results[f"{algo}-{name}"][0]
            assert got["critic/score/mean"] == ref["critic/score/mean"], (algo, name)
            for key in ("actor/grad_norm", "actor/entropy") + (
                ("critic/vf_loss", "critic/grad_norm") if algo == "ppo" else ()
            ):
                assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-7), (algo, name, key)
    # PPO's second step: the actor has moved away from the reference.
    assert results["ppo-dp2"][1]["actor/reward_kl_penalty"] != 0.0


# ----------------------------------------------------------------------------------------------
# where the old log-probabilities come from (actor.old_log_prob)


def _old_log_prob_body(model_dir: str, files: dict[str, str], root: str) -> dict[str, list[dict[str, float]]]:
    from verl.trainer.ppo_trainer import PPOTrainer

    out = {}
    for source in ("recompute", "current", "rollout"):
        cfg = _config(
            "grpo_tiny_cpu",
            model_dir,
            files,
            f"actor_rollout_ref.actor.old_log_prob={source}",
            "trainer.logger=[]",
            f"trainer.default_local_dir={root}/{source}",
        )
        with PPOTrainer(cfg) as trainer:
            out[source] = [trainer.train_step() for _ in range(2)]
    return out


@pytest.mark.timeout(400)
def test_old_log_prob_sources_take_the_same_steps(tiny_model_dir, arithmetic_files, tmp_path):
    """With one optimizer step per batch, skipping the old-log-prob pass (``current``) changes no
    number: the same first and second steps as the pass (``recompute``), float32 rounding of the
    two forwards' different micro-batch arrangements apart; ``rollout`` (the engine's log-probs)
    differs by the engine-vs-trainer rounding only. Each measures the rollout agreement."""
    [results, _] = run_distributed(_old_log_prob_body, 2, tiny_model_dir, arithmetic_files, str(tmp_path), timeout=360)
    recompute, current, rollout = results["recompute"], results["current"], results["rollout"]
    assert "timing_s/old_log_prob" in recompute[0]
    assert "timing_s/old_log_prob" not in current[0] and "timing_s/old_log_prob" not in rollout[0]
    compared = (
        "actor/grad_norm", "actor/pg_loss", "actor/kl_loss", "actor/entropy",
        "training/token_mult_prob_error", "training/rollout_probs_diff_mean",
    )
    for step in range(2):
        assert current[step]["critic/score/mean"] == recompute[step]["critic/score/mean"], step
        for key in compared:
            assert current[step][key] == pytest.approx(recompute[step][key], rel=1e-5, abs=1e-7), (step, key)
        for key in ("training/rollout_logprob_diff_max", "training/rollout_probs_diff_max"):
            assert current[step][key] == pytest.approx(recompute[step][key], rel=1e-3, abs=1e-6), (step, key)
    # current: the ratio is exactly 1 in its one update, as the pass gives
    assert current[0]["actor/ppo_kl"] == 0.0 and recompute[0]["actor/ppo_kl"] == 0.0
    # rollout: the ratio is off 1 by the engine's rounding (under the rollout tests' bound), so the
    # first step's gradient is the pass's within that
    assert abs(rollout[0]["actor/ppo_kl"]) < LOGPROB_ATOL
    assert 1.0 <= rollout[0]["training/token_mult_prob_error"] < 1.0 + LOGPROB_ATOL
    assert rollout[0]["actor/grad_norm"] == pytest.approx(recompute[0]["actor/grad_norm"], rel=1e-3)


# ----------------------------------------------------------------------------------------------
# token-budget micro-batches (use_dynamic_bsz)

DYNAMIC_BUDGET = 96  # the longest sequence is 24 + 12 = 36 tokens; each rank holds 16 sequences


def _dynamic_bsz_body(model_dir: str, files: dict[str, str], root: str) -> list[dict[str, float]]:
    from verl.trainer.ppo_trainer import PPOTrainer

    cfg = _config(
        "grpo_tiny_cpu",
        model_dir,
        files,
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={DYNAMIC_BUDGET}",
        "actor_rollout_ref.actor.old_log_prob=recompute",  # the old-log-prob pass cuts by tokens too
        "trainer.logger=[]",
        f"trainer.default_local_dir={root}/dynbsz",
    )
    with PPOTrainer(cfg) as trainer:
        return [trainer.train_step()]


@pytest.mark.timeout(300)
def test_grpo_step_with_token_budget_micro_batches(tiny_model_dir, arithmetic_files, tmp_path):
    """One GRPO step at DP=2 with every forward and the update cut by a token budget: the
    micro-batch metrics, and the first update's invariants (the old-log-prob pass, the reference
    and the update cut the same rows the same way, so the ratio is exactly 1 and the KL 0)."""
    [(step,), _] = run_distributed(_dynamic_bsz_body, 2, tiny_model_dir, arithmetic_files, str(tmp_path), timeout=260)
    count, fill = step["actor/micro_batches"], step["actor/mb_token_fill"]
    # fill = the batch's tokens over (2 ranks x count x budget), so the two metrics explain each other
    assert fill * 2 * count * DYNAMIC_BUDGET == pytest.approx(step["perf/total_num_tokens"], rel=1e-9)
    assert 0.0 < fill <= 1.0 and count == int(count)
    # the fewest micro-batches the budget allows: at least the tokens' bound, fewer than one per row
    assert math.ceil(step["perf/total_num_tokens"] / 2 / DYNAMIC_BUDGET) <= count < 16
    assert step["actor/ppo_kl"] == 0.0 and step["actor/pg_clipfrac"] == 0.0
    assert abs(step["actor/kl_loss"]) <= 1e-6  # the actor's and the reference's engines: rounding (docstring)
    assert math.isfinite(step["actor/grad_norm"]) and "timing_s/old_log_prob" in step


# ----------------------------------------------------------------------------------------------
# resume

# Metrics that measure time or memory, not the computation.
_NOT_COMPARED = ("timing_s/", "perf/", "rollout/tokens_per_s", "rollout/time_s")


def _metrics(log_dir: str) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    with open(os.path.join(log_dir, "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            step = record.pop("step")
            out.setdefault(step, {}).update(
                {
                    k: v
                    for k, v in record.items()
                    if not k.startswith(_NOT_COMPARED) and not k.startswith("val-")
                }
            )
    return out


def _resume_body(model_dir: str, files: dict[str, str], root: str) -> dict[str, dict]:
    from verl.trainer.ppo_trainer import PPOTrainer

    # PPO with a critic, an adaptive in-reward KL controller and a warm-up: every piece of state
    # a checkpoint holds changes from step to step. 16 prompts, 8 per step: 2 steps per epoch.
    extra = [
        "trainer.total_epochs=2",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.kl_coef=0.05",
        "actor_rollout_ref.actor.optim.lr_warmup_steps=2",
        "trainer.logger=[jsonl]",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.shuffle=true",
    ]

    def run(name: str, *more: str, stop_after: int | None = None, resume: str = "disable"):
        cfg = _config(
            "ppo_tiny_cpu",
            model_dir,
            files,
            *extra,
            f"trainer.default_local_dir={root}/{name}",
            f"trainer.log_dir={root}/{name}/logs",
            f"trainer.resume_mode={resume}",
            *more,
        )
        with PPOTrainer(cfg) as trainer:
            start = trainer.resume()
            trainer.fit(stop_after=stop_after)
            return start, trainer.global_step

    whole = run("whole")
    parts = run("parts", "trainer.save_freq=1", stop_after=3)
    resumed = run("parts", "trainer.save_freq=1", resume="auto")
    boundary = run("boundary", f"trainer.resume_from_path={root}/parts/global_step_2", resume="resume_path")
    return {
        "steps": {"whole": whole, "parts": parts, "resumed": resumed, "boundary": boundary},
        "whole": _metrics(f"{root}/whole/logs"),
        "parts": _metrics(f"{root}/parts/logs"),
        "boundary": _metrics(f"{root}/boundary/logs"),
        "checkpoints": sorted(os.listdir(f"{root}/parts")),
    }


@pytest.mark.timeout(600)
def test_resume_equals_the_uninterrupted_run(tiny_model_dir, tmp_path):
    from verl.data.io import write_parquet
    from verl.data.tasks import arithmetic

    records, _ = arithmetic.generate_splits(train=16, val=0, digits=1, seed=3)
    write_parquet(records, str(tmp_path / "train16.parquet"))
    files = {"train": str(tmp_path / "train16.parquet")}
    [out, _] = run_distributed(_resume_body, 2, tiny_model_dir, files, str(tmp_path / "runs"), timeout=560)
    assert out["steps"] == {"whole": (0, 4), "parts": (0, 3), "resumed": (3, 4), "boundary": (2, 4)}
    whole = out["whole"]
    assert sorted(whole) == [1, 2, 3, 4]
    assert [whole[s]["training/epoch"] for s in (1, 2, 3, 4)] == [0.0, 0.0, 1.0, 1.0]
    # Mid-epoch resume (after step 3): step 4 is the uninterrupted run's, number for number.
    assert out["parts"][4] == whole[4]
    # The killed run's steps 1-3 were logged once each, and equal the uninterrupted run's.
    for step in (1, 2, 3):
        assert out["parts"][step] == whole[step], step
    # Resume exactly at the epoch boundary (step 2 = the end of epoch 0): the next epoch's
    # batches follow, so steps 3-4 are the uninterrupted run's.
    assert out["boundary"][3] == whole[3] and out["boundary"][4] == whole[4]
    assert sorted(out["boundary"]) == [3, 4]
    assert "global_step_4" in out["checkpoints"]
