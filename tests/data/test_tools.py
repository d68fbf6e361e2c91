"""Preprocess tools on files in the public datasets' schemas, loaded and scored end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.cli_errors import one_error_line
from verl.data import RLPromptDataset, read_records
from verl.data.tasks import arithmetic, countdown, gsm8k
from verl.data.tasks import math as math_task
from verl.rewards import default_compute_score

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GSM8K_ROWS = [
    {
        "question": "Omar packs 36 jars on Monday and a third as many on Tuesday. "
        "How many jars does he pack on the two days?",
        "answer": "On Tuesday he packs 36/3 = <<36/3=12>>12 jars.\n"
        "In all he packs 36+12 = <<36+12=48>>48 jars.\n#### 48",
    },
    {
        "question": "A shop sells 1,000 pens a day. How many pens does it sell in 3 days?",
        "answer": "It sells 1,000 * 3 = 3,000 pens.\n#### 3,000",
    },
]
MATH_ROWS = [
    {
        "problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?",
        "solution": "We have $\\frac{1}{2} + \\frac{1}{4} = \\boxed{\\frac{3}{4}}$.",
        "level": "Level 1",
        "type": "Prealgebra",
    },
    {
        "problem": "Compute $2^{10}$.",
        "solution": "First $2^5 = \\boxed{32}$ is wrong to stop at; $2^{10} = \\boxed{1024}$.",
        "level": "Level 2",
        "type": "Algebra",
    },
]


def run_tool(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def score_reference_answers(path: str, tokenizer) -> list[float]:
    """Load with the RL dataset and score each row's reference solution with verl.rewards."""
    ds = RLPromptDataset(path, tokenizer, max_prompt_length=256, truncation="left")
    scores = []
    for i in range(len(ds)):
        item = ds[i]
        reference = item["extra_info"]["answer"]
        scores.append(
            default_compute_score(item["data_source"], reference, item["reward_model"]["ground_truth"])
        )
    return scores


def test_gsm8k_written_by_hf_datasets_converts_loads_and_scores(tmp_path, tokenizer):
    """A GSM8K parquet as Hugging Face ``datasets`` writes it: convert, load, score without edits."""
    datasets = pytest.importorskip("datasets")
    src = str(tmp_path / "gsm8k_test.parquet")
    datasets.Dataset.from_list(GSM8K_ROWS).to_parquet(src)
    out = str(tmp_path / "out" / "test.parquet")
    run_tool("tools/data/gsm8k.py", "--input", src, "--output", out, "--split", "test")
    records = list(read_records(out))
    assert [r["reward_model"]["ground_truth"] for r in records] == ["48", "3000"]
    assert records[0]["data_source"] == "openai/gsm8k" and records[0]["extra_info"]["split"] == "test"
    assert records[0]["prompt"][0]["content"].startswith("Omar packs 36 jars")
    assert score_reference_answers(out, tokenizer) == [1.0, 1.0]
    # A wrong final answer scores 0: the scorer really compares against the ground truth.
    assert default_compute_score("openai/gsm8k", "#### 47", records[0]["reward_model"]["ground_truth"]) == 0.0


def test_math_tool_from_jsonl(tmp_path, tokenizer):
    src = tmp_path / "math.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in MATH_ROWS))
    out = str(tmp_path / "math.parquet")
    run_tool("tools/data/math.py", "--input", str(src), "--output", out)
    records = list(read_records(out))
    assert [r["reward_model"]["ground_truth"] for r in records] == ["\\frac{3}{4}", "1024"]
    assert records[1]["extra_info"]["level"] == "Level 2" and records[0]["data_source"] == "lighteval/MATH"
    # The reference solution's final box is judged; the scorer accepts it.
    assert score_reference_answers(out, tokenizer) == [1.0, 1.0]


def test_arrow_in_verl_format_written_by_hf_datasets_loads_and_scores(tmp_path, tokenizer):
    """An arrow file of verl-format records written by someone else's code (HF ``datasets``)."""
    datasets = pytest.importorskip("datasets")
    train, _ = arithmetic.generate_splits(train=6, val=0, digits=3, seed=5)
    datasets.Dataset.from_list(train).save_to_disk(str(tmp_path / "saved"))
    (arrow,) = [f for f in os.listdir(tmp_path / "saved") if f.endswith(".arrow")]
    path = str(tmp_path / "saved" / arrow)
    assert score_reference_answers(path, tokenizer) == [1.0] * 6
    ds = RLPromptDataset(path, tokenizer, max_prompt_length=64)
    assert default_compute_score("verl/arithmetic", "Answer: 0", ds[0]["reward_model"]["ground_truth"]) == 0.0


