"""``tools/bench.py rollout`` prints exactly one JSON object with the promised keys (small HF run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_rollout_prints_one_json_object(tiny_models):
    cmd = [
        sys.executable, os.path.join(REPO, "tools", "bench.py"), "rollout", "--model", tiny_models["llama"],
        "--engine", "hf", "--prompts", "4", "--n", "2", "--max-tokens", "4", "--repeats", "1", "--reference", "hf",
        "--baseline", "hf-generate",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    result = json.loads(lines[0])
    assert result["sequences"] == 8 and result["tokens"] <= 8 * 4
    assert result["tokens_per_s"] > 0 and result["cpu_s"] > 0
    # The plain transformers generate baseline: same prompts x n, up to the same length.
    plain = result["baselines"]["hf-generate"]
    assert result["baseline_engine"] == "hf-generate"
    assert plain["tokens_per_s"] > 0 and len(plain["speedup_rounds"]) == 1
    assert plain["speedup_rounds_median"] == pytest.approx(plain["speedup_rounds"][0])
    assert result["speedup_vs_baseline"] == pytest.approx(result["tokens_per_s"] / plain["tokens_per_s"])
    assert result["logprob_reference"] == "hf"
    # Same engine, same weights, float32: agreement to rounding (see test_engines.py).
    assert result["logprob_max_abs_diff"] < 1e-4
    assert 1.0 <= result["token_mult_prob_error"] < 1.0 + 1e-4
