"""``verl.utils.load_hf_dataset``: files of every format, a datasets.Dataset, splits, streaming,
the data-key remapping, and the records the trainer's prompt dataset reads."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from verl.utils import load_hf_dataset

ROWS = [{"question": f"{i} + 1 = ?", "answer": str(i + 1), "src": "verl/arithmetic"} for i in range(10)]


def _write(path, rows, fmt):
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=3)
    else:
        feather.write_feather(pa.Table.from_pylist(rows), path, compression="uncompressed")
    return str(path)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "arrow"])
@pytest.mark.parametrize("streaming", [False, True])
def test_every_format_remaps_to_prompt_records(tmp_path, fmt, streaming):
    path = _write(tmp_path / f"d.{fmt}", ROWS, fmt)
    data = load_hf_dataset(
        path, split="train[2:5]", streaming=streaming, prompt_key="question", reward_fn_key="src",
        ground_truth_key="answer",
    )
    assert data.kind == "prompts" and data.has_reward and len(data) == 3
    assert list(data) == [
        {"prompt": f"{i} + 1 = ?", "data_source": "verl/arithmetic",
         "reward_model": {"style": "rule", "ground_truth": str(i + 1)}, "extra_info": {"index": i}}
        for i in (2, 3, 4)
    ]


def test_percent_split_constant_source_and_a_datasets_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:2])})
    data = load_hf_dataset(dd, split="train[80%:]", prompt_key="question", ground_truth_key="answer",
                           data_source="openai/gsm8k")
    assert [r["extra_info"]["index"] for r in data] == [8, 9]
    assert {r["data_source"] for r in data} == {"openai/gsm8k"}
    with pytest.raises(ValueError, match=r"splits \['train', 'test'\]; pass split="):
        load_hf_dataset(dd, prompt_key="question", data_source="x")
    with pytest.raises(ValueError, match="no split 'val'"):
        load_hf_dataset(dd, split="val", prompt_key="question", data_source="x")


def test_written_parquet_is_what_the_trainer_dataset_reads(tmp_path, tiny_model_dir):
    from verl.data.rl_dataset import RLPromptDataset
    from verl.data.tokenizer import load_tokenizer

    path = _write(tmp_path / "d.jsonl", ROWS, "jsonl")
    out = load_hf_dataset(path, streaming=True, prompt_key="question", reward_fn_key="src",
                          ground_truth_key="answer").write_parquet(str(tmp_path / "out" / "train.parquet"))
    ds = RLPromptDataset(out, load_tokenizer(tiny_model_dir), max_prompt_length=32)
    assert len(ds) == 10
    item = ds[3]
    assert item["data_source"] == "verl/arithmetic" and item["reward_model"]["ground_truth"] == "4"


def test_preference_rows_and_bad_input(tmp_path):
    pref = _write(tmp_path / "p.jsonl", [{"prompt": "hi", "chosen": "a", "rejected": "b"}] * 3, "jsonl")
    data = load_hf_dataset(pref)
    assert data.kind == "preferences" and not data.has_reward
    assert list(data)[0] == {"prompt": "hi", "chosen": "a", "rejected": "b"}
    path = _write(tmp_path / "d.jsonl", ROWS, "jsonl")
    with pytest.raises(ValueError, match=r"no prompt column 'prompt' \(columns: \['question', 'answer', 'src'\]\); pass prompt_key="):
        load_hf_dataset(path)
    with pytest.raises(ValueError, match="no column 'data_source' naming each row's scorer.*data_source="):
        load_hf_dataset(path, prompt_key="question")
    with pytest.raises(ValueError, match="a file holds one split, 'train'"):
        load_hf_dataset(path, split="test", prompt_key="question", data_source="x")
    with pytest.raises(ValueError, match="is not a split name"):
        load_hf_dataset(path, split="train[::2]", prompt_key="question", data_source="x")
