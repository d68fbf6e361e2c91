"""Lazy, row-addressable reading of parquet, arrow and jsonl files.

A multi-GB dataset file is never loaded whole: parquet is read one row group at a time
(only the columns asked for, a few row groups cached), arrow files are memory-mapped (the
OS pages them in on demand), and jsonl keeps one byte offset per line and seeks. Several
files are concatenated into one row space by ``TableStore``; a table already in memory (a
pyarrow Table, a Hugging Face ``datasets.Dataset``) joins it through ``FrameSource``, and
``TableStore.select`` keeps a subset of rows (a filter) without copying any data.

File handles are opened lazily per process, so a store survives the fork of DataLoader
workers.
"""

from __future__ import annotations

import abc
import bisect
import copy
import json
import logging
import os
import sys
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

logger = logging.getLogger(__name__)

FORMATS = ("parquet", "arrow", "jsonl")
# Decoded parquet row groups kept per file (per process); bounds memory on multi-GB files.
DEFAULT_CACHE_BYTES = 256 * 2**20
_EXTENSIONS = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
}


def detect_format(path: str) -> str:
    """The file format of ``path`` from its extension: "parquet", "arrow" or "jsonl"."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in _EXTENSIONS:
        raise ValueError(
            f"{path}: cannot tell the file format from the extension {ext!r}; use one of "
            f"{sorted(_EXTENSIONS)} (parquet, arrow IPC file/stream, or JSON lines)"
        )
    return _EXTENSIONS[ext]


def split_key(key: str) -> tuple[str, tuple[str, ...]]:
    """Split a dotted field name ("extra_info.answer") into its column and nested path."""
    parts = key.split(".")
    return parts[0], tuple(parts[1:])


_FIX_ROW = "fix the file or point the config's key at the right field"


def get_field(row: dict[str, Any], key: str, *, path: str, row_index: int) -> Any:
    """``row[key]`` for a possibly dotted key; a missing or null field names the file, row and field."""
    column, nested = split_key(key)
    if column not in row:
        raise ValueError(
            f"{path}: row {row_index} has no field {key!r} (fields present: {sorted(row)}); {_FIX_ROW}"
        )
    value = row[column]
    for i, part in enumerate(nested):
        here = ".".join((column,) + nested[:i])
        if value is None:
            raise ValueError(f"{path}: row {row_index}: field {here!r} is null (needed for {key!r}); {_FIX_ROW}")
        if not isinstance(value, dict):
            raise ValueError(
                f"{path}: row {row_index}: field {here!r} is a {value_kind(value)}, not an object with {part!r} "
                f"(needed for {key!r}); {_FIX_ROW}"
            )
        if part not in value:
            raise ValueError(
                f"{path}: row {row_index}: field {here!r} has no {part!r} (keys: {sorted(value)}; needed for "
                f"{key!r}); {_FIX_ROW}"
            )
        value = value[part]
    if value is None:
        raise ValueError(f"{path}: row {row_index}: field {key!r} is null; {_FIX_ROW}")
    return value


def value_kind(value: Any) -> str:
    """The kind of a Python value in messages: string, number, boolean, list, dict, null."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, (list, tuple, np.ndarray)):
        return "list"
    if isinstance(value, dict):
        return "dict"
    return type(value).__name__


_KIND_TEXT = {
    "string": "a string",
    "messages": "a list of chat messages",
    "conversation": "a chat to learn from",
    "dict": "an object (dict)",
}
_CHATS = ("messages", "conversation")


@dataclass(frozen=True)
class FieldCheck:
    """What every row must hold at ``key`` (dotted for nested fields, e.g. ``extra_info.answer``).

    ``kinds``: the accepted kinds of value, "string", "messages" (a non-empty list of
    ``{role: str, content: str}``), "conversation" (messages that start with a prompt and hold
    an assistant turn) and "dict"; None accepts anything that is not null.
    ``nullable``: a null or missing value (or column) is fine; present values are still checked.
    """

    key: str
    kinds: tuple[str, ...] | None = None
    nullable: bool = False

    def __post_init__(self) -> None:
        unknown = set(self.kinds or ()) - set(_KIND_TEXT)
        assert not unknown, unknown


