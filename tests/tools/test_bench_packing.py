"""``tools/bench.py packing``: padded rows against packed sequences in one process, one JSON object.

No speed is asserted (timings belong to the bench's figures, not to tests): the run must time
both sides every round, measure the batch it built (rollout-shaped, with padding to remove) and
find the two engines' log-probabilities equal up to float rounding.
"""

from __future__ import annotations

import pytest

from tests.tools.bench_run import run_bench


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_packing_bench_times_both_sides_on_a_padded_batch(tmp_path):
    result, proc = run_bench(
        "packing", "--inputs", str(tmp_path), "--rows", "8", "--micro-batch", "4", "--prompt-length", "8",
        "--response-length", "12", "--rounds", "2", timeout=170,
    )
    assert result["bench"] == "packing" and result["rows"] == 8 and result["micro_batch"] == 4
    assert result["model"] == str(tmp_path / "qwen2-h64-l2-a2")
    assert 0 < result["real_tokens"] <= 8 * 20 and result["token_fill"] == pytest.approx(
        result["real_tokens"] / 160
    )
    assert result["token_fill"] < 0.9  # the batch has padding to remove
    assert len(result["speedup_rounds"]) == 2 and result["padded_s"] > 0 and result["packed_s"] > 0
    assert result["speedup"] == pytest.approx(result["padded_s"] / result["packed_s"])
    # float32, the same model on other shapes (test_packed_sequences measured at most 4.8e-7)
    assert result["logprob_max_abs_diff"] <= 2e-6
    assert "speed-up" in proc.stderr
