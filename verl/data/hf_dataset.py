"""``load_hf_dataset``: prompt or preference data from files or a ``datasets.Dataset``, in the
trainer's record format (``verl.utils.load_hf_dataset``; ``verl.RLTrainer.fit(dataset=...)``).

A prompt record, as ``python -m verl.trainer.main_ppo`` reads one (``verl.data.rl_dataset``)::

    {"prompt": <text or chat messages>, "data_source": <scorer name>,
     "reward_model": {"style": "rule", "ground_truth": <text>}, "extra_info": {"index": <row>}}

A preference record (DPO): ``{"prompt", "chosen", "rejected"}``. The remapping takes the config's
data key names: ``prompt_key`` (``data.prompt_key``), ``reward_fn_key`` (``data.reward_fn_key``),
and ``ground_truth_key`` (``reward_model.ground_truth`` where the trainer reads it); dotted keys
reach into nested fields (``"reward_model.ground_truth"``).

Rows are read in batches (parquet row groups, arrow record batches, jsonl lines), so
``streaming=True`` never holds the whole file; :meth:`RecordData.write_parquet` writes the
remapped rows batch by batch, which is what ``fit(dataset=...)`` hands the trainer. A JSON
file that is one array (not JSON lines) is read whole.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from verl.data.io import detect_format, open_source, split_key

__all__ = ["RecordData", "load_hf_dataset"]

_BATCH_ROWS = 1024
_SPLIT = re.compile(r"^(?P<name>[A-Za-z0-9_.-]*)(\[(?P<lo>-?\d+%?)?:(?P<hi>-?\d+%?)?\])?$")
PREFERENCE_COLUMNS = ("chosen", "rejected")


def _hf(name: str) -> Any:
    module = sys.modules.get("datasets")
    return getattr(module, name, None) if module is not None else None


def _is_instance(obj: Any, name: str) -> bool:
    cls = _hf(name)
    return cls is not None and isinstance(obj, cls)


def _bound(text: str | None, n: int | None, default: int, where: str) -> int:
    if text is None:
        return default
    if text.endswith("%"):
        if n is None:
            raise ValueError(f"{where}: a percent slice needs the row count, which a streamed dataset has not")
        value = round(n * int(text[:-1]) / 100)
    else:
        value = int(text)
    if value < 0:
        if n is None:
            raise ValueError(f"{where}: a negative slice bound needs the row count, which a streamed dataset has not")
        value += n
    return max(0, value if n is None else min(value, n))


def parse_split(split: str) -> tuple[str, str | None, str | None]:
    """``"train[:90%]"`` -> ("train", None, "90%"): the split name and the slice bounds as written."""
    m = _SPLIT.match(split.strip())
    if m is None:
        raise ValueError(
            f"split={split!r} is not a split name with an optional slice; write e.g. 'train', "
            "'train[:1000]' or 'test[90%:]'"
        )
    return m.group("name"), m.group("lo"), m.group("hi")


class _Table:
    """One input: a file, a JSON array file, or a datasets (Iterable)Dataset; yields column batches."""

    def __init__(self, obj: Any, label: str) -> None:
        self.obj, self.label = obj, label
        self.source = None
        if isinstance(obj, str):
            if obj.lower().endswith(".json") and _is_json_array(obj):
                with open(obj, encoding="utf-8") as f:
                    rows = json.load(f)
                if not all(isinstance(r, dict) for r in rows):
                    raise ValueError(f"{obj}: a JSON array of objects (one per row) is needed")
                self.obj = pa.Table.from_pylist(rows) if rows else pa.table({})
            else:
                detect_format(obj)  # an unknown extension fails naming the formats
                self.source = open_source(obj)

    @property
    def columns(self) -> list[str]:
        if self.source is not None:
            return list(self.source.column_names)
        if isinstance(self.obj, pa.Table):
            return list(self.obj.column_names)
        names = getattr(self.obj, "column_names", None)
        if names is None:  # an IterableDataset without features: look at the first example
            first = next(iter(self.obj), None)
            names = list(first) if first else []
        return list(names)

    @property
    def num_rows(self) -> int | None:
        if self.source is not None:
            return self.source.num_rows
        if isinstance(self.obj, pa.Table):
            return self.obj.num_rows
        if _is_instance(self.obj, "Dataset"):
            return len(self.obj)
        return None  # datasets.IterableDataset

    def batches(self, names: Sequence[str]) -> Iterator[dict[str, list[Any]]]:
        if self.source is not None:
            for batch in self.source.iter_batches(list(names), _BATCH_ROWS):
                yield {k: (v.to_pylist() if isinstance(v, (pa.Array, pa.ChunkedArray)) else list(v)) for k, v in batch.items()}
        elif isinstance(self.obj, pa.Table):
            for batch in self.obj.select(list(names)).to_batches(_BATCH_ROWS):
                yield batch.to_pydict()
        elif _is_instance(self.obj, "Dataset"):
            for start in range(0, len(self.obj), _BATCH_ROWS):
                part = self.obj[start : start + _BATCH_ROWS]
                yield {k: list(part[k]) for k in names}
        else:
            out: dict[str, list[Any]] = {k: [] for k in names}
            for example in self.obj:
                for k in names:
                    out[k].append(example.get(k))
                if len(out[names[0]]) == _BATCH_ROWS:
                    yield out
                    out = {k: [] for k in names}
            if names and out[names[0]]:
                yield out


def _is_json_array(path: str) -> bool:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    return head.startswith(b"[")


def _nested(record: Mapping[str, Any], key: str) -> Any:
    column, path = split_key(key)
    value = record.get(column)
    for part in path:
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


class RecordData:
    """What :func:`load_hf_dataset` returns: the remapped rows of one split, read on demand.

    ``kind`` is ``"prompts"`` (RL prompts with ``data_source``, and ``reward_model.ground_truth``
    when the data has one) or ``"preferences"`` (``prompt``, ``chosen``, ``rejected``).
    Iterating yields one record (a dict) per row; ``len()`` is the row count (refused when
    streaming a ``datasets.IterableDataset``, whose length is unknown).
    """

    def __init__(
        self,
        table: _Table,
        *,
        lo: int,
        hi: int | None,
        keys: dict[str, str | None],
        data_source: str | None,
        kind: str,
        streaming: bool,
        label: str,
    ) -> None:
        self._table, self._lo, self._hi = table, lo, hi
        self.keys, self.data_source, self.kind = keys, data_source, kind
        self.streaming, self.label = streaming, label
        self._rows: list[dict[str, Any]] | None = None
        if not streaming:
            self._rows = list(self._generate())
            if not self._rows:
                raise ValueError(f"load_hf_dataset: {label} holds no rows (after the split's slice)")

    @property
    def columns(self) -> list[str]:
        """The record fields (the trainer's names, after remapping)."""
        if self.kind == "preferences":
            return ["prompt", "chosen", "rejected"]
        return ["prompt", "data_source", *(["reward_model"] if self.keys["ground_truth"] else []), "extra_info"]

    @property
    def has_reward(self) -> bool:
        """Whether each record carries a ground truth for a rule-based reward."""
        return self.kind == "prompts" and self.keys["ground_truth"] is not None

    def __len__(self) -> int:
        if self._rows is not None:
            return len(self._rows)
        n = self._table.num_rows
        if n is None:
            raise TypeError(f"{self.label} is streamed and its length is unknown; load it with streaming=False")
        return (n if self._hi is None else min(self._hi, n)) - self._lo

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self._rows is not None:
            return iter(self._rows)
        return self._generate()

    def _generate(self) -> Iterator[dict[str, Any]]:
        keys = self.keys
        columns = set(self._table.columns)
        wanted = sorted({split_key(k)[0] for k in keys.values() if k and split_key(k)[0] in columns})
        if "extra_info" in columns:
            wanted.append("extra_info")
        row = 0
        for batch in self._table.batches(wanted):
            n = len(batch[wanted[0]])
            for i in range(n):
                index = row + i
                if index < self._lo or (self._hi is not None and index >= self._hi):
                    continue
                yield self._record({k: batch[k][i] for k in wanted}, index)
            row += n
            if self._hi is not None and row >= self._hi:
                return

    def _record(self, raw: dict[str, Any], index: int) -> dict[str, Any]:
        keys = self.keys
        where = f"{self.label}: row {index}"
        prompt = _nested(raw, keys["prompt"])
        if not isinstance(prompt, (str, list)) or not prompt:
            raise ValueError(
                f"{where}: field {keys['prompt']!r} is {type(prompt).__name__}, not a prompt (text or a chat "
                "message list); pass prompt_key= naming the prompt column"
            )
        if self.kind == "preferences":
            out = {"prompt": prompt}
            for side in PREFERENCE_COLUMNS:
                value = _nested(raw, keys[side])
                if value is None:
                    raise ValueError(f"{where}: field {keys[side]!r} is empty")
                out[side] = value
            return out
        source = self.data_source if self.data_source is not None else _nested(raw, keys["reward_fn"])
        if not isinstance(source, str) or not source:
            raise ValueError(f"{where}: field {keys['reward_fn']!r} is {source!r}, not a scorer name")
        extra = raw.get("extra_info") if isinstance(raw.get("extra_info"), dict) else {}
        record: dict[str, Any] = {"prompt": prompt, "data_source": source}
        if keys["ground_truth"]:
            truth = _nested(raw, keys["ground_truth"])
            if truth is None:
                raise ValueError(f"{where}: field {keys['ground_truth']!r} is empty")
            record["reward_model"] = {"style": "rule", "ground_truth": truth if isinstance(truth, str) else json.dumps(truth)}
        record["extra_info"] = {**extra, "index": index}
        return record

    def write_parquet(self, path: str) -> str:
        """Write the records to a parquet file, one row group per batch read; returns ``path``."""
        path = os.path.abspath(os.fspath(path))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        writer = None
        count = 0
        chunk: list[dict[str, Any]] = []
        try:
            for record in self:
                chunk.append(record)
                if len(chunk) == _BATCH_ROWS:
                    writer = _write(writer, path, chunk)
                    count += len(chunk)
                    chunk = []
            if chunk:
                writer = _write(writer, path, chunk)
                count += len(chunk)
        finally:
            if writer is not None:
                writer.close()
        if count == 0:
            raise ValueError(f"load_hf_dataset: {self.label} holds no rows (after the split's slice)")
        return path

    def __repr__(self) -> str:
        size = "streamed" if self._rows is None else f"{len(self._rows)} rows"
        return f"RecordData({self.label}, {self.kind}, {size})"


def _write(writer: pq.ParquetWriter | None, path: str, chunk: list[dict[str, Any]]) -> pq.ParquetWriter:
    table = pa.Table.from_pylist(chunk)
    if writer is None:
        writer = pq.ParquetWriter(path, table.schema)
    elif table.schema != writer.schema:
        table = table.cast(writer.schema)  # a later batch's inferred types (e.g. all-null fields)
    writer.write_table(table)
    return writer


def _pick(path_or_dataset: Any, name: str) -> tuple[Any, str]:
    """The one input the split ``name`` selects, and its label for messages."""
    if isinstance(path_or_dataset, (str, os.PathLike)):
        path = os.path.abspath(os.path.expanduser(os.fspath(path_or_dataset)))
        if name not in ("", "train"):
            raise ValueError(
                f"load_hf_dataset({path!r}, split={name!r}): a file holds one split, 'train'; pass "
                "{'train': file, 'test': file} to choose between files"
            )
        return path, path
    if isinstance(path_or_dataset, Mapping) or _is_instance(path_or_dataset, "DatasetDict") or _is_instance(
        path_or_dataset, "IterableDatasetDict"
    ):
        splits = list(path_or_dataset.keys())
        if not name:
            if len(splits) != 1:
                raise ValueError(f"load_hf_dataset: the dataset has splits {splits}; pass split= naming one")
            name = splits[0]
        if name not in splits:
            raise ValueError(f"load_hf_dataset: no split {name!r}; the dataset has {splits}")
        inner = path_or_dataset[name]
        if isinstance(inner, (str, os.PathLike)):
            path = os.path.abspath(os.path.expanduser(os.fspath(inner)))
            return path, f"{path} (split {name})"
        return inner, f"split {name!r}"
    if _is_instance(path_or_dataset, "Dataset") or _is_instance(path_or_dataset, "IterableDataset"):
        return path_or_dataset, f"{type(path_or_dataset).__name__}"
    if isinstance(path_or_dataset, pa.Table):
        return path_or_dataset, "pyarrow Table"
    raise TypeError(
        f"load_hf_dataset takes a file path, a {{split: path}} dict, a datasets.Dataset / DatasetDict or a "
        f"pyarrow Table, got {type(path_or_dataset).__name__}"
    )


def load_hf_dataset(
    path_or_dataset: Any,
    *,
    split: str | None = None,
    streaming: bool = False,
    prompt_key: str = "prompt",
    reward_fn_key: str = "data_source",
    ground_truth_key: str | None = "reward_model.ground_truth",
    data_source: str | None = None,
    chosen_key: str = "chosen",
    rejected_key: str = "rejected",
) -> RecordData:
    """Rows of a jsonl / json / parquet / arrow file, a ``{split: file}`` dict, a pyarrow Table or
    a ``datasets.Dataset`` (``DatasetDict``, ``IterableDataset``), remapped to the trainer's records.

    Args:
        path_or_dataset: the data (see above).
        split: a split name with an optional slice, as ``datasets`` writes them: ``"train"``,
            ``"train[:1000]"``, ``"test[90%:]"`` (a single file is split ``"train"``).
        streaming: read the rows on demand, batch by batch, instead of now.
        prompt_key: the prompt field (``data.prompt_key``).
        reward_fn_key: the field naming each row's scorer (``data.reward_fn_key``); or
        data_source: one scorer name for every row (``"openai/gsm8k"``, ``"verl/arithmetic"``).
        ground_truth_key: the field the rule-based scorer compares against (None: none; a
            reward model or a custom reward function scores the rows).
        chosen_key / rejected_key: the preference fields; a dataset with both (and no scorer
            field) loads as preference pairs (``kind == "preferences"``).
    """
    name, lo_text, hi_text = parse_split(split) if split is not None else ("", None, None)
    obj, label = _pick(path_or_dataset, name)
    table = _Table(obj, label)
    columns = table.columns
    present = lambda key: key is not None and split_key(key)[0] in columns  # noqa: E731
    if not present(prompt_key):
        raise ValueError(f"{label}: no prompt column {prompt_key!r} (columns: {columns}); pass prompt_key=")
    is_pref = present(chosen_key) and present(rejected_key) and not present(reward_fn_key) and data_source is None
    if is_pref:
        kind = "preferences"
        keys: dict[str, str | None] = {"prompt": prompt_key, "chosen": chosen_key, "rejected": rejected_key}
    else:
        kind = "prompts"
        if data_source is None and not present(reward_fn_key):
            raise ValueError(
                f"{label}: no column {reward_fn_key!r} naming each row's scorer (columns: {columns}); pass "
                "reward_fn_key= naming it, or data_source= (e.g. 'openai/gsm8k') for every row"
            )
        truth = ground_truth_key if present(ground_truth_key) else None
        if ground_truth_key is not None and truth is None and ground_truth_key != "reward_model.ground_truth":
            raise ValueError(f"{label}: no column {ground_truth_key!r} (columns: {columns}); fix ground_truth_key=")
        keys = {"prompt": prompt_key, "reward_fn": reward_fn_key, "ground_truth": truth}
    n = table.num_rows
    lo = _bound(lo_text, n, 0, f"split={split!r}")
    hi = None if hi_text is None else _bound(hi_text, n, 0, f"split={split!r}")
    return RecordData(
        table, lo=lo, hi=hi, keys=keys, data_source=data_source, kind=kind, streaming=streaming, label=label
    )
