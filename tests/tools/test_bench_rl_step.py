"""``tools/bench.py rl-step``: two steps of the real RL trainer (world of one, transformers rollout, the
raw tiny model) print one JSON object whose phases add up to the step and follow the config."""

from __future__ import annotations

import pytest

from tests.tools.bench_run import run_bench

# 8 prompts x 4 samples of up to 12 tokens, one mini-batch and one micro-batch per step.
SMALL = [
    "actor_rollout_ref.rollout.name=hf",
    "data.train_batch_size=8",
    "data.max_prompt_length=32",
    "data.max_response_length=12",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
    "actor_rollout_ref.actor.use_kl_loss=false",  # no reference: its phase must then be absent
]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_rl_step_phases_add_up(tmp_path):
    result, _ = run_bench(
        "rl-step", "--config", "grpo_tiny_cpu", "--inputs", str(tmp_path), "--prompts", "64",
        "--steps", "2", "--warmup", "1", *SMALL, timeout=170,
    )
    assert result["bench"] == "rl-step" and result["world_size"] == 1 and result["rollout"] == "hf"
    assert len(result["steps"]) == 2
    # The phases the GRPO step without a KL loss runs, and no others: one optimizer step per
    # batch, so no old-log-prob pass either (actor.old_log_prob=auto)
    assert set(result["phases"]) == {"data", "gen", "update_weights", "reward", "adv", "update_actor", "records"}
    for step in result["steps"]:
        accounted = sum(p["seconds"] for p in step["phases"].values())
        assert all(p["seconds"] >= 0 for p in step["phases"].values()), step
        # What no phase times (data loading, metrics) stays under the 5% of the step.
        assert abs(step["step_s"] - accounted) <= 0.05 * step["step_s"], step
        assert step["generated_tokens"] > 0 and step["total_tokens"] > step["generated_tokens"]
        assert 0.0 <= step["score_mean"] <= 1.0
    assert result["phases_add_up"] is True
    assert abs(result["unaccounted_share"]) <= 0.05
    shares = sum(p["share"] for p in result["phases"].values()) + result["unaccounted_share"]
    assert shares == pytest.approx(1.0)
    for name in ("gen", "update_actor"):
        phase = result["phases"][name]
        assert phase["tokens_per_s"] > 0, name
        assert phase["peak_memory_bytes"] > 50 * 2**20, name  # the process holds torch and two models
    assert result["phases"]["update_weights"]["tokens_per_s"] is None
    assert result["generated_tokens_per_s"] > 0 and result["peak_memory_bytes"] > 0
    for key in ("config", "overrides", "n", "response_length", "prompts_per_step", "threads", "table"):
        assert key in result, key
    assert "update_actor" in result["table"] and "(unaccounted)" in result["table"]
    # Model FLOPs utilisation (verl.trainer.perf) of the phases that compute and of the step; none for a push.
    assert result["phases"]["gen"]["mfu"] > 0 and result["phases"]["update_actor"]["mfu"] > 0
    assert result["phases"]["update_weights"]["mfu"] is None and result["mfu"] > 0
    assert result["tflops_per_device"] > 0 and "MFU" in result["table"].splitlines()[0]


def _bench_module():
    from tools.benchmarks import rl_step

    return rl_step


def test_median_table_unaccounted_is_the_steps_own_over_an_odd_count():
    """Three steps that each add up within 0.1%: the medians' table must not show 12% unaccounted."""
    bench = _bench_module()
    steps = []
    for gen, update in ((2.0, 2.5), (1.0, 2.3), (1.5, 3.2)):  # step medians come from different steps
        total = gen + update + 0.001
        steps.append({"step_s": total, "unaccounted_s": 0.001, "unaccounted_share": 0.001 / total,
                      "phases": {"gen": {"seconds": gen, "tokens_per_s": 1.0},
                                 "update_actor": {"seconds": update, "tokens_per_s": 1.0}}})
    result = bench._median_phases(steps)
    assert result["step_s"] == pytest.approx(4.501)
    assert result["phases"]["gen"]["seconds"] == 1.5 and result["phases"]["update_actor"]["seconds"] == 2.5
    expected, actual = 0.001, result["unaccounted_s"]
    assert actual == pytest.approx(expected)  # the median step less the phases' medians would be 0.501
