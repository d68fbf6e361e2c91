"""Lazy, row-addressable reading of parquet, arrow and jsonl files.

A multi-GB dataset file is never loaded whole: parquet is read one row group at a time
(only the columns asked for, a few row groups cached), arrow files are memory-mapped (the
OS pages them in on demand), and jsonl keeps one byte offset per line and seeks. Several
files are concatenated into one row space by ``TableStore``.

File handles are opened lazily per process, so a store survives the fork of DataLoader
workers.
"""

from __future__ import annotations

import abc
import bisect
import json
import logging
import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
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


def get_field(row: dict[str, Any], key: str, *, path: str, row_index: int) -> Any:
    """``row[key]`` for a possibly dotted key; a missing field names the file, row and field."""
    column, nested = split_key(key)
    if column not in row or row[column] is None:
        raise ValueError(
            f"{path}: row {row_index} has no field {key!r} (fields present: {sorted(row)}); "
            f"fix the file or point the config's key at the right field"
        )
    value = row[column]
    for i, part in enumerate(nested):
        if not isinstance(value, dict) or value.get(part) is None:
            here = ".".join((column,) + nested[: i + 1])
            raise ValueError(f"{path}: row {row_index} has no field {here!r} (needed for {key!r})")
        value = value[part]
    return value


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

    @abc.abstractmethod
    def _read_row(self, i: int) -> dict[str, Any]:
        """Row ``i`` (already range-checked) as a dict."""

    @abc.abstractmethod
    def _iter_column(self, name: str, batch_rows: int) -> Iterator[list[Any]]:
        """Values of column ``name`` in file order, in lists of at most ``batch_rows``."""

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
        try:
            for batch in self._h_file.iter_batches(batch_size=batch_rows, columns=[name]):
                yield batch.column(0).to_pylist()
        except (pa.ArrowInvalid, OSError) as e:
            raise ValueError(f"{self.path}: failed to read column {name!r} (corrupt file?): {e}") from e


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
        for batch in self._h_batches:
            column = batch.column(name) if name in batch.schema.names else None
            if column is None:
                raise ValueError(f"{self.path}: column {name!r} was not selected for reading")
            for start in range(0, batch.num_rows, batch_rows):
                yield column.slice(start, batch_rows).to_pylist()


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
            for line in f:
                if line.strip():
                    if first:
                        first = False
                        if line.lstrip().startswith(b"["):
                            raise ValueError(
                                f"{self.path}: looks like one JSON array, not JSON lines; write one "
                                f"object per line (e.g. pandas to_json(orient='records', lines=True))"
                            )
                        # Column names come from the first record; later records may add more.
                        names.update(dict.fromkeys(self._parse(line, 0)))
                    offsets.append(pos)
                pos += len(line)
        self._h_offsets = np.asarray(offsets, dtype=np.int64)
        self.column_names = list(names)
        self.num_rows = len(offsets)

    def _parse(self, line: bytes, i: int) -> dict[str, Any]:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{self.path}: record {i} is not valid JSON: {e}") from e
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
        out: list[Any] = []
        with open(self.path, "rb") as f:
            i = 0
            for line in f:
                if not line.strip():
                    continue
                out.append(self._parse(line, i).get(name))
                i += 1
                if len(out) == batch_rows:
                    yield out
                    out = []
        if out:
            yield out


_SOURCES = {"parquet": ParquetSource, "arrow": ArrowSource, "jsonl": JsonlSource}


def open_source(path: str, columns: Sequence[str] | None = None) -> FileSource:
    """Open one data file of any supported format, reading only ``columns`` (all when None)."""
    return _SOURCES[detect_format(path)](path, columns)


class TableStore:
    """Several data files concatenated into one row space, read lazily.

    ``locate(i)`` maps a global row index to (file path, row within the file) for messages.
    """

    def __init__(self, files: str | Sequence[str], columns: Sequence[str] | None = None):
        paths = [files] if isinstance(files, (str, os.PathLike)) else list(files)
        if not paths:
            raise ValueError("no data files given (data.train_files / data.val_files is empty)")
        # Config defaults name files under "~" (e.g. ~/data/gsm8k/train.parquet).
        self.sources = [open_source(os.path.expanduser(os.fspath(p)), columns) for p in paths]
        self._starts = [0]
        for s in self.sources:
            self._starts.append(self._starts[-1] + s.num_rows)

    def __len__(self) -> int:
        return self._starts[-1]

    def locate(self, i: int) -> tuple[FileSource, int]:
        """The source holding global row ``i`` and the row's index within that file."""
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} out of range [0, {len(self)})")
        f = bisect.bisect_right(self._starts, i) - 1
        return self.sources[f], i - self._starts[f]

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

    def iter_column(self, name: str, batch_rows: int = 4096) -> Iterator[tuple[FileSource, int, list[Any]]]:
        """Yield (source, first row within the file, values) over every file, in order."""
        column, _ = split_key(name)
        for source in self.sources:
            start = 0
            if source.num_rows == 0:
                continue
            for values in source.iter_column(column, batch_rows):
                yield source, start, values
                start += len(values)


def read_records(path: str) -> Iterator[dict[str, Any]]:
    """Yield every record of a parquet/arrow/jsonl file as a dict (for preprocessing tools)."""
    source = open_source(path)
    for i in range(source.num_rows):
        yield source.row(i)


def write_parquet(records: Sequence[dict[str, Any]], path: str, row_group_size: int = 10_000) -> None:
    """Write records (dicts with the same keys) to a parquet file, creating its folder."""
    if not records:
        raise ValueError(f"refusing to write {path}: no records")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    table = pa.Table.from_pylist(list(records))
    pq.write_table(table, path, row_group_size=row_group_size)