def _check_value(value: Any, check: FieldCheck, path: str, row: int) -> None:
    """Raise ValueError naming the file, row and field when the column value ``value`` fails ``check``."""
    column, nested = split_key(check.key)
    if check.nullable:
        for part in nested:
            value = value.get(part) if isinstance(value, dict) else None
        if value is None:
            return
    else:
        value = get_field({column: value}, check.key, path=path, row_index=row)
    if check.kinds is None:
        return
    kind = value_kind(value)
    if kind == "list" and any(k in _CHATS for k in check.kinds):
        from verl.data.tokenizer import validate_conversation, validate_messages

        validate = validate_conversation if "conversation" in check.kinds else validate_messages
        validate(list(value), where=f"{path}: row {row}: field {check.key!r}")
        return
    if kind not in check.kinds:
        expected = " or ".join(_KIND_TEXT[k] for k in check.kinds)
        raise ValueError(
            f"{path}: row {row}: field {check.key!r} is a {kind} ({value!r:.80}), expected {expected}; {_FIX_ROW}"
        )


_CHECK_IN_PYTHON = -1


def _arrow_kind(t: pa.DataType) -> str:
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return "list"
    if pa.types.is_struct(t) or pa.types.is_map(t):
        return "dict"
    if pa.types.is_boolean(t):
        return "boolean"
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t):
        return "number"
    if pa.types.is_null(t):
        return "null"
    return str(t)


def _arrow_bad_messages(values: pa.Array, conversation: bool) -> pa.Array | None:
    """[rows] bool: rows whose message list is empty or has a message without a role or content
    (and, for a ``conversation``, starts with an assistant turn or has none); None when the list
    type is not ``list<struct<role: string, content: string>>`` (check in Python)."""
    item = values.type.value_type
    if not (pa.types.is_list(values.type) or pa.types.is_large_list(values.type)) or not pa.types.is_struct(item):
        return None
    for name in ("role", "content"):
        index = item.get_field_index(name)
        if index < 0 or _arrow_kind(item.field(index).type) != "string":
            return None
    bad = pc.fill_null(pc.equal(pc.list_value_length(values), 0), False)
    flat = values.flatten()
    if len(flat):
        bad_item = pc.or_(
            flat.is_null(), pc.or_(pc.struct_field(flat, "role").is_null(), pc.struct_field(flat, "content").is_null())
        )
        parents = pc.list_parent_indices(values).to_numpy()
        rows = np.zeros(len(values), dtype=bool)
        rows[parents[bad_item.to_numpy(zero_copy_only=False)]] = True
        if conversation:
            assistant = pc.fill_null(pc.equal(pc.struct_field(flat, "role"), "assistant"), False).to_numpy(
                zero_copy_only=False
            )
            has_assistant = np.zeros(len(values), dtype=bool)
            has_assistant[parents[assistant]] = True
            first = np.flatnonzero(np.r_[True, parents[1:] != parents[:-1]])  # first message of each row
            rows |= ~has_assistant & values.is_valid().to_numpy(zero_copy_only=False)
            rows[parents[first][assistant[first]]] = True
        bad = pc.or_(bad, pa.array(rows))
    return bad


def _arrow_first_suspect(values: pa.Array, check: FieldCheck) -> int | None:
    """The first row of ``values`` that may fail ``check`` (checked vectorised), None when none
    does, or ``_CHECK_IN_PYTHON`` for a column type the vectorised check does not cover."""
    _, nested = split_key(check.key)
    node = values
    for part in nested:
        if not pa.types.is_struct(node.type):
            return _CHECK_IN_PYTHON
        if node.type.get_field_index(part) < 0:
            return None if check.nullable else 0  # no row has it
        node = pc.struct_field(node, part)
    suspects = []
    if not check.nullable and node.null_count:
        suspects.append(node.is_null())
    kind = _arrow_kind(node.type)
    if check.kinds is not None and kind != "null":
        if kind == "list" and any(k in _CHATS for k in check.kinds):
            bad = _arrow_bad_messages(node, "conversation" in check.kinds)
            if bad is None:
                return _CHECK_IN_PYTHON
            suspects.append(bad)
        elif kind not in check.kinds:
            suspects.append(node.is_valid())
    if not suspects:
        return None
    combined = suspects[0]
    for more in suspects[1:]:
        combined = pc.or_(combined, more)
    first = pc.index(combined, True).as_py()
    return None if first < 0 else first


