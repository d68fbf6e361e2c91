"""Round trips through every supported file format, lazy reading, and bad files."""

from __future__ import annotations

import json
import os
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl.data.io import ArrowSource, FieldCheck, ParquetSource, TableStore, detect_format, open_source

ROWS = [
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"question {i}"}],
        "reward_model": {"style": "rule", "ground_truth": str(i)},
        "extra_info": {"index": i, "split": "train"},
    }
    for i in range(25)
]


def write(path: str, rows: list[dict], fmt: str, **kw) -> str:
    table = pa.Table.from_pylist(rows)
    if fmt == "parquet":
        pq.write_table(table, path, **kw)
    elif fmt == "arrow-file":
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
            for batch in table.to_batches(max_chunksize=7):
                w.write_batch(batch)
    elif fmt == "arrow-stream":
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
            for batch in table.to_batches(max_chunksize=7):
                w.write_batch(batch)
    elif fmt == "jsonl":
        with open(path, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
                f.write("\n")  # blank lines are skipped
    return path


@pytest.mark.parametrize(
    "fmt,name",
    [("parquet", "d.parquet"), ("arrow-file", "d.arrow"), ("arrow-stream", "d.arrow"), ("jsonl", "d.jsonl")],
)
def test_round_trip_every_format(tmp_path, fmt, name):
    path = write(str(tmp_path / name), ROWS, fmt, **({"row_group_size": 4} if fmt == "parquet" else {}))
    source = open_source(path)
    assert source.num_rows == len(ROWS)
    expected = ROWS
    actual = [source.row(i) for i in range(source.num_rows)]
    assert actual == expected
    # Reading in a scattered order hits different row groups / batches / offsets.
    for i in (24, 0, 13, 3, 24):
        assert source.row(i) == ROWS[i]
    values = [v for batch in source.iter_column("reward_model", batch_rows=6) for v in batch]
    assert values == [r["reward_model"] for r in ROWS]


def test_hf_datasets_arrow_and_parquet(tmp_path):
    """Files written by Hugging Face ``datasets`` (someone else's writer) read unchanged."""
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(ROWS)
    ds.to_parquet(str(tmp_path / "hf.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    arrow_files = sorted(f for f in os.listdir(tmp_path / "saved") if f.endswith(".arrow"))
    assert arrow_files, os.listdir(tmp_path / "saved")
    store = TableStore([str(tmp_path / "hf.parquet")] + [str(tmp_path / "saved" / f) for f in arrow_files])
    assert len(store) == 2 * len(ROWS)
    assert [store.row(i) for i in range(len(store))] == ROWS + ROWS


def test_files_concatenate_and_columns_project(tmp_path):
    a = write(str(tmp_path / "a.parquet"), ROWS[:10], "parquet")
    b = write(str(tmp_path / "b.jsonl"), ROWS[10:], "jsonl")
    store = TableStore([a, b], columns=["prompt", "data_source"])
    assert len(store) == len(ROWS)
    source, j = store.locate(12)
    assert source.path == b and j == 2
    expected = {"prompt": ROWS[12]["prompt"], "data_source": "openai/gsm8k"}
    assert store.row(12) == expected
    assert set(store.row(3)) == {"prompt", "data_source"}


def test_parquet_cache_is_bounded(tmp_path):
    path = write(str(tmp_path / "d.parquet"), ROWS, "parquet", row_group_size=2)
    group_bytes = pq.ParquetFile(path).read_row_group(0).nbytes
    source = ParquetSource(path, cache_bytes=2 * group_bytes)
    for i in range(len(ROWS)):
        assert source.row(i) == ROWS[i]
        # Within budget, unless a single (larger) group is all that is kept.
        assert source._h_cached_bytes <= 2 * group_bytes or len(source._h_cache) == 1
    tiny = ParquetSource(path, cache_bytes=0)  # still keeps the group being read
    assert [tiny.row(i) for i in (5, 0, 24)] == [ROWS[5], ROWS[0], ROWS[24]] and len(tiny._h_cache) == 1


def test_arrow_is_memory_mapped_not_copied(tmp_path):
    rows = [{"prompt": "x" * 1000, "data_source": str(i)} for i in range(4000)]  # ~4 MB of text
    path = write(str(tmp_path / "big.arrow"), rows, "arrow-stream")
    before = pa.total_allocated_bytes()
    source = ArrowSource(path)
    assert source.row(3999) == rows[3999]
    # Buffers point into the mapped file: Arrow's heap grows by far less than the file size.
    grown = pa.total_allocated_bytes() - before
    assert grown < os.path.getsize(path) // 10, (grown, os.path.getsize(path))


def test_corrupt_and_truncated_files_name_the_file(tmp_path):
    good = write(str(tmp_path / "good.parquet"), ROWS, "parquet")
    data = open(good, "rb").read()
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated.parquet"):
        open_source(str(truncated))
    garbage = tmp_path / "garbage.arrow"
    garbage.write_bytes(b"not arrow at all" * 10)
    with pytest.raises(ValueError, match="garbage.arrow"):
        open_source(str(garbage))
    empty = tmp_path / "empty.parquet"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.parquet.*empty"):
        open_source(str(empty))
    with pytest.raises(ValueError, match="missing.parquet does not exist"):
        open_source(str(tmp_path / "missing.parquet"))


def test_bad_jsonl_and_unknown_extension(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\n{"a": \n')
    source = open_source(str(bad))
    with pytest.raises(ValueError, match=r"bad.jsonl: record 1 is not valid JSON"):
        source.row(1)
    array = tmp_path / "array.json"
    array.write_text('[{"a": 1}]')
    with pytest.raises(ValueError, match="JSON array"):
        open_source(str(array))
    with pytest.raises(ValueError, match="extension '.csv'"):
        detect_format("data.csv")


def test_home_directory_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    write(str(tmp_path / "d.jsonl"), ROWS[:2], "jsonl")
    assert len(TableStore("~/d.jsonl")) == 2


def test_missing_column_names_file_and_field(tmp_path):
    path = write(str(tmp_path / "d.parquet"), [{"question": "q", "data_source": "x"}], "parquet")
    store = TableStore(path)
    with pytest.raises(ValueError, match=r"d.parquet: every row lacks the field 'prompt'"):
        store.require_columns(["prompt"])


FORMATS = [("parquet", "d.parquet"), ("arrow-file", "d.arrow"), ("jsonl", "d.jsonl")]


def sft_rows(n: int = 9) -> list[dict]:
    return [
        {
            "prompt": [{"role": "user", "content": f"what is {i}?"}],
            "response": f"it is {i}",
            "extra_info": {"answer": f"Answer: {i}", "index": i},
        }
        for i in range(n)
    ]


def _with(row: int, **fields) -> list[dict]:
    rows = sft_rows()
    rows[row].update(fields)
    return rows


SFT_CHECKS = [FieldCheck("prompt", ("string", "messages")), FieldCheck("response", ("string",))]
ANSWER_CHECK = [FieldCheck("extra_info.answer", ("string",))]


@pytest.mark.parametrize(("fmt", "name"), FORMATS)
@pytest.mark.parametrize(
    ("rows", "checks", "pattern"),
    [
        # a null extra_info under response_key=extra_info.answer (the case)
        (_with(5, extra_info=None), ANSWER_CHECK,
         r"row 5: field 'extra_info' is null \(needed for 'extra_info\.answer'\)"),
        (_with(6, extra_info={"answer": None, "index": 6}), ANSWER_CHECK, r"row 6: field 'extra_info\.answer' is null"),
        (_with(3, response=None), SFT_CHECKS, r"row 3: field 'response' is null"),
        (_with(4, prompt=[]), SFT_CHECKS, r"row 4: field 'prompt': a chat prompt must be a non-empty list"),
        (_with(8, prompt=[{"role": "user", "content": None}]), SFT_CHECKS,
         r"row 8: field 'prompt': message 0 \(user\) has non-string content"),
    ],
)
def test_bad_rows_are_found_at_load_naming_file_row_and_field(tmp_path, fmt, name, rows, checks, pattern):
    path = write(str(tmp_path / name), rows, fmt, **({"row_group_size": 4} if fmt == "parquet" else {}))
    store = TableStore(path)
    with pytest.raises(ValueError, match=re.escape(path) + ": " + pattern):
        store.check_fields(checks, batch_rows=2)  # small batches: row numbers must count across them
    good = write(str(tmp_path / ("good-" + name)), sft_rows(), fmt)
    TableStore(good).check_fields(SFT_CHECKS + ANSWER_CHECK, batch_rows=2)


def test_mixed_types_in_jsonl(tmp_path):
    # Only jsonl can mix types in one column; parquet and arrow columns have one type.
    path = tmp_path / "d.jsonl"
    rows = sft_rows()
    rows[7]["response"] = ["it", "is"]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"d\.jsonl: row 7: field 'response' is a list \(\['it', 'is'\]\), expected a string"):
        TableStore(str(path)).check_fields(SFT_CHECKS)


@pytest.mark.parametrize(("fmt", "name"), FORMATS)
def test_a_column_of_the_wrong_type_is_refused_at_its_first_row(tmp_path, fmt, name):
    rows = [{"prompt": "p", "response": i} for i in range(5)]
    path = write(str(tmp_path / name), rows, fmt)
    with pytest.raises(ValueError, match=r"row 0: field 'response' is a number \(0\), expected a string"):
        TableStore(path).check_fields(SFT_CHECKS)


@pytest.mark.parametrize(("fmt", "name"), FORMATS)
def test_nullable_object_columns(tmp_path, fmt, name):
    rows = [{"prompt": "p", "extra_info": {"a": 1} if i != 2 else None} for i in range(4)]
    path = write(str(tmp_path / name), rows, fmt)
    checks = [FieldCheck("extra_info", ("dict",), nullable=True), FieldCheck("reward_model", ("dict",), nullable=True)]
    TableStore(path).check_fields(checks)  # a null row and a missing column are fine
    rows = [{"prompt": "p", "extra_info": "split=train"} for _ in range(3)]
    path = write(str(tmp_path / ("s-" + name)), rows, fmt)
    with pytest.raises(ValueError, match=r"row 0: field 'extra_info' is a string \('split=train'\), expected an object"):
        TableStore(path).check_fields(checks)


def test_struct_without_the_nested_field(tmp_path):
    rows = [{"prompt": "p", "extra_info": {"index": i}} for i in range(3)]
    path = write(str(tmp_path / "d.parquet"), rows, "parquet")
    with pytest.raises(ValueError, match=r"row 0: field 'extra_info' has no 'answer' \(keys: \['index'\]"):
        TableStore(path).check_fields(ANSWER_CHECK)


def test_a_directory_given_as_a_data_file(tmp_path):
    write(str(tmp_path / "train.parquet"), sft_rows(), "parquet")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path} is a directory, not a data file; give the data files "
                                                   f"in it ({tmp_path}/train.parquet)")):
        TableStore(str(tmp_path))


def chats(n: int = 7) -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(n)
    ]


