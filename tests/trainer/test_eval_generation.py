"""``python -m verl.trainer.eval_generation`` refuses bad input before loading the model: exit 2, one line.

One case runs the module as a command (``python -m``: its exit status and stderr as a user sees them);
the others call its ``main(argv)`` in this process, the function that command runs, with the same
checks (exit status 2, no traceback, the one error line): a Python start per case was most of this
file's time."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.cli_errors import one_error_line

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROG = "python -m verl.trainer.eval_generation"


def _eval(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", "verl.trainer.eval_generation", *args], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=240)


@pytest.fixture
def in_process(capsys):
    """``main(argv)`` in this process, as a finished command: its exit status and what it wrote."""
    from verl.testing.commands import run_main
    from verl.trainer.eval_generation import main

    return lambda *args: run_main(main, args, capsys=capsys)


def test_a_model_directory_that_does_not_exist(tmp_path, arithmetic_files):
    proc = _eval("--model", str(tmp_path / "nope"), "--data", arithmetic_files["val"])
    assert one_error_line(proc, PROG).endswith(
        f"argument --model: '{tmp_path}/nope' does not exist; give a Hugging Face model directory (config.json + weights)"
    )


def test_a_truncated_weight_file_is_named(tmp_path, tiny_model_dir, arithmetic_files, in_process):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    os.truncate(model / "model.safetensors", 6)
    proc = in_process("--model", str(model), "--data", arithmetic_files["val"])
    assert one_error_line(proc, PROG).endswith(
        f"{model}/model.safetensors: not a readable safetensors file (6 bytes, shorter than the 8-byte header "
        "length); a truncated or partial copy? Copy the file again"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-samples", "-1"], "argument --max-samples: must be >= 1, got -1"),
        (["--batch-size", "0"], "argument --batch-size: must be >= 1, got 0"),
        (["--max-new-tokens", "1.5"], "argument --max-new-tokens: expected a whole number, got '1.5'"),
    ],
)
def test_nonsensical_numbers(tiny_model_dir, arithmetic_files, args, message, in_process):
    proc = in_process("--model", tiny_model_dir, "--data", arithmetic_files["val"], *args)
    assert one_error_line(proc, PROG).endswith(message)


@pytest.mark.parametrize(
    ("column", "value", "message"),
    [
        ("reward_model", None, "row 5: field 'reward_model' is null (needed for 'reward_model.ground_truth')"),
        ("data_source", "no/such/task", "row 5: no rule-based scorer for data_source='no/such/task'"),
    ],
)
def test_a_bad_row_is_named_before_generation(
    tmp_path, tiny_model_dir, arithmetic_files, column, value, message, in_process
):
    rows = pq.read_table(arithmetic_files["val"]).to_pylist()
    rows[5][column] = value
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), bad)
    proc = in_process("--model", tiny_model_dir, "--data", str(bad))
    assert f"{bad}: {message}" in one_error_line(proc, PROG)


def test_a_folder_given_as_the_data(tiny_model_dir, arithmetic_files, in_process):
    folder = os.path.dirname(arithmetic_files["val"])
    proc = in_process("--model", tiny_model_dir, "--data", folder)
    assert f"{folder} is a directory, not a data file; give the data files in it" in one_error_line(proc, PROG)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--n", "4"], "n=4 responses per prompt are all the same when greedy; give a temperature > 0"),
        (["--temperature", "-1"], "temperature must be >= 0 (0: greedy), got -1.0"),
    ],
)
def test_sampling_arguments_that_cannot_work(tiny_model_dir, arithmetic_files, args, message, in_process):
    proc = in_process("--model", tiny_model_dir, "--data", arithmetic_files["val"], *args)
    assert one_error_line(proc, PROG).endswith(message)


def test_sampled_evaluation_is_seeded(tiny_model_dir, arithmetic_files):
    """--temperature 1 --n 3: every prompt sampled three times (the accuracy is their mean), the same
    responses for the same seed, others for another."""
    from verl.trainer.eval_generation import evaluate_generation

    def run(seed):
        return evaluate_generation(tiny_model_dir, arithmetic_files["val"], max_samples=4, max_new_tokens=6,
                                   temperature=1.0, n=3, seed=seed, num_examples=12)

    first, again, other = run(0), run(0), run(1)
    assert first.num_samples == 4 and len(first.examples) == 12  # 4 prompts x 3 samples
    assert [e["prompt"] for e in first.examples[:3]] == [first.examples[0]["prompt"]] * 3
    assert [e["response"] for e in first.examples] == [e["response"] for e in again.examples]
    assert [e["response"] for e in first.examples] != [e["response"] for e in other.examples]
    assert first.accuracy == sum(e["score"] for e in first.examples) / 12
