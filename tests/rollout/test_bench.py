"""``tools/bench.py rollout`` prints exactly one JSON object with the promised keys (small HF run)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.cli_errors import one_error_line

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


def _bench(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, os.path.join(REPO, "tools", "bench.py"), "rollout", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)


def _damaged_copy(model: str, tmp_path, keep_bytes: int | None = None, drop: str | None = None) -> str:
    copy = tmp_path / "model"
    shutil.copytree(model, copy)
    if keep_bytes is not None:
        os.truncate(copy / "model.safetensors", keep_bytes)
    if drop is not None:
        os.remove(copy / drop)
    return str(copy)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompts", "-1"], "argument --prompts: must be >= 1, got -1"),
        (["--n", "0"], "argument --n: must be >= 1, got 0"),
        (["--max-tokens", "x"], "argument --max-tokens: expected a whole number, got 'x'"),
        (["--temperature", "-0.5"], "argument --temperature: must be >= 0, got -0.5"),
        (["--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
    ],
)
def test_nonsensical_numbers_are_refused(tiny_models, args, message):
    proc = _bench("--model", tiny_models["llama"], "--engine", "hf", *args)
    assert one_error_line(proc, "bench.py rollout").endswith(message)


def test_a_model_directory_that_does_not_exist(tmp_path):
    proc = _bench("--model", str(tmp_path / "nope"), "--engine", "hf")
    assert one_error_line(proc, "bench.py rollout").endswith(
        f"argument --model: '{tmp_path}/nope' does not exist; give a Hugging Face model directory (config.json + weights)"
    )


def test_a_truncated_weight_file_is_named(tiny_models, tmp_path):
    model = _damaged_copy(tiny_models["llama"], tmp_path, keep_bytes=100_000)
    proc = _bench("--model", model, "--engine", "hf", "--reference", "none")
    line = one_error_line(proc, "bench.py")
    assert f"{model}/model.safetensors: truncated: tensor " in line and "Copy the file again" in line


def test_a_model_directory_without_a_tokenizer(tiny_models, tmp_path):
    model = _damaged_copy(tiny_models["llama"], tmp_path, drop="tokenizer.json")
    proc = _bench("--model", model, "--engine", "hf", "--reference", "none")
    assert one_error_line(proc, "bench.py").endswith(
        f"{model!r} holds no tokenizer (none of tokenizer.json, tokenizer.model, vocab.json, vocab.txt, spiece.model, "
        "sentencepiece.bpe.model); point the tokenizer path (model.tokenizer_path) at the directory that has one"
    )
