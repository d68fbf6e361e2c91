"""GRPO with context parallelism: the actor and the reference at CP 2 on 2 ranks (the rollout unchanged).

The first step's invariants hold as at every other layout (tests/trainer/test_rl_trainer.py's
docstring): the policy ratio is exactly 1 and the KL to the reference 0 to float rounding; the
rollout's log-probabilities agree with the actor's as without CP; and since the rollout layout (a
transformers engine per rank) is the same, the first update sees DP 2's samples and must take its
step: gradient norm and entropy within float32 rounding (rel 1e-4, as the other layouts). The weight
push runs at CP 2 (CP ranks hold the same weights; each is a source of its shard, as a DP replica).
Packed sequences (the tiny GRPO config's ``use_remove_padding``) and padded rows both run at CP 2.
Pre-flight: CP with a Mixture-of-Experts model (not supported yet) is refused before any model is built.
"""

from __future__ import annotations

import math

import pytest

from tests.trainer.test_moe_grpo import moe_model_dir  # noqa: F401 (a fixture)
from tests.trainer.test_rl_trainer import DYNAMIC_BUDGET, LOGPROB_ATOL, _config
from verl.testing.distributed import run_distributed

CP2 = [
    "actor_rollout_ref.actor.megatron.context_parallel_size=2",
    "actor_rollout_ref.ref.megatron.context_parallel_size=2",
]
UNPACKED = ["actor_rollout_ref.model.use_remove_padding=false"]


def _grpo_body(model_dir: str, files: dict[str, str], root: str) -> dict[str, list[dict[str, float]]]:
    from verl.trainer.ppo_trainer import PPOTrainer

    out = {}
    for name, layout in (("cp2", [*CP2, *UNPACKED]), ("cp2-packed", CP2), ("dp2", UNPACKED)):
        cfg = _config("grpo_tiny_cpu", model_dir, files, *layout, "trainer.logger=[]",
                      f"trainer.default_local_dir={root}/{name}")
        with PPOTrainer(cfg) as trainer:
            out[name] = [trainer.train_step() for _ in range(2)]
            out[name][0]["cp_sizes"] = (trainer.actor.engine.pg.cp.size(), trainer.reference.role.engine.pg.cp.size())
    return out


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_grpo_at_cp2_has_ratio_one_and_takes_dp2s_step(tiny_model_dir, arithmetic_files, tmp_path):
    results, other = run_distributed(_grpo_body, 2, tiny_model_dir, arithmetic_files, str(tmp_path), timeout=560)
    assert [results[k][0].pop("cp_sizes") for k in ("cp2", "cp2-packed", "dp2")] == [(2, 2), (2, 2), (1, 1)]
    for name, steps in results.items():
        other[name][0].pop("cp_sizes")
        for key in ("actor/grad_norm", "actor/entropy", "actor/ppo_kl"):  # every rank reports the same step
            assert steps[0][key] == other[name][0][key], (name, key)
        first = steps[0]
        assert first["actor/ppo_kl"] == 0.0, name
        assert first["actor/pg_clipfrac"] == 0.0 and first["actor/pg_clipfrac_lower"] == 0.0, name
        assert abs(first["actor/kl_loss"]) <= 1e-6, name  # two engines: rounding (test_rl_trainer's docstring)
        for step in steps:
            assert step["training/rollout_logprob_diff_max"] < LOGPROB_ATOL, (name, step["training/rollout_logprob_diff_max"])
            assert all(math.isfinite(v) for v in step.values()), name
        assert steps[1]["training/global_step"] == 2.0
    dp = results["dp2"][0]
    for name in ("cp2", "cp2-packed"):
        cp = results[name][0]
        assert cp["critic/score/mean"] == dp["critic/score/mean"], name
        for key in ("actor/grad_norm", "actor/entropy", "actor/pg_loss"):
            assert cp[key] == pytest.approx(dp[key], rel=1e-4, abs=1e-7), (name, key)
        # the second step's samples come from the pushed weights: CP's push gave DP's rollout
        assert results[name][1]["critic/score/mean"] == results["dp2"][1]["critic/score/mean"], name


def _dynamic_bsz_body(model_dir: str, files: dict[str, str], root: str) -> list[dict[str, float]]:
    from verl.trainer.ppo_trainer import PPOTrainer

    cfg = _config("grpo_tiny_cpu", model_dir, files, *CP2, "actor_rollout_ref.actor.use_dynamic_bsz=true",
                  f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={DYNAMIC_BUDGET}",
                  "actor_rollout_ref.actor.old_log_prob=recompute", "trainer.logger=[]",
                  f"trainer.default_local_dir={root}/dynbsz")
    with PPOTrainer(cfg) as trainer:
        return [trainer.train_step()]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_token_budget_counts_per_cp_rank(tiny_model_dir, arithmetic_files, tmp_path):
    """``ppo_max_token_len_per_gpu`` at CP 2: each rank holds half of a micro-batch's tokens, so a micro-batch
    holds up to 2 x the budget of whole rows (one data-parallel rank holds the whole batch)."""
    [(step,), _] = run_distributed(_dynamic_bsz_body, 2, tiny_model_dir, arithmetic_files, str(tmp_path), timeout=260)
    count, fill, total = step["actor/micro_batches"], step["actor/mb_token_fill"], step["perf/total_num_tokens"]
    assert fill * count * 2 * DYNAMIC_BUDGET == pytest.approx(total, rel=1e-9)  # fill per CP rank's budget
    assert math.ceil(total / (2 * DYNAMIC_BUDGET)) <= count < math.ceil(total / DYNAMIC_BUDGET)
    assert step["actor/ppo_kl"] == 0.0 and step["actor/pg_clipfrac"] == 0.0
    assert abs(step["actor/kl_loss"]) <= 1e-6


def test_cp_with_a_moe_model_is_refused_before_any_model(moe_model_dir, arithmetic_files):
    from verl.trainer.ppo_checks import preflight

    # The actor at CP 2 (the reference follows it): one problem, one line, naming the key and the fix.
    cfg = _config("grpo_tiny_cpu", moe_model_dir, arithmetic_files, CP2[0])
    with pytest.raises(ValueError) as info:
        preflight(cfg, 2)
    assert str(info.value) == (
        "actor_rollout_ref.actor.megatron.context_parallel_size=2: context parallelism (CP 2) is supported for dense "
        "models only and qwen3_moe is a Mixture-of-Experts model (its routers, load-balancing loss and expert "
        "gradients are not checked across context-parallel ranks): set context_parallel_size=1; for long sequences "
        "use tensor parallel with sequence_parallel=true, or model.enable_gradient_checkpointing=true"
    )
