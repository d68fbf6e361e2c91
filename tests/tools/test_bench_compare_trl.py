"""``tools/bench.py compare-trl`` smoke run: one warm-up and one measured round of TRL's GRPOTrainer and
ours (transformers rollout, tiny shapes, the words reward); the JSON holds both sides and ratios consistent
with them."""

from __future__ import annotations

import pytest

from tests.tools.bench_run import run_bench

pytest.importorskip("trl", reason="the bench extra (pip install -e .[bench]) brings TRL")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_compare_trl_smoke(tmp_path):
    # OMP_NUM_THREADS unset, so accelerate would set the process's torch threads to the core count: the
    # bench must not let it (both sides run on --threads, 1 by default).
    result, _ = run_bench(
        "compare-trl", "--inputs", str(tmp_path), "--engine", "hf", "--prompts", "2", "--n", "2",
        "--response-length", "6", "--steps", "1", "--warmup", "1", "--reward", "words",
        timeout=230, threads=None,
    )
    assert result["trl"]["bf16"] is True  # TRL's own default, kept
    assert result["trl"]["beta"] == 0.0
    assert result["threads"] == 1 and result["threads_seen"] == [1]
    for side in ("ours", "trl"):
        rounds = result[side]["rounds"]
        assert len(rounds) == 1, side
        for r in rounds:
            assert 0 < r["gen_s"] < r["step_s"], (side, r)
            assert 0 < r["generated_tokens"] <= 2 * 2 * 6, (side, r)  # prompts x n x response length
        assert 0 < result[side]["gen_share"] < 1
        # The step's model FLOPs utilisation (verl.trainer.perf), TRL's counted on its lengths.
        assert all(0 < r["mfu"] < 1.5 and r["tflops"] > 0 for r in rounds), (side, rounds)
        assert result[side]["mfu_step"] == rounds[0]["mfu"]
    assert len(result["reward_curve_ours"]) == len(result["reward_curve_trl"]) == 2  # warm-up included
    assert result["reward"] == "words"  # tools/bench_rewards.py on both sides: scores in [0, 1]
    assert all(0.0 <= v <= 1.0 for v in result["reward_curve_ours"] + result["reward_curve_trl"])
    assert result["reward_last_ours"] == result["reward_curve_ours"][-1]
    assert result["machine"]["cores"] >= 1 and result["machine"]["trl"] == result["trl"]["version"]
    expected = result["ours"]["generated_tokens_per_s"] / result["trl"]["generated_tokens_per_s"]
    assert result["tokens_per_s_ratio_of_medians"] == pytest.approx(expected)
    per_round = [
        (a["generated_tokens"] / a["step_s"]) / (b["generated_tokens"] / b["step_s"])
        for a, b in zip(result["ours"]["rounds"], result["trl"]["rounds"])
    ]
    assert result["tokens_per_s_ratio_rounds"] == pytest.approx(per_round)