class FileSource(abc.ABC):
    """One data file, readable by row index without loading the whole file.

    Subclasses implement ``_open`` (returns the file's column names and row count) and
    ``_read_row``/``_iter_column`` for their format.
    """

    def __init__(self, path: str, columns: Sequence[str] | None = None):
        if not os.path.exists(path):
            raise ValueError(f"data file {path} does not exist")
        if os.path.getsize(path) == 0:
            raise ValueError(f"data file {path} is empty (0 bytes)")
        self._setup(path, columns)

    def _setup(self, path: str, columns: Sequence[str] | None) -> None:
        self.path = path
        self._wanted = list(columns) if columns is not None else None
        self._pid: int | None = None
        self.column_names: list[str] = []
        self.num_rows = 0
        self._ensure_open()

    def _ensure_open(self) -> None:
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._open()

    def _columns_to_read(self) -> list[str]:
        if self._wanted is None:
            return list(self.column_names)
        return [c for c in self._wanted if c in self.column_names]

    @abc.abstractmethod
    def _open(self) -> None:
        """Open the file's handles and set ``column_names`` and ``num_rows``."""

    def row(self, i: int) -> dict[str, Any]:
        """Row ``i`` of this file as a dict of the selected columns (Python objects)."""
        if not 0 <= i < self.num_rows:
            raise IndexError(f"{self.path}: row {i} out of range [0, {self.num_rows})")
        self._ensure_open()
        return self._read_row(i)

    def iter_column(self, name: str, batch_rows: int = 4096) -> Iterator[list[Any]]:
        """Yield the values of one column in file order, ``batch_rows`` at a time."""
        self._ensure_open()
        if name not in self.column_names:
            raise ValueError(f"{self.path}: no column {name!r} (columns: {self.column_names})")
        yield from self._iter_column(name, batch_rows)

    def iter_batches(self, names: Sequence[str], batch_rows: int = 4096) -> Iterator[dict[str, Any]]:
        """Yield ``{column: values}`` of several columns in file order, ``batch_rows`` rows at a time.

        Values are a pyarrow Array for parquet and arrow files (so checks can be vectorised)
        and a list of Python objects for jsonl (None where a record lacks the key).
        """
        self._ensure_open()
        missing = [name for name in names if name not in self.column_names]
        if missing:
            raise ValueError(f"{self.path}: no columns {missing} (columns: {self.column_names})")
        yield from self._iter_batches(names, batch_rows)

    @abc.abstractmethod
    def _read_row(self, i: int) -> dict[str, Any]:
        """Row ``i`` (already range-checked) as a dict."""

    @abc.abstractmethod
    def _iter_column(self, name: str, batch_rows: int) -> Iterator[list[Any]]:
        """Values of column ``name`` in file order, in lists of at most ``batch_rows``."""

    @abc.abstractmethod
    def _iter_batches(self, names: Sequence[str], batch_rows: int) -> Iterator[dict[str, Any]]:
        """``{column: values}`` in file order, at most ``batch_rows`` rows at a time (see iter_batches)."""

    def __getstate__(self) -> dict[str, Any]:
        # Handles (memory maps, open files) do not pickle; reopen in the receiving process.
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_h_")}
        state["_pid"] = None
        return state