def test_arithmetic_tool_is_seeded_and_disjoint(tmp_path):
    for d in ("a", "b"):
        run_tool(
            "tools/data/arithmetic.py",
            "--out-dir",
            str(tmp_path / d),
            "--train",
            "50",
            "--val",
            "20",
            "--digits",
            "2",
            "--ops",
            "+-",
            "--seed",
            "3",
        )
    for split in ("train", "test"):
        assert pq.read_table(tmp_path / "a" / f"{split}.parquet").equals(
            pq.read_table(tmp_path / "b" / f"{split}.parquet")
        )
    train = list(read_records(str(tmp_path / "a" / "train.parquet")))
    val = list(read_records(str(tmp_path / "a" / "test.parquet")))
    assert len(train) == 50 and len(val) == 20
    assert not {r["extra_info"]["question"] for r in val} & {r["extra_info"]["question"] for r in train}
    for r in train:
        q = r["extra_info"]["question"]
        a, op, b = (
            q.removeprefix("What is ").removesuffix("?").partition("+")
            if "+" in q
            else q.removeprefix("What is ").removesuffix("?").partition("-")
        )
        assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99
        assert r["reward_model"]["ground_truth"] == str(int(a) + int(b) if op == "+" else int(a) - int(b))
        assert r["extra_info"]["answer"] == f"Answer: {r['reward_model']['ground_truth']}"
    proc = run_tool(
        "tools/data/arithmetic.py",
        "--out-dir",
        str(tmp_path / "c"),
        "--digits",
        "1",
        "--train",
        "100",
        "--val",
        "50",
        check=False,
    )
    assert proc.returncode == 2 and "could only find" in proc.stderr


def test_countdown_generate_and_convert(tmp_path):
    run_tool(
        "tools/data/countdown.py",
        "generate",
        "--out-dir",
        str(tmp_path),
        "--train",
        "20",
        "--val",
        "5",
        "--count",
        "3",
    )
    for r in read_records(str(tmp_path / "train.parquet")):
        solution = r["extra_info"]["solution"]
        assert (
            default_compute_score(
                "countdown", f"<answer>{solution}</answer>", r["reward_model"]["ground_truth"]
            )
            == 1.0
        )
    src = str(tmp_path / "public.parquet")
    pq.write_table(pa.Table.from_pylist([{"target": 24, "nums": [4, 6, 1]}]), src)
    run_tool("tools/data/countdown.py", "convert", "--input", src, "--output", str(tmp_path / "conv.parquet"))
    (rec,) = read_records(str(tmp_path / "conv.parquet"))
    assert rec["reward_model"]["ground_truth"] == {"target": 24, "numbers": [4, 6, 1]}
    assert (
        default_compute_score("countdown", "<answer>4 * 6 * 1</answer>", rec["reward_model"]["ground_truth"])
        == 1.0
    )


@pytest.mark.parametrize("tool", ["gsm8k.py", "math.py", "countdown.py", "arithmetic.py"])
def test_tools_help_and_missing_input(tmp_path, tool):
    proc = run_tool(f"tools/data/{tool}", "--help")
    assert "usage:" in proc.stdout
    if tool == "arithmetic.py":
        for flag in ("--out-dir", "--train", "--val", "--digits", "--ops", "--seed"):
            assert flag in proc.stdout
        return
    args = ["convert"] if tool == "countdown.py" else []
    proc = run_tool(
        f"tools/data/{tool}",
        *args,
        "--input",
        str(tmp_path / "nope.jsonl"),
        "--output",
        str(tmp_path / "o.parquet"),
        check=False,
    )
    assert proc.returncode == 2 and "nope.jsonl does not exist" in proc.stderr


@pytest.mark.parametrize("command", ["generate", "convert"])
def test_countdown_sub_commands_describe_themselves(command):
    """Each sub-command's --help says what it does between its usage and its options."""
    out = run_tool("tools/data/countdown.py", command, "--help").stdout
    between = out.split("\n\n")[1]  # usage, description, options
    assert not between.startswith("options:"), out
    assert between.split()[0] == command.capitalize(), out


