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
    if mode == "error":  # refused at load, naming the row (not when a batch draws it)
        with pytest.raises(
            ValueError, match=rf"1 of 1 prompts are longer than data.max_prompt_length={limit} tokens and "
            rf"data.truncation=error: \S+d.parquet: row 0 \({len(full)} tokens\)"
        ):
            RLPromptDataset(path, tokenizer, max_prompt_length=limit, truncation=mode, apply_chat_template=False)
        return
    ds = RLPromptDataset(path, tokenizer, max_prompt_length=limit, truncation=mode, apply_chat_template=False)
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


# ------------------------------------------------------------------------------------------
# The reference verl's extension point: RLHFDataset subclasses named by data.custom_cls

TUTORIAL_DATASET = '''
import datasets

from verl.utils.dataset import RLHFDataset


class ArrowRLHFDataset(RLHFDataset):
    """Reads the data set's arrow files with Hugging Face datasets."""

    def _read_files_and_tokenize(self):
        self.dataframe = datasets.load_dataset("arrow", data_files=self.data_files)["train"]
        self.dataframe = self.maybe_filter_out_long_prompts(self.dataframe)


class BareFilterCall(RLHFDataset):
    """The same, with the filter called for its effect only."""

    def _read_files_and_tokenize(self):
        self.dataframe = datasets.load_dataset("arrow", data_files=self.data_files)["train"]
        self.maybe_filter_out_long_prompts(self.dataframe)
'''


def _arrow_dataset_files(datasets, tmp_path, rows) -> list[str]:
    """A multi-file arrow data set as Hugging Face datasets writes it (save_to_disk, 3 shards)."""
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"), num_shards=3)
    files = sorted(str(p) for p in (tmp_path / "saved").glob("*.arrow"))
    assert len(files) == 3, files
    return files


def test_tutorial_custom_class_feeds_the_rl_dataloader(tmp_path, tokenizer, monkeypatch):
    """The tutorial's RLHFDataset subclass, in a user's file, loads a multi-file arrow data set
    with datasets, is built by the factory from data.custom_cls and feeds StatefulDataLoader;
    its items equal the built-in dataset's over the same files (same filter, same order)."""
    datasets = pytest.importorskip("datasets")
    schema = pytest.importorskip("verl.config.schema")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    rows = [record(i, n_words=3 if i % 4 else 40) for i in range(16)]  # rows 0, 4, 8, 12 are long
    files = _arrow_dataset_files(datasets, tmp_path, rows)
    user_file = tmp_path / "my_dataset.py"
    user_file.write_text(TUTORIAL_DATASET)
    cfg = schema.DataConfig(
        train_files=files, val_files=None, max_prompt_length=32, filter_overlong_prompts=True,
        train_batch_size=4, seed=5,
        custom_cls=schema.CustomClassConfig(path=str(user_file), name="ArrowRLHFDataset"),
    )

    ds = create_rl_dataset(cfg, tokenizer, cfg.train_files)
    from verl.data import StatefulDataLoader
    from verl.utils.dataset import RLHFDataset

    assert type(ds).__name__ == "ArrowRLHFDataset" and isinstance(ds, RLHFDataset)
    assert isinstance(ds.dataframe, datasets.Dataset) and len(ds.dataframe) == 12 and len(ds) == 12
    assert ds.data_files == files and ds.config is cfg

    builtin = RLPromptDataset(files, tokenizer, max_prompt_length=32, filter_overlong_prompts=True)
    expected = [builtin[i]["raw_prompt_ids"] for i in range(len(builtin))]
    actual = [ds[i]["raw_prompt_ids"] for i in range(len(ds))]
    assert actual == expected
    assert [ds[i]["extra_info"]["index"] for i in range(len(ds))] == [i for i in range(16) if i % 4]

    loader = build_dataloader(ds, cfg, train=True)
    assert isinstance(loader, StatefulDataLoader) and len(loader) == 3
    batches = list(loader)
    assert [b["input_ids"].shape for b in batches] == [(4, 32)] * 3
    assert sorted(np.concatenate([b["index"].astype(np.int64) for b in batches]).tolist()) == list(range(12))
    assert set(np.concatenate([b["data_source"] for b in batches]).tolist()) == {"verl/arithmetic"}

    # Forked DataLoader workers and checkpointing get a copy that reads the same rows.
    import pickle

    clone = pickle.loads(pickle.dumps(ds))
    assert [clone[i]["raw_prompt_ids"] for i in range(len(clone))] == expected

    cfg.custom_cls.name = "BareFilterCall"
    bare = create_rl_dataset(cfg, tokenizer, cfg.train_files)
    assert len(bare) == 12 and len(bare.dataframe) == 12