class ParquetSource(FileSource):
    """Parquet read one row group at a time, with a least-recently-used cache of decoded groups.

    Memory is bounded by ``cache_bytes`` (at least one row group is always kept) whatever
    the file size; shuffled access over a file whose selected columns fit in the budget
    decodes each row group once.
    """

    def __init__(
        self, path: str, columns: Sequence[str] | None = None, cache_bytes: int = DEFAULT_CACHE_BYTES
    ):
        self._cache_bytes = cache_bytes
        super().__init__(path, columns)

    def _open(self) -> None:
        try:
            self._h_file = pq.ParquetFile(self.path, memory_map=False)
        except (pa.ArrowInvalid, OSError) as e:
            raise ValueError(f"{self.path}: not a readable parquet file (corrupt or truncated?): {e}") from e
        meta = self._h_file.metadata
        self.column_names = list(self._h_file.schema_arrow.names)
        sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        self._starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.num_rows = int(self._starts[-1])
        self._h_cache: OrderedDict[int, pa.Table] = OrderedDict()
        self._h_cached_bytes = 0

    def _row_group(self, g: int) -> pa.Table:
        cache = self._h_cache
        if g in cache:
            cache.move_to_end(g)
            return cache[g]
        try:
            table = self._h_file.read_row_group(g, columns=self._columns_to_read())
        except (pa.ArrowInvalid, OSError) as e:
            raise ValueError(f"{self.path}: failed to read row group {g} (corrupt file?): {e}") from e
        cache[g] = table
        self._h_cached_bytes += table.nbytes
        while len(cache) > 1 and self._h_cached_bytes > self._cache_bytes:
            _, evicted = cache.popitem(last=False)
            self._h_cached_bytes -= evicted.nbytes
        return table

    def _read_row(self, i: int) -> dict[str, Any]:
        g = int(np.searchsorted(self._starts, i, side="right")) - 1
        table = self._row_group(g)
        return table.slice(i - int(self._starts[g]), 1).to_pylist()[0]

    def _iter_column(self, name: str, batch_rows: int) -> Iterator[list[Any]]:
        for batch in self._iter_batches([name], batch_rows):
            yield batch[name].to_pylist()

    def _iter_batches(self, names: Sequence[str], batch_rows: int) -> Iterator[dict[str, Any]]:
        try:
            for batch in self._h_file.iter_batches(batch_size=batch_rows, columns=list(names)):
                yield {name: batch.column(name) for name in names}
        except (pa.ArrowInvalid, OSError) as e:
            raise ValueError(f"{self.path}: failed to read columns {list(names)} (corrupt file?): {e}") from e


class ArrowSource(FileSource):
    """Arrow IPC, file or stream format (the latter is what Hugging Face ``datasets`` writes).

    The file is memory-mapped, so its pages are read by the OS on demand and shared between
    DataLoader workers; only record-batch boundaries are kept.
    """

    def _open(self) -> None:
        try:
            source = pa.memory_map(self.path, "r")
            try:
                reader = pa.ipc.open_file(source)
                batches = [reader.get_batch(b) for b in range(reader.num_record_batches)]
                schema = reader.schema
            except pa.ArrowInvalid:
                source.seek(0)
                stream = pa.ipc.open_stream(source)
                schema = stream.schema
                batches = list(stream)
        except (pa.ArrowInvalid, OSError) as e:
            raise ValueError(
                f"{self.path}: not a readable arrow IPC file or stream (corrupt or truncated?): {e}"
            ) from e
        self._set_batches(schema, batches)

    def _set_batches(self, schema: pa.Schema, batches: Sequence[pa.RecordBatch]) -> None:
        self.column_names = list(schema.names)
        keep = self._columns_to_read()
        self._h_batches = [b.select(keep) for b in batches]
        sizes = [b.num_rows for b in self._h_batches]
        self._starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.num_rows = int(self._starts[-1])

    def _read_row(self, i: int) -> dict[str, Any]:
        b = int(np.searchsorted(self._starts, i, side="right")) - 1
        return self._h_batches[b].slice(i - int(self._starts[b]), 1).to_pylist()[0]

    def _iter_column(self, name: str, batch_rows: int) -> Iterator[list[Any]]:
        for batch in self._iter_batches([name], batch_rows):
            yield batch[name].to_pylist()

    def _iter_batches(self, names: Sequence[str], batch_rows: int) -> Iterator[dict[str, Any]]:
        for batch in self._h_batches:
            missing = [name for name in names if name not in batch.schema.names]
            if missing:
                raise ValueError(f"{self.path}: columns {missing} were not selected for reading")
            for start in range(0, batch.num_rows, batch_rows):
                yield {name: batch.column(name).slice(start, batch_rows) for name in names}