def test_converters_name_file_row_and_field(tmp_path):
    with pytest.raises(ValueError, match=r"f.jsonl: row 3 has no field 'answer'"):
        gsm8k.convert_row({"question": "q"}, index=3, split="train", path="f.jsonl")
    with pytest.raises(ValueError, match=r"f.jsonl: row 0 field 'answer' has no final '#### <number>'"):
        gsm8k.convert_row({"question": "q", "answer": "42"}, index=0, split="train", path="f.jsonl")
    with pytest.raises(ValueError, match=r"row 1 field 'solution' has no closed"):
        math_task.convert_row(
            {"problem": "p", "solution": "\\boxed{3"}, index=1, split="train", path="f.jsonl"
        )
    with pytest.raises(ValueError, match=r"row 2 field 'target' is a str"):
        countdown.convert_row({"nums": [1, 2], "target": "3"}, index=2, split="train", path="f.jsonl")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--train", "-1"], "argument --train: must be >= 1, got -1"),
        (["--val", "0"], "argument --val: must be >= 1, got 0"),  # refused before train.parquet is written
        (["--digits", "two"], "argument --digits: expected a whole number, got 'two'"),
    ],
)
def test_arithmetic_refuses_nonsensical_numbers(tmp_path, args, message):
    proc = run_tool("tools/data/arithmetic.py", "--out-dir", str(tmp_path / "o"), *args, check=False)
    assert one_error_line(proc, "arithmetic.py").endswith(message)
    assert not os.path.exists(tmp_path / "o")


def test_output_paths_that_cannot_be_written(tmp_path):
    a_file = tmp_path / "taken"
    a_file.write_text("mine")
    proc = run_tool("tools/data/arithmetic.py", "--out-dir", str(a_file), "--train", "5", "--val", "5", check=False)
    assert one_error_line(proc, "arithmetic.py").endswith(
        f"cannot write {a_file}/train.parquet: {a_file} is a file, not a folder"
    )
    assert a_file.read_text() == "mine"
    proc = run_tool("tools/data/countdown.py", "generate", "--out-dir", str(tmp_path / "c"), "--count", "0", check=False)
    assert one_error_line(proc, "countdown.py generate").endswith("argument --count: must be >= 1, got 0")


def test_converters_refuse_to_replace_their_input_or_read_a_folder(tmp_path):
    src = tmp_path / "gsm8k.jsonl"
    src.write_text(json.dumps(GSM8K_ROWS[0]) + "\n")
    before = src.read_bytes()
    proc = run_tool("tools/data/gsm8k.py", "--input", str(src), "--output", str(src), check=False)
    assert one_error_line(proc, "gsm8k.py").endswith(f"--output={src} is the input --input={src}; writing there would "
                                                     "replace or delete what it is made from: choose a --output elsewhere")
    assert src.read_bytes() == before
    folder = tmp_path / "folder"
    folder.mkdir()
    proc = run_tool("tools/data/gsm8k.py", "--input", str(folder), "--output", str(tmp_path / "o.parquet"),
                    check=False)
    assert one_error_line(proc, "gsm8k.py").endswith(f"input {folder} is not a file; give the data file to convert")
    proc = run_tool("tools/data/gsm8k.py", "--input", str(src), "--output", str(folder), check=False)
    assert one_error_line(proc, "gsm8k.py").endswith(f"{folder} is a directory; give the path of the parquet file "
                                                     "to write")
    proc = run_tool("tools/data/gsm8k.py", "--input", str(src), "--output", str(tmp_path), check=False)
    assert one_error_line(proc, "gsm8k.py").endswith(f"--output={tmp_path} contains the input --input={src}; writing "
                                                     "there would replace or delete what it is made from: choose a "
                                                     "--output elsewhere")


def test_make_tiny_model_refuses_a_folder_that_holds_something(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    proc = run_tool("tools/make_tiny_model.py", "--family", "llama", "--out", str(out), check=False)
    assert one_error_line(proc, "make_tiny_model.py").endswith(
        f"{out} already exists and is not empty; choose another folder or pass overwrite=True (--overwrite)"
    )
    assert os.listdir(out) == ["notes.txt"]
    proc = run_tool("tools/make_tiny_model.py", "--family", "llama", "--out", str(out / "notes.txt"), check=False)
    assert one_error_line(proc, "make_tiny_model.py").endswith("notes.txt is a file; give a folder for the model")
