"""``tools/bench.py compare-trl --nproc 2``: TRL's GRPOTrainer on its own 2-process launch against ours on
2 ranks, the launches stepped in turn; a smoke run at tiny shapes (TRL needed) and the refusals that
come before any launch (TRL not needed)."""

from __future__ import annotations

import pytest

from tests.tools.bench_run import run_bench
from verl.testing.commands import run_main


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--prompts", "3", "--nproc", "2"], {}, "--prompts 3 does not split over --nproc 2 processes"),
        (["--nproc", "2"], {"WORLD_SIZE": "2"}, "start it with plain python, not torchrun"),
    ],
    ids=["prompts-not-divisible", "under-torchrun"],
)
def test_compare_trl_nproc_refusals(monkeypatch, argv, env, message):
    from tools.benchmarks.cli import main

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    done = run_main(main, ["compare-trl", *argv], name="bench.py")
    assert done.returncode != 0
    assert message in done.stderr, done.stderr
    assert done.stdout == ""  # no JSON for a refused run


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("launch", ["together", "apart"])
def test_compare_trl_nproc2_smoke(tmp_path, launch):
    pytest.importorskip("trl", reason="the bench extra (pip install -e .[bench]) brings TRL")
    # OMP_NUM_THREADS unset in the bench's own environment: each launch's processes must still run on
    # --threads (1), not on the core count accelerate would pick.
    result, _ = run_bench(
        "compare-trl", "--nproc", "2", "--launch", launch, "--inputs", str(tmp_path), "--engine", "hf",
        "--prompts", "2", "--n", "2", "--response-length", "6", "--steps", "1", "--warmup", "1", "--reward", "words",
        timeout=400, threads=None,
    )
    assert result["nproc"] == 2 and result["launch"] == launch
    # Each side on its own 2 processes: TRL's data-parallel launch with half the 4 samples per process,
    # ours colocated on 2 ranks (data parallel 2, synchronous, one engine per rank).
    assert result["trl"]["processes"] == 2 and result["trl"]["per_device_train_batch_size"] == 2
    assert result["ours"]["processes"] == 2 and result["ours"]["rollout_tensor_parallel"] == 1
    assert "colocated" in result["ours"]["layout"] and "rollout_mode=sync" in result["ours"]["layout"]
    assert result["trl"]["bf16"] is True and result["trl"]["beta"] == 0.0  # TRL's defaults, kept
    assert result["threads_seen"] == [1]  # every process of both launches, after every step
    for side in ("ours", "trl"):
        rounds = result[side]["rounds"]
        assert len(rounds) == 1, side
        for r in rounds:
            assert 0 < r["gen_s"] < r["step_s"], (side, r)
            # The whole step's samples, both processes' (TRL's and our metrics are gathered over ranks).
            assert 0 < r["generated_tokens"] <= 2 * 2 * 6, (side, r)
            assert 0 < r["mfu"] < 1.5 and r["tflops"] > 0, (side, r)
            assert len(r["load_average"]) == 3, (side, r)  # the machine's, at the step's end
            assert 0 < r["cpu_s"], (side, r)  # both processes' CPU seconds in the step
        assert result[side]["generated_tokens_per_cpu_s"] > 0
    assert result["samples_seen"] == [0, 4]
    assert len(result["reward_curve_ours"]) == len(result["reward_curve_trl"]) == 2  # warm-up included
    assert all(0.0 <= v <= 1.0 for v in result["reward_curve_ours"] + result["reward_curve_trl"])
    expected = result["ours"]["generated_tokens_per_s"] / result["trl"]["generated_tokens_per_s"]
    assert result["tokens_per_s_ratio_of_medians"] == pytest.approx(expected)
    per_cpu = [(a["generated_tokens"] / a["cpu_s"]) / (b["generated_tokens"] / b["cpu_s"])
               for a, b in zip(result["ours"]["rounds"], result["trl"]["rounds"])]
    assert result["tokens_per_cpu_s_ratio_rounds"] == pytest.approx(per_cpu)
