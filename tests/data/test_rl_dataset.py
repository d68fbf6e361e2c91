"""RLPromptDataset: templating, padding, remapped keys, truncation, filtering, bad input."""

from __future__ import annotations

import json
import logging
import os
import textwrap
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from verl.data import RLPromptDataset, build_dataloader, collate_fn, create_rl_dataset


def record(i: int, n_words: int = 3) -> dict:
    return {
        "data_source": "verl/arithmetic",
        "prompt": [{"role": "user", "content": " ".join(["word"] * n_words) + f" {i}"}],
        "reward_model": {"style": "rule", "ground_truth": str(i)},
        "extra_info": {"index": i},
    }


def to_parquet(path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def test_item_is_left_padded_chat_templated(tmp_path, tokenizer):
    path = to_parquet(tmp_path / "d.parquet", [record(i) for i in range(4)])
    ds = RLPromptDataset(path, tokenizer, max_prompt_length=48, return_raw_chat=True)
    item = ds[2]
    text = tokenizer.apply_chat_template(record(2)["prompt"], add_generation_prompt=True, tokenize=False)
    expected = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert item["raw_prompt_ids"] == expected
    n = len(expected)
    assert item["input_ids"].shape == (48,)
    assert item["input_ids"][-n:].tolist() == expected
    assert (item["input_ids"][:-n] == tokenizer.pad_token_id).all()
    assert item["attention_mask"].tolist() == [0] * (48 - n) + [1] * n
    assert item["position_ids"].tolist() == [0] * (48 - n) + list(range(n))
    assert item["data_source"] == "verl/arithmetic"
    assert item["reward_model"] == {"style": "rule", "ground_truth": "2"}
    assert item["extra_info"] == {"index": 2}
    assert item["raw_prompt"] == record(2)["prompt"]
    assert item["index"] == 2


def test_plain_string_prompts_without_template(tmp_path, tokenizer):
    rows = [{"data_source": "x", "prompt": "What is 1+2?"}]
    path = to_parquet(tmp_path / "d.parquet", rows)
    expected = tokenizer("What is 1+2?")["input_ids"]  # with the tokenizer's own special tokens
    for ds in (
        RLPromptDataset(path, tokenizer, max_prompt_length=32, apply_chat_template=False),
        RLPromptDataset(path, _without_template(tokenizer), max_prompt_length=32),
    ):
        assert ds[0]["raw_prompt_ids"] == expected
        assert ds[0]["reward_model"] == {} and ds[0]["extra_info"] == {}


def _without_template(tokenizer):
    tokenizer.chat_template = None
    return tokenizer


def test_remapped_field_names(tmp_path, tokenizer):
    rows = [{"question": f"q {i}", "source": "openai/gsm8k", "meta": {"answer": str(i)}} for i in range(3)]
    path = to_parquet(tmp_path / "d.parquet", rows)
    ds = RLPromptDataset(
        path,
        tokenizer,
        max_prompt_length=32,
        prompt_key="question",
        reward_fn_key="source",
        extra_keys=("meta.answer",),
    )
    item = ds[1]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "q 1"}], add_generation_prompt=True, tokenize=False
    )
    assert item["raw_prompt_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert item["data_source"] == "openai/gsm8k"
    assert item["meta.answer"] == "1"
    with pytest.raises(ValueError, match=r"d.parquet: every row lacks the field 'prompt'"):
        RLPromptDataset(path, tokenizer, max_prompt_length=32, reward_fn_key="source")


@pytest.mark.parametrize("mode", ["left", "right", "middle", "error"])
def test_truncation_modes(tmp_path, tokenizer, mode):
    path = to_parquet(
        tmp_path / "d.parquet", [{"data_source": "x", "prompt": "one two three four five six seven"}]
    )
    full = tokenizer("one two three four five six seven")["input_ids"]
    limit = len(full) - 3
    ds = RLPromptDataset(path, tokenizer, max_prompt_length=limit, truncation=mode, apply_chat_template=False)
    if mode == "error":
        with pytest.raises(
            ValueError, match=rf"d.parquet: row 0: {len(full)} tokens exceed the limit of {limit}"
        ):
            ds[0]
        return
    expected = {
        "left": full[-limit:],
        "right": full[:limit],
        "middle": full[: limit // 2] + full[len(full) - (limit - limit // 2) :],
    }[mode]
    actual = ds[0]["raw_prompt_ids"]
    assert actual == expected
    assert ds[0]["input_ids"].tolist() == expected  # exactly full: no padding
    assert ds.num_truncated == 2


def test_filter_overlong_logs_count_and_empty_is_an_error(tmp_path, tokenizer, caplog):
    rows = [record(i, n_words=3 if i % 3 else 40) for i in range(9)]  # rows 0, 3, 6 are long
    a = to_parquet(tmp_path / "a.parquet", rows[:5])
    b = to_parquet(tmp_path / "b.parquet", rows[5:])
    with caplog.at_level(logging.INFO, logger="verl.data.rl_dataset"):
        ds = RLPromptDataset([a, b], tokenizer, max_prompt_length=32, filter_overlong_prompts=True)
    assert len(ds) == 6
    assert [ds[i]["index"] for i in range(6)] == [1, 2, 4, 5, 7, 8]
    assert "dropped 3 of 9 prompts longer than 32 tokens (a.parquet: 2, b.parquet: 1)" in caplog.text
    with pytest.raises(
        ValueError, match=r"all 9 rows were dropped by filter_overlong_prompts.*max_prompt_length=4"
    ):
        RLPromptDataset([a, b], tokenizer, max_prompt_length=4, filter_overlong_prompts=True)


def test_bad_rows_name_file_row_and_field(tmp_path, tokenizer):
    rows = [record(0), record(1)]
    rows[1]["prompt"] = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    path = str(tmp_path / "d.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    # Found when the dataset is built, not when the batch holding row 1 is drawn.
    for filter_overlong in (False, True):
        with pytest.raises(
            ValueError, match=r"d.jsonl: row 1: field 'prompt': message 0 \(user\) has non-string content of type list"
        ):
            RLPromptDataset(path, tokenizer, max_prompt_length=32, filter_overlong_prompts=filter_overlong)
    missing = tmp_path / "m.jsonl"
    missing.write_text('{"prompt": "a", "data_source": "x"}\n{"prompt": null, "data_source": "x"}\n')
    with pytest.raises(ValueError, match=r"m.jsonl: row 1: field 'prompt' is null; fix the file"):
        RLPromptDataset(str(missing), tokenizer, max_prompt_length=32)


def test_tokenizer_without_pad_gets_one(tmp_path, tokenizer, caplog):
    path = to_parquet(tmp_path / "d.parquet", [record(0)])
    tokenizer.pad_token = None
    assert tokenizer.pad_token_id is None
    with caplog.at_level(logging.INFO, logger="verl.data.tokenizer"):
        ds = RLPromptDataset(path, tokenizer, max_prompt_length=32)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    assert "has no pad token; using its eos token" in caplog.text
    assert ds[0]["input_ids"][0].item() == tokenizer.eos_token_id


def test_collate_and_config_loader(tmp_path, tokenizer):
    path = to_parquet(tmp_path / "d.parquet", [record(i) for i in range(10)])
    cfg = SimpleNamespace(
        prompt_key="prompt",
        reward_fn_key="data_source",
        max_prompt_length=24,
        truncation="error",
        filter_overlong_prompts=False,
        apply_chat_template=True,
        return_raw_chat=False,
        custom_cls=SimpleNamespace(path=None, name=None),
        train_batch_size=4,
        val_batch_size=None,
        shuffle=True,
        seed=3,
        dataloader_num_workers=0,
    )
    ds = create_rl_dataset(cfg, tokenizer, [path])
    assert isinstance(ds, RLPromptDataset) and ds.max_prompt_length == 24
    batch = next(iter(build_dataloader(ds, cfg, train=True)))
    assert batch["input_ids"].shape == (4, 24) and batch["input_ids"].dtype == torch.long
    assert batch["reward_model"].dtype == object and batch["reward_model"].shape == (4,)
    assert isinstance(batch["raw_prompt_ids"][0], list)
    val = list(build_dataloader(ds, cfg, train=False))
    assert len(val) == 1 and val[0]["index"].tolist() == list(range(10))
    assert collate_fn([ds[0], ds[1]])["extra_info"].tolist() == [{"index": 0}, {"index": 1}]
    with pytest.raises(ValueError, match="has no field 'max_prompt_length'"):
        RLPromptDataset.from_config(SimpleNamespace(prompt_key="prompt"), tokenizer, path)


def test_custom_dataset_class(tmp_path, tokenizer):
    module = tmp_path / "my_data.py"
    module.write_text(
        textwrap.dedent("""
        from torch.utils.data import Dataset

        class Good(Dataset):
            def __init__(self, data_files, tokenizer, config):
                self.files = data_files
            def __len__(self):
                return 1
            def __getitem__(self, i):
                return {"x": i}

        class NotADataset:
            def __init__(self, **kw):
                pass
    """)
    )
    cfg = SimpleNamespace(custom_cls=SimpleNamespace(path=str(module), name="Good"))
    ds = create_rl_dataset(cfg, tokenizer, ["f.parquet"])
    assert type(ds).__name__ == "Good" and ds.files == ["f.parquet"]
    cfg.custom_cls.name = "NotADataset"
    with pytest.raises(ValueError, match="must be a subclass of torch.utils.data.Dataset"):
        create_rl_dataset(cfg, tokenizer, ["f.parquet"])
    cfg.custom_cls.name = "Missing"
    with pytest.raises(ValueError, match="'Missing' is not defined in"):
        create_rl_dataset(cfg, tokenizer, ["f.parquet"])
    cfg.custom_cls.path = os.path.join(str(tmp_path), "nope.py")
    with pytest.raises(ValueError, match="is not a Python file"):
        create_rl_dataset(cfg, tokenizer, ["f.parquet"])


def test_loader_with_worker_processes(tmp_path, tokenizer):
    path = to_parquet(tmp_path / "d.parquet", [record(i) for i in range(8)])
    ds = RLPromptDataset(path, tokenizer, max_prompt_length=24)
    from verl.data import StatefulDataLoader

    loader = StatefulDataLoader(ds, batch_size=4, shuffle=True, seed=0, num_workers=2, collate_fn=collate_fn)
    seen = np.concatenate([b["index"].astype(np.int64) for b in loader])
    assert sorted(seen.tolist()) == list(range(8))


def test_real_data_config_section(tmp_path, tokenizer):
    """The trainer's ``data`` dataclass drives the dataset and loader without adaptation."""
    schema = pytest.importorskip("verl.config.schema")
    path = to_parquet(tmp_path / "d.parquet", [record(i) for i in range(6)])
    cfg = schema.DataConfig(
        train_files=path, val_files=path, max_prompt_length=24, train_batch_size=2, seed=7
    )
    ds = create_rl_dataset(cfg, tokenizer, cfg.train_files)
    loader = build_dataloader(ds, cfg, train=True)
    assert len(loader) == 3 and next(iter(loader))["input_ids"].shape == (2, 24)


def test_dataset_pickles_for_spawned_workers(tmp_path, tokenizer):
    """Open file handles are dropped when pickled and reopened on first use."""
    import pickle

    a = to_parquet(tmp_path / "a.parquet", [record(i) for i in range(3)])
    b = tmp_path / "b.jsonl"
    b.write_text(json.dumps(record(3)) + "\n")
    ds = RLPromptDataset([a, str(b)], tokenizer, max_prompt_length=24)
    expected = [ds[i]["raw_prompt_ids"] for i in range(4)]
    clone = pickle.loads(pickle.dumps(ds))
    actual = [clone[i]["raw_prompt_ids"] for i in range(4)]
    assert actual == expected