def _is_hf_dataset(frame: Any) -> bool:
    """Whether ``frame`` is a Hugging Face ``datasets.Dataset`` (without importing datasets)."""
    datasets = sys.modules.get("datasets")
    return datasets is not None and isinstance(frame, datasets.Dataset)


def is_frame(frame: Any) -> bool:
    """Whether ``frame`` is a table ``FrameSource`` reads: a pyarrow Table or a ``datasets.Dataset``."""
    return isinstance(frame, pa.Table) or _is_hf_dataset(frame)


class FrameSource(ArrowSource):
    """A table already in memory as a source: a pyarrow Table, or a Hugging Face
    ``datasets.Dataset`` read through its Arrow data (memory-mapped from datasets' cache files;
    a dataset with an indices mapping, after ``select``/``filter``, is taken through it).

    ``label`` stands for the file path in messages. A ``datasets.Dataset`` is pickled as datasets
    pickles it (by its cache files) and its Arrow view is rebuilt in each process.
    """

    def __init__(self, frame: Any, label: str, columns: Sequence[str] | None = None):
        if not is_frame(frame):
            raise TypeError(f"{label}: a pyarrow Table or datasets.Dataset is needed, got {type(frame).__name__}")
        self.frame = frame
        self._setup(label, columns)

    def _open(self) -> None:
        if isinstance(self.frame, pa.Table):
            table = self.frame
        else:
            # Rows of a datasets.Dataset as Arrow (lists of structs stay lists of dicts, as in files).
            table = self.frame.with_format("arrow")[:]
        self._set_batches(table.schema, table.to_batches())


class JsonlSource(FileSource):
    """JSON lines: one byte offset per record is kept, records are parsed when read."""

    def _open(self) -> None:
        if getattr(self, "_h_offsets", None) is not None:
            return  # forked worker: the offsets are still valid and each read opens the file anew
        offsets = []
        names: dict[str, None] = {}
        with open(self.path, "rb") as f:
            pos = 0
            first = True
            for line_no, line in enumerate(f, 1):
                if line.strip():
                    if first:
                        first = False
                        if line.lstrip().startswith(b"["):
                            raise ValueError(
                                f"{self.path}: looks like one JSON array, not JSON lines; write one "
                                f"object per line (e.g. pandas to_json(orient='records', lines=True))"
                            )
                        # Column names come from the first record; later records may add more.
                        names.update(dict.fromkeys(self._parse(line, 0, line_no)))
                    offsets.append(pos)
                pos += len(line)
        self._h_offsets = np.asarray(offsets, dtype=np.int64)
        self.column_names = list(names)
        self.num_rows = len(offsets)

    def _parse(self, line: bytes, i: int, line_no: int | None = None) -> dict[str, Any]:
        where = f"{self.path}: record {i}" + (f" (line {line_no})" if line_no is not None else "")
        try:
            record = json.loads(line)
        except UnicodeDecodeError as e:
            raise ValueError(
                f"{where} is not UTF-8 text (byte {line[e.start]:#04x} at column {e.start + 1}); JSON lines are UTF-8: "
                f"convert the file (e.g. iconv -f latin1 -t utf-8 {self.path} > out.jsonl)"
            ) from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} is not valid JSON: {e}") from e
        if not isinstance(record, dict):
            raise ValueError(f"{self.path}: record {i} is a {type(record).__name__}, not a JSON object")
        return record

    def _read_row(self, i: int) -> dict[str, Any]:
        with open(self.path, "rb") as f:
            f.seek(int(self._h_offsets[i]))
            record = self._parse(f.readline(), i)
        if self._wanted is None:
            return record
        return {k: record.get(k) for k in self._wanted if k in record or k in self.column_names}

    def _iter_column(self, name: str, batch_rows: int) -> Iterator[list[Any]]:
        for batch in self._iter_batches([name], batch_rows):
            yield batch[name]

    def _iter_batches(self, names: Sequence[str], batch_rows: int) -> Iterator[dict[str, Any]]:
        # Each record is parsed once for all ``names`` (JSON parsing is the cost here).
        out: dict[str, list[Any]] = {name: [] for name in names}
        count = 0
        with open(self.path, "rb") as f:
            i = 0
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                record = self._parse(line, i, line_no)
                for name in names:
                    out[name].append(record.get(name))
                i += 1
                count += 1
                if count == batch_rows:
                    yield out
                    out, count = {name: [] for name in names}, 0
        if count:
            yield out


