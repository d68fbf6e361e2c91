"""``tools/bench.py packing``: padded rows against packed sequences in one process, one JSON object.

No speed is asserted (timings belong to the bench's figures, not to tests): the run must time
both sides every round, measure the batch it built (rollout-shaped, with padding to remove) and
find the two engines' log-probabilities equal up to float rounding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "tools", "bench.py")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_packing_bench_times_both_sides_on_a_padded_batch(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(
        [
            sys.executable,
            BENCH,
            "packing",
            "--inputs",
            str(tmp_path),
            "--rows",
            "8",
            "--micro-batch",
            "4",
            "--prompt-length",
            "8",
            "--response-length",
            "12",
            "--rounds",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=170,
        cwd=REPO,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    result = json.loads(lines[0])
    assert result["bench"] == "packing" and result["rows"] == 8 and result["micro_batch"] == 4
    assert result["model"] == str(tmp_path / "qwen2-h64-l2-a2")
    assert 0 < result["real_tokens"] <= 8 * 20 and result["token_fill"] == pytest.approx(
        result["real_tokens"] / 160
    )
    assert result["token_fill"] < 0.9  # the batch has padding to remove
    assert len(result["speedup_rounds"]) == 2 and result["padded_s"] > 0 and result["packed_s"] > 0
    assert result["speedup"] == pytest.approx(result["padded_s"] / result["packed_s"])
    assert result["logprob_max_abs_diff"] < 1e-4  # float32: the same math on other shapes
    assert "speed-up" in proc.stderr