def test_rlhf_dataset_accepts_a_pyarrow_table_or_table_store(tmp_path, tokenizer):
    path = to_parquet(tmp_path / "d.parquet", [record(i, n_words=3 if i % 2 else 40) for i in range(6)])
    module = tmp_path / "frames.py"
    module.write_text(textwrap.dedent("""
        import pyarrow.parquet as pq

        from verl.data import TableStore
        from verl.utils.dataset.rl_dataset import RLHFDataset

        class FromTable(RLHFDataset):
            def _read_files_and_tokenize(self):
                self.dataframe = pq.read_table(self.data_files[0])
                self.dataframe = self.maybe_filter_out_long_prompts(self.dataframe)

        class FromStore(RLHFDataset):
            def _read_files_and_tokenize(self):
                self.dataframe = TableStore(self.data_files)
                self.maybe_filter_out_long_prompts()

        class NoFrame(RLHFDataset):
            def _read_files_and_tokenize(self):
                pass

        class Splits(RLHFDataset):
            def _read_files_and_tokenize(self):
                self.dataframe = {"train": None}
    """))
    cfg = SimpleNamespace(
        prompt_key="prompt", reward_fn_key="data_source", max_prompt_length=32, truncation="error",
        filter_overlong_prompts=True, apply_chat_template=True, return_raw_chat=False,
        custom_cls=SimpleNamespace(path=str(module), name="FromTable"),
    )
    expected = [RLPromptDataset(path, tokenizer, max_prompt_length=32, truncation="right")[i]["raw_prompt_ids"]
                for i in (1, 3, 5)]
    table = create_rl_dataset(cfg, tokenizer, [path])
    assert isinstance(table.dataframe, pa.Table) and table.dataframe.num_rows == 3
    assert [table[i]["raw_prompt_ids"] for i in range(3)] == expected
    assert [table[i]["index"] for i in range(3)] == [0, 1, 2]  # rows of self.dataframe as set
    cfg.custom_cls.name = "FromStore"
    store = create_rl_dataset(cfg, tokenizer, [path])
    assert [store[i]["raw_prompt_ids"] for i in range(3)] == expected
    assert [store[i]["index"] for i in range(3)] == [1, 3, 5]  # rows of the files
    cfg.custom_cls.name = "NoFrame"
    with pytest.raises(ValueError, match=r"^NoFrame._read_files_and_tokenize did not set self.dataframe; set it"):
        create_rl_dataset(cfg, tokenizer, [path])
    cfg.custom_cls.name = "Splits"
    with pytest.raises(ValueError, match=r"set self.dataframe to a dict; set it to a datasets.Dataset"):
        create_rl_dataset(cfg, tokenizer, [path])
    with pytest.raises(ValueError, match="processor of type object has no image_processor and tokenizer"):
        table.__class__([path], tokenizer, cfg, processor=object())


def test_custom_dataset_rows_are_checked_at_load(tmp_path, tokenizer):
    """A user's dataframe gets the built-in checks, its rows named by the class."""
    rows = [record(0), record(1)]
    rows[1]["data_source"] = None
    path = to_parquet(tmp_path / "d.parquet", rows)
    module = tmp_path / "mine.py"
    module.write_text(textwrap.dedent("""
        import pyarrow.parquet as pq
        from verl.utils.dataset import RLHFDataset

        class Mine(RLHFDataset):
            def _read_files_and_tokenize(self):
                self.dataframe = pq.read_table(self.data_files)
    """))
    schema = pytest.importorskip("verl.config.schema")
    cfg = schema.DataConfig(custom_cls=schema.CustomClassConfig(path=str(module), name="Mine"))
    with pytest.raises(ValueError, match=r"^Mine.dataframe: row 1: field 'data_source' is null; fix the file"):
        create_rl_dataset(cfg, tokenizer, [path])


def test_custom_cls_bad_input_is_one_line_naming_key_and_fix(tmp_path, tokenizer):
    module = tmp_path / "user_data.py"
    module.write_text(textwrap.dedent("""
        class NotADataset:
            pass
    """))
    cfg = SimpleNamespace(custom_cls=SimpleNamespace(path=str(tmp_path / "missing.py"), name="X"))
    cases = [
        ("missing.py", "X", r"data.custom_cls.path='.*missing.py' is not a Python file; point it at the .py file"),
        ("user_data.py", "Nope", r"data.custom_cls.name='Nope' is not defined in .*user_data.py \(classes there: "
                                 r"\['NotADataset'\]\); set it to your dataset class's name"),
        ("user_data.py", "NotADataset", r"data.custom_cls 'NotADataset' from .*user_data.py must be a subclass of "
                                        r"torch.utils.data.Dataset, got .*; subclass verl.utils.dataset.RLHFDataset"),
        ("user_data.py", None, r"data.custom_cls.name is not set; set it to the dataset class defined in"),
    ]
    for file, name, message in cases:
        cfg.custom_cls.path, cfg.custom_cls.name = str(tmp_path / file), name
        with pytest.raises(ValueError, match=message) as info:
            create_rl_dataset(cfg, tokenizer, ["f.parquet"])
        assert "\n" not in str(info.value), str(info.value)