@pytest.mark.parametrize(("fmt", "name"), FORMATS)
@pytest.mark.parametrize(
    ("row", "messages", "pattern"),
    [
        (4, [{"role": "user", "content": "q"}], r"row 4: field 'messages': the conversation has no assistant turn"),
        (5, [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}],
         r"row 5: field 'messages': the conversation starts with an assistant turn"),
        (6, [], r"row 6: field 'messages': a chat prompt must be a non-empty list"),
    ],
)
def test_conversations_are_checked_at_load(tmp_path, fmt, name, row, messages, pattern):
    rows = chats()
    rows[row]["messages"] = messages
    path = write(str(tmp_path / name), rows, fmt)
    with pytest.raises(ValueError, match=re.escape(path) + ": " + pattern):
        TableStore(path).check_fields([FieldCheck("messages", ("conversation",))], batch_rows=3)
    TableStore(write(str(tmp_path / ("good-" + name)), chats(), fmt)).check_fields(
        [FieldCheck("messages", ("conversation",))], batch_rows=3
    )


def test_select_keeps_rows_and_their_origin(tmp_path):
    a = write(str(tmp_path / "a.parquet"), ROWS[:10], "parquet", row_group_size=3)
    b = write(str(tmp_path / "b.jsonl"), ROWS[10:], "jsonl")
    store = TableStore([a, b])
    picked = store.select([1, 4, 9, 10, 17, 24])
    assert len(picked) == 6 and len(store) == len(ROWS)  # the original is untouched
    assert [picked.row(i) for i in range(6)] == [ROWS[j] for j in (1, 4, 9, 10, 17, 24)]
    assert [picked.origin(i) for i in range(6)] == [1, 4, 9, 10, 17, 24]
    assert picked.locate(4) == (picked.sources[1], 7)
    again = picked.select([0, 3, 5])  # composes: rows of the selection
    assert [again.origin(i) for i in range(3)] == [1, 10, 24]
    seen = [(s.path, rows.tolist(), values) for s, rows, values in again.iter_column("extra_info", batch_rows=4)]
    assert seen == [(a, [1], [ROWS[1]["extra_info"]]), (b, [0], [ROWS[10]["extra_info"]]),
                    (b, [14], [ROWS[24]["extra_info"]])]
    for bad in ([3, 1], [0, 0], [-1], [6]):
        with pytest.raises(ValueError, match=r"TableStore.select needs increasing row indices in \[0, 6\)"):
            picked.select(bad)
    with pytest.raises(IndexError, match=r"row 3 out of range \[0, 3\)"):
        again.row(3)