_SOURCES = {"parquet": ParquetSource, "arrow": ArrowSource, "jsonl": JsonlSource}


def open_source(path: str, columns: Sequence[str] | None = None) -> FileSource:
    """Open one data file of any supported format, reading only ``columns`` (all when None)."""
    if os.path.isdir(path):
        inside = sorted(n for n in os.listdir(path) if os.path.splitext(n)[1].lower() in _EXTENSIONS)
        shown = [os.path.join(path, n) for n in inside[:3]] + (["..."] if len(inside) > 3 else [])
        hint = f" ({', '.join(shown)})" if inside else ""
        raise ValueError(f"{path} is a directory, not a data file; give the data files in it{hint}")
    return _SOURCES[detect_format(path)](path, columns)


class TableStore:
    """Several data files (or sources) concatenated into one row space, read lazily.

    ``locate(i)`` maps a row index to (source, row within its file) for messages. A store made
    by ``select`` holds a subset of the rows of another over the same open sources; ``origin(i)``
    is then row ``i``'s index in the full concatenation.
    """

    def __init__(self, files: str | FileSource | Sequence[str | FileSource], columns: Sequence[str] | None = None):
        paths = [files] if isinstance(files, (str, os.PathLike, FileSource)) else list(files)
        if not paths:
            raise ValueError("no data files given (data.train_files / data.val_files is empty)")
        # Config defaults name files under "~" (e.g. ~/data/gsm8k/train.parquet).
        self.sources = [
            p if isinstance(p, FileSource) else open_source(os.path.expanduser(os.fspath(p)), columns) for p in paths
        ]
        self._starts = [0]
        for s in self.sources:
            self._starts.append(self._starts[-1] + s.num_rows)
        self._rows: np.ndarray | None = None  # selected rows of the concatenation, increasing

    def __len__(self) -> int:
        return self._starts[-1] if self._rows is None else len(self._rows)

    def select(self, rows: Sequence[int] | np.ndarray) -> TableStore:
        """A store of rows ``rows`` of this one (increasing indices), sharing its sources."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if len(rows) and (rows[0] < 0 or rows[-1] >= len(self) or (np.diff(rows) <= 0).any()):
            raise ValueError(f"TableStore.select needs increasing row indices in [0, {len(self)})")
        view = copy.copy(self)
        view._rows = rows if self._rows is None else self._rows[rows]
        return view

    def origin(self, i: int) -> int:
        """Row ``i``'s index in the concatenation of every source (``i`` itself unless selected)."""
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} out of range [0, {len(self)})")
        return i if self._rows is None else int(self._rows[i])

    def locate(self, i: int) -> tuple[FileSource, int]:
        """The source holding row ``i`` and the row's index within that source."""
        j = self.origin(i)
        f = bisect.bisect_right(self._starts, j) - 1
        return self.sources[f], j - self._starts[f]

    def row(self, i: int) -> dict[str, Any]:
        source, j = self.locate(i)
        return source.row(j)

    def require_columns(self, names: Sequence[str]) -> None:
        """Fail (naming the file and field) when a file lacks one of ``names`` entirely."""
        for source in self.sources:
            if source.num_rows == 0:
                continue
            for name in names:
                column, _ = split_key(name)
                if column not in source.column_names:
                    raise ValueError(
                        f"{source.path}: every row lacks the field {name!r} (columns: "
                        f"{source.column_names}); fix the file or remap the key in the data config"
                    )

    def check_fields(self, checks: Sequence[FieldCheck], batch_rows: int = 65536) -> None:
        """One pass over every file at load time: fail on the first row that lacks a field or holds
        the wrong kind of value, naming the file, the row and the field (ValueError).

        Parquet and arrow columns are checked vectorised with pyarrow (a row is converted to
        Python only to word the message); jsonl records are parsed once for all checks. Every
        row of the sources is checked, selected or not.
        """
        self.require_columns([c.key for c in checks if not c.nullable])
        for source in self.sources:
            present = [c for c in checks if split_key(c.key)[0] in source.column_names]
            if source.num_rows == 0 or not present:
                continue
            start = 0
            for batch in source.iter_batches(sorted({split_key(c.key)[0] for c in present}), batch_rows):
                for check in present:
                    values = batch[split_key(check.key)[0]]
                    _check_batch(values, check, source.path, start)
                start += len(values)

    def iter_column(
        self, name: str, batch_rows: int = 4096
    ) -> Iterator[tuple[FileSource, np.ndarray, list[Any]]]:
        """Yield (source, rows within its file [n], values [n]) over the selected rows, in order."""
        column, _ = split_key(name)
        for f, source in enumerate(self.sources):
            if source.num_rows == 0:
                continue
            wanted = None
            if self._rows is not None:
                lo, hi = np.searchsorted(self._rows, [self._starts[f], self._starts[f + 1]])
                wanted = self._rows[lo:hi] - self._starts[f]
                if not len(wanted):
                    continue
            start = 0
            for values in source.iter_column(column, batch_rows):
                if wanted is None:
                    yield source, np.arange(start, start + len(values)), values
                else:
                    lo, hi = np.searchsorted(wanted, [start, start + len(values)])
                    if hi > lo:
                        yield source, wanted[lo:hi], [values[k - start] for k in wanted[lo:hi]]
                start += len(values)