def test_frames_in_memory_join_a_store(tmp_path):
    """A pyarrow Table and a datasets.Dataset (also one with an indices mapping) read as files do."""
    from verl.data.io import FrameSource

    table = pa.Table.from_pylist(ROWS[:8])
    sources = [FrameSource(table, "table", columns=["prompt", "extra_info"])]
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(ROWS[8:])
    sources += [FrameSource(ds, "ds"), FrameSource(ds.select([3, 0, 5]), "picked")]
    store = TableStore(sources)
    assert len(store) == 8 + 17 + 3
    assert store.row(2) == {"prompt": ROWS[2]["prompt"], "extra_info": ROWS[2]["extra_info"]}
    assert [store.row(i) for i in range(8, 25)] == ROWS[8:]
    assert [store.row(i) for i in (25, 26, 27)] == [ROWS[11], ROWS[8], ROWS[13]]
    store.check_fields([FieldCheck("prompt", ("messages",)), FieldCheck("extra_info", ("dict",))])
    with pytest.raises(ValueError, match=r"^ds: every row lacks the field 'answer'"):
        TableStore(sources[1]).check_fields([FieldCheck("answer")])
    with pytest.raises(TypeError, match="a pyarrow Table or datasets.Dataset is needed, got list"):
        FrameSource(ROWS, "rows")