def _check_batch(values: pa.Array | list[Any], check: FieldCheck, path: str, start: int) -> None:
    """Apply ``check`` to one batch of a column whose first row is row ``start`` of the file."""
    if isinstance(values, list):
        for k, value in enumerate(values):
            _check_value(value, check, path, start + k)
        return
    suspect = _arrow_first_suspect(values, check)
    if suspect is None:
        return
    if suspect == _CHECK_IN_PYTHON:
        _check_batch(values.to_pylist(), check, path, start)
        return
    _check_value(values[suspect].as_py(), check, path, start + suspect)
    raise AssertionError(f"{path}: row {start + suspect} failed the vectorised check of {check} but not the row check")


def read_records(path: str) -> Iterator[dict[str, Any]]:
    """Yield every record of a parquet/arrow/jsonl file as a dict (for preprocessing tools)."""
    source = open_source(path)
    for i in range(source.num_rows):
        yield source.row(i)


def write_parquet(records: Sequence[dict[str, Any]], path: str, row_group_size: int = 10_000) -> None:
    """Write records (dicts with the same keys) to a parquet file, creating its folder."""
    if not records:
        raise ValueError(f"refusing to write {path}: no records")
    if os.path.isdir(path):
        raise ValueError(f"{path} is a directory; give the path of the parquet file to write")
    folder = os.path.dirname(os.path.abspath(path))
    parent = folder
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"cannot write {path}: {parent} is a file, not a folder")
    os.makedirs(folder, exist_ok=True)
    table = pa.Table.from_pylist(list(records))
    pq.write_table(table, path, row_group_size=row_group_size)
