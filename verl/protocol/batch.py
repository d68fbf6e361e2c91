"""``Batch``: the tensor + non-tensor batch that flows between roles.

A ``Batch`` holds three things:

- ``tensors``: a plain ``dict[str, torch.Tensor]``, every tensor with the batch dimension first
  (``input_ids  # [B, T]``, ``old_log_probs  # [B, R]``, ``token_level_scores  # [B, R]``, ...);
- ``non_tensors``: a ``dict[str, numpy.ndarray]``, every array of length ``B`` along axis 0
  (``uid``, ``data_source``, ``reward_model`` dicts, raw prompts: usually 1-D object arrays);
- ``meta_info``: a ``dict`` of batch-wide values (temperature, global step, timing, ...).

A plain dict of tensors is used rather than a ``TensorDict``: row indexing, concatenation and
the collectives (:mod:`verl.protocol.collectives`) only need ``torch.cat``/``index_select`` per
key, a plain dict adds no per-call overhead, and the GPU machine need not have tensordict installed.

Operations return new ``Batch`` objects and never modify their input, except ``pop`` and
``__setitem__``. Slicing returns views of the tensors (as torch slicing does); fancy indexing,
``repeat``, ``concat`` and padding copy. Each result gets a shallow copy of ``meta_info``.
"""

from __future__ import annotations

import math
import os
import pickle
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["Batch"]

_SAVE_FORMAT = "verl.Batch"
_SAVE_VERSION = 1

Index = int | slice | Sequence[int] | Sequence[bool] | np.ndarray | torch.Tensor


def _as_column_array(key: str, value: Any) -> np.ndarray:
    """A non-tensor column as a numpy array; lists and tuples become 1-D object arrays.

    ``np.array(list_of_lists)`` would silently build a 2-D array (and fail on ragged rows), so
    lists are filled element by element into a 1-D object array of their length.
    """
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise ValueError(
                f"non_tensors[{key!r}] is a 0-d numpy array; a column needs one entry per row "
                "(put batch-wide values in meta_info)"
            )
        return value
    if isinstance(value, (list, tuple)):
        out = np.empty(len(value), dtype=object)
        for i, item in enumerate(value):
            out[i] = item
        return out
    if isinstance(value, torch.Tensor):
        raise ValueError(f"non_tensors[{key!r}] is a torch.Tensor; put it in tensors instead")
    raise ValueError(
        f"non_tensors[{key!r}] is a {type(value).__name__}; expected a numpy array or a list "
        "with one entry per row"
    )


def _values_equal(a: Any, b: Any) -> bool:
    """Deep equality for column entries and meta_info values (tensors, arrays, containers).

    NaN equals NaN here: two copies of the same data with a missing value are not a conflict.
    """
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        b = b.to(a.device)
        if torch.equal(a, b):
            return True
        if a.is_floating_point() or a.is_complex():
            return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
        return False
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
            return False
        if a.shape != b.shape:
            return False
        if a.dtype == object or b.dtype == object:
            return all(_values_equal(x, y) for x, y in zip(a.reshape(-1), b.reshape(-1)))
        # Only the kind matters for numpy columns: '<U2' and '<U5' holding the same strings agree.
        if a.dtype.kind != b.dtype.kind:
            return False
        equal_nan = a.dtype.kind in "fc"
        return bool(np.array_equal(a, b, equal_nan=equal_nan))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_values_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return (
            type(a) is type(b) and len(a) == len(b) and all(_values_equal(x, y) for x, y in zip(a, b))
        )
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


def _merge_meta(metas: Sequence[Mapping[str, Any]], labels: Sequence[str], op: str) -> dict[str, Any]:
    """Union of several meta_info dicts; the same key with different values is an error.

    Keys that only some inputs carry are kept (a batch without a key does not contradict it).
    """
    merged: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for meta, label in zip(metas, labels):
        for key, value in meta.items():
            if key in merged and not _values_equal(merged[key], value):
                raise ValueError(
                    f"{op}: meta_info[{key!r}] differs between {owner[key]} ({_short(merged[key])}) "
                    f"and {label} ({_short(value)}); make them agree or pop the key first"
                )
            if key not in merged:
                merged[key] = value
                owner[key] = label
    return merged


def _short(value: Any, limit: int = 60) -> str:
    if isinstance(value, torch.Tensor):
        text = f"tensor({_dtype_name(value.dtype)}{list(value.shape)})"
    elif isinstance(value, np.ndarray):
        text = f"array({value.dtype}{list(value.shape)})"
    else:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensor_schema(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """``{key: (dtype, shape without the batch dim)}``, the part of a layout that must agree."""
    return {k: (t.dtype, tuple(t.shape[1:])) for k, t in tensors.items()}


def _schema_mismatch(
    schemas: Sequence[tuple[Mapping[str, tuple[torch.dtype, tuple[int, ...]]], Sequence[str]]],
    labels: Sequence[str],
    op: str,
) -> str | None:
    """Why several batches cannot be concatenated (``None`` when they can).

    ``schemas[i]`` is (tensor schema, non-tensor keys) of input ``i``; the first input is the
    reference. Shared by ``Batch.concat`` and the gathering collectives, so that a mismatch reads
    the same whether it is found locally or across ranks.
    """
    ref_tensors, ref_non_tensors = schemas[0]
    for (tensors, non_tensors), label in zip(schemas[1:], labels[1:]):
        if tensors.keys() != ref_tensors.keys():
            missing = sorted(set(ref_tensors) - set(tensors))
            extra = sorted(set(tensors) - set(ref_tensors))
            return (
                f"{op}: tensor keys differ: {label} lacks {missing} and has extra {extra} "
                f"compared with {labels[0]}; select the same keys on every batch"
            )
        if set(non_tensors) != set(ref_non_tensors):
            missing = sorted(set(ref_non_tensors) - set(non_tensors))
            extra = sorted(set(non_tensors) - set(ref_non_tensors))
            return (
                f"{op}: non-tensor keys differ: {label} lacks {missing} and has extra {extra} "
                f"compared with {labels[0]}; select the same keys on every batch"
            )
        for key, (dtype, tail) in tensors.items():
            ref_dtype, ref_tail = ref_tensors[key]
            if dtype != ref_dtype:
                return (
                    f"{op}: tensors[{key!r}] is {_dtype_name(dtype)} in {label} but "
                    f"{_dtype_name(ref_dtype)} in {labels[0]}; cast to one dtype first"
                )
            if tail != ref_tail:
                return (
                    f"{op}: tensors[{key!r}] has shape [*, {', '.join(map(str, tail))}] in {label} "
                    f"but [*, {', '.join(map(str, ref_tail))}] in {labels[0]}; only the batch dim "
                    "may differ (pad sequences to one length first)"
                )
    return None


def _normalize_index(index: Index, n: int) -> slice | np.ndarray:
    """A row index as a forward slice or a 1-D int64 array of in-range rows.

    Accepts an int, a slice, a list/array/tensor of ints (negative ints count from the end) or
    a bool mask of length ``n``.
    """
    if isinstance(index, slice):
        start, stop, step = index.indices(n)
        if step > 0:
            return slice(start, stop, step)
        return np.arange(start, stop, step, dtype=np.int64)
    if isinstance(index, (int, np.integer)) and not isinstance(index, (bool, np.bool_)):
        i = int(index)
        if not -n <= i < n:
            raise IndexError(f"row {i} is out of range for a batch of {n} rows")
        return slice(i % n, i % n + 1, 1)
    if isinstance(index, torch.Tensor):
        if index.dtype == torch.bool:
            arr = index.detach().cpu().numpy()
        elif not index.is_floating_point() and not index.is_complex():
            if index.ndim == 0:
                return _normalize_index(int(index.item()), n)
            arr = index.detach().cpu().numpy().astype(np.int64, copy=False)
        else:
            raise TypeError(f"a batch index tensor must be integer or bool, got {index.dtype}")
    elif isinstance(index, (np.ndarray, list, tuple, range)):
        arr = np.asarray(index)
        if arr.size == 0:
            arr = arr.astype(np.int64)
    else:
        raise TypeError(
            f"cannot index a Batch with {type(index).__name__}; use an int, slice, int/bool "
            "tensor or array, or a column name"
        )
    if arr.dtype == np.bool_:
        if arr.shape != (n,):
            raise IndexError(f"a bool mask must have shape [{n}] (the batch size), got {list(arr.shape)}")
        return np.flatnonzero(arr).astype(np.int64)
    if arr.dtype.kind not in "iu" or arr.ndim != 1:
        raise TypeError(
            f"a batch index array must be 1-D integer or bool, got dtype {arr.dtype} and "
            f"shape {list(arr.shape)}"
        )
    arr = arr.astype(np.int64, copy=False)
    if arr.size and (arr.min() < -n or arr.max() >= n):
        bad = int(arr[(arr < -n) | (arr >= n)][0])
        raise IndexError(f"row {bad} is out of range for a batch of {n} rows")
    return np.where(arr < 0, arr + n, arr)


class Batch:
    """A batch of rows: tensors ``[B, ...]``, non-tensor columns ``[B]`` and ``meta_info``.

    Build one with ``Batch.from_dict(tensors=..., non_tensors=..., meta_info=...)`` (or the
    constructor, which takes the same keywords); every column must have the same size ``B``
    along dim 0. ``batch_size`` is only needed for a batch with no columns.
    """

    __slots__ = ("tensors", "non_tensors", "meta_info", "_batch_size")

    def __init__(
        self,
        *,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, np.ndarray | Sequence[Any]] | None = None,
        meta_info: Mapping[str, Any] | None = None,
        batch_size: int | None = None,
    ) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.non_tensors: dict[str, np.ndarray] = {}
        self.meta_info: dict[str, Any] = dict(meta_info or {})
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 0):
            raise ValueError(f"batch_size must be a non-negative int, got {batch_size!r}")
        self._batch_size = batch_size
        first_key: str | None = None
        for key, value in (tensors or {}).items():
            if not isinstance(value, torch.Tensor):
                raise ValueError(
                    f"tensors[{key!r}] is a {type(value).__name__}, not a torch.Tensor; convert it "
                    "(torch.as_tensor) or pass it in non_tensors"
                )
            first_key = self._check_rows(f"tensors[{key!r}]", value.shape, first_key)
            self.tensors[key] = value
        for key, value in (non_tensors or {}).items():
            if key in self.tensors:
                raise ValueError(f"key {key!r} is given both as a tensor and as a non-tensor column")
            arr = _as_column_array(key, value)
            first_key = self._check_rows(f"non_tensors[{key!r}]", arr.shape, first_key)
            self.non_tensors[key] = arr
        if self._batch_size is None:
            self._batch_size = 0

    def _check_rows(self, name: str, shape: Sequence[int], first: str | None) -> str:
        if len(shape) == 0:
            raise ValueError(f"{name} is 0-d; every column needs the batch dim first ([B, ...])")
        rows = int(shape[0])
        if self._batch_size is None:
            self._batch_size = rows
            return name
        if rows != self._batch_size:
            other = f"{first} has {self._batch_size}" if first else f"batch_size is {self._batch_size}"
            raise ValueError(
                f"batch size mismatch: {name} has {rows} rows (shape {list(shape)}) but {other}; "
                "dim 0 is the batch dim of every column"
            )
        return first or name

    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, np.ndarray | Sequence[Any]] | None = None,
        meta_info: Mapping[str, Any] | None = None,
        *,
        batch_size: int | None = None,
    ) -> Batch:
        """Build a batch, checking that every column has the same batch size (dim 0)."""
        return cls(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info, batch_size=batch_size)

    def _new(
        self,
        tensors: dict[str, torch.Tensor],
        non_tensors: dict[str, np.ndarray],
        batch_size: int,
        meta_info: Mapping[str, Any] | None = None,
    ) -> Batch:
        """A result batch from columns already known to be consistent (skips validation)."""
        out = Batch.__new__(Batch)
        out.tensors = tensors
        out.non_tensors = non_tensors
        out.meta_info = dict(self.meta_info if meta_info is None else meta_info)
        out._batch_size = batch_size
        return out

    # ------------------------------------------------------------------ container protocol
    def __len__(self) -> int:
        return self._batch_size

    @property
    def batch_size(self) -> int:
        """Number of rows ``B``."""
        return self._batch_size

    def keys(self) -> list[str]:
        """All column names: tensor keys first, then non-tensor keys."""
        return [*self.tensors, *self.non_tensors]

    def __contains__(self, key: object) -> bool:
        return key in self.tensors or key in self.non_tensors

    def __getitem__(self, index: str | Index) -> Any:
        """``batch["key"]`` returns that column; any row index returns a new ``Batch``.

        An int keeps the batch dim (a 1-row batch), so every operation stays defined on it.
        Ints and slices with a positive step return views of the tensors; other indices copy.
        """
        if isinstance(index, str):
            if index in self.tensors:
                return self.tensors[index]
            if index in self.non_tensors:
                return self.non_tensors[index]
            raise KeyError(f"no column {index!r} in the batch; columns are {self.keys()}")
        rows = _normalize_index(index, len(self))
        return self._take(rows)

    def __setitem__(self, key: str, value: torch.Tensor | np.ndarray | Sequence[Any]) -> None:
        """Add or replace a column (a tensor goes to ``tensors``, anything else to ``non_tensors``)."""
        is_tensor = isinstance(value, torch.Tensor)
        if is_tensor:
            shape = value.shape
        else:
            value = _as_column_array(key, value)
            shape = value.shape
        where = f"tensors[{key!r}]" if is_tensor else f"non_tensors[{key!r}]"
        if len(shape) == 0 or shape[0] != len(self):
            raise ValueError(
                f"batch size mismatch: {where} has shape {list(shape)} but the batch has {len(self)} "
                "rows; dim 0 is the batch dim"
            )
        self.tensors.pop(key, None)
        self.non_tensors.pop(key, None)
        if is_tensor:
            self.tensors[key] = value
        else:
            self.non_tensors[key] = value

    def _take(self, rows: slice | np.ndarray) -> Batch:
        if isinstance(rows, slice):
            size = len(range(*rows.indices(len(self))))
            tensors = {k: t[rows] for k, t in self.tensors.items()}
            non_tensors = {k: a[rows] for k, a in self.non_tensors.items()}
            return self._new(tensors, non_tensors, size)
        index_cache: dict[torch.device, torch.Tensor] = {}
        tensors = {}
        for key, t in self.tensors.items():
            if t.device not in index_cache:
                index_cache[t.device] = torch.from_numpy(rows).to(t.device)
            tensors[key] = t.index_select(0, index_cache[t.device])
        non_tensors = {k: a[rows] for k, a in self.non_tensors.items()}
        return self._new(tensors, non_tensors, int(rows.shape[0]))

    # ------------------------------------------------------------------ columns
    def _check_keys(self, keys: Iterable[str], op: str) -> list[str]:
        keys = [keys] if isinstance(keys, str) else list(keys)
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"{op}: no column(s) {missing} in the batch; columns are {self.keys()}")
        return keys

    def select(self, keys: Iterable[str], meta_keys: Iterable[str] | None = None) -> Batch:
        """A batch with only ``keys`` (tensor or non-tensor); columns are shared, not copied.

        ``meta_keys`` restricts ``meta_info`` too (all of it is kept when ``None``).
        """
        keys = self._check_keys(keys, "select")
        meta = self.meta_info
        if meta_keys is not None:
            meta_keys = [meta_keys] if isinstance(meta_keys, str) else list(meta_keys)
            missing = [k for k in meta_keys if k not in self.meta_info]
            if missing:
                raise KeyError(f"select: no meta_info key(s) {missing}; keys are {list(self.meta_info)}")
            meta = {k: self.meta_info[k] for k in meta_keys}
        tensors = {k: self.tensors[k] for k in keys if k in self.tensors}
        non_tensors = {k: self.non_tensors[k] for k in keys if k in self.non_tensors}
        return self._new(tensors, non_tensors, len(self), meta)

    def pop(self, keys: Iterable[str]) -> Batch:
        """Remove ``keys`` from this batch and return them as a new batch (same meta_info)."""
        keys = self._check_keys(keys, "pop")
        out = self.select(keys)
        for k in keys:
            self.tensors.pop(k, None)
            self.non_tensors.pop(k, None)
        return out

    def union(self, other: Batch) -> Batch:
        """Columns and meta_info of both batches (same length); shared keys must hold equal values.

        A key present in both with different values (or dtypes/shapes) is an error naming it.
        """
        if not isinstance(other, Batch):
            raise ValueError(f"union: expected a Batch, got {type(other).__name__}")
        if len(other) != len(self):
            raise ValueError(f"union: batch sizes differ ({len(self)} vs {len(other)} rows)")
        tensors = dict(self.tensors)
        non_tensors = dict(self.non_tensors)
        for key, value in other.tensors.items():
            if key in self.non_tensors:
                raise ValueError(f"union: {key!r} is a non-tensor column here but a tensor in the other batch")
            if key in tensors and not _values_equal(tensors[key], value):
                raise ValueError(
                    f"union: tensors[{key!r}] conflicts ({_short(tensors[key])} vs {_short(value)}, "
                    "or different values); pop or rename one of them"
                )
            tensors.setdefault(key, value)
        for key, value in other.non_tensors.items():
            if key in self.tensors:
                raise ValueError(f"union: {key!r} is a tensor here but a non-tensor column in the other batch")
            if key in non_tensors and not _values_equal(non_tensors[key], value):
                raise ValueError(
                    f"union: non_tensors[{key!r}] conflicts (different values); pop or rename one of them"
                )
            non_tensors.setdefault(key, value)
        meta = _merge_meta([self.meta_info, other.meta_info], ["this batch", "the other batch"], "union")
        return self._new(tensors, non_tensors, len(self), meta)

    # ------------------------------------------------------------------ splitting and joining
    def split(self, size: int, *, allow_uneven: bool = False) -> list[Batch]:
        """Consecutive chunks of ``size`` rows (the last one shorter only with ``allow_uneven``).

        An empty batch splits into an empty list.
        """
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"split: size must be a positive int, got {size!r}")
        n = len(self)
        if n % size and not allow_uneven:
            raise ValueError(
                f"split: {n} rows do not split into chunks of {size}; pad first with "
                f"batch.pad_to_divisor({size}) (and unpad after), or pass allow_uneven=True"
            )
        return [self[i : i + size] for i in range(0, n, size)]

    def chunk(self, n: int, *, allow_uneven: bool = False) -> list[Batch]:
        """Exactly ``n`` consecutive chunks of equal size.

        With ``allow_uneven`` the first ``len % n`` chunks get one extra row (numpy's
        ``array_split`` rule; unlike ``torch.chunk``, always ``n`` chunks, some may be empty).
        """
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"chunk: n must be a positive int, got {n!r}")
        total = len(self)
        if total % n and not allow_uneven:
            raise ValueError(
                f"chunk: {total} rows do not split into {n} equal chunks; pad first with "
                f"batch.pad_to_divisor({n}) (and unpad after), or pass allow_uneven=True"
            )
        base, extra = divmod(total, n)
        out, start = [], 0
        for i in range(n):
            stop = start + base + (1 if i < extra else 0)
            out.append(self[start:stop])
            start = stop
        return out

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Rows of ``batches`` in order. Keys, dtypes and non-batch dims must agree.

        meta_info rule: the union of all inputs' meta_info; a key that two inputs carry with
        different values is an error (naming the key and both inputs).
        """
        batches = list(batches)
        if not batches:
            raise ValueError("concat: got no batches; pass at least one")
        for i, b in enumerate(batches):
            if not isinstance(b, Batch):
                raise ValueError(f"concat: element {i} is a {type(b).__name__}, not a Batch")
        labels = [f"batch {i}" for i in range(len(batches))]
        mismatch = _schema_mismatch(
            [(_tensor_schema(b.tensors), list(b.non_tensors)) for b in batches], labels, "concat"
        )
        if mismatch:
            raise ValueError(mismatch)
        meta = _merge_meta([b.meta_info for b in batches], labels, "concat")
        first = batches[0]
        if len(batches) == 1:
            return first._new(dict(first.tensors), dict(first.non_tensors), len(first), meta)
        tensors = {}
        for key in first.tensors:
            parts = [b.tensors[key] for b in batches]
            devices = {p.device for p in parts}
            if len(devices) > 1:
                raise ValueError(
                    f"concat: tensors[{key!r}] lives on several devices {sorted(map(str, devices))}; "
                    "move the batches to one device first (batch.to(device))"
                )
            tensors[key] = torch.cat(parts, dim=0)
        non_tensors = {}
        for key in first.non_tensors:
            parts = [b.non_tensors[key] for b in batches]
            try:
                non_tensors[key] = np.concatenate(parts, axis=0)
            except ValueError as exc:
                shapes = [list(p.shape) for p in parts]
                raise ValueError(f"concat: non_tensors[{key!r}] shapes {shapes} do not concatenate: {exc}") from exc
        return first._new(tensors, non_tensors, sum(len(b) for b in batches), meta)

    def repeat(self, times: int, *, interleave: bool = True) -> Batch:
        """Each row ``times`` times (GRPO's ``n`` samples per prompt).

        ``interleave=True`` keeps copies of a row adjacent: rows [a, b] -> [a, a, b, b].
        ``interleave=False`` tiles the whole batch: [a, b] -> [a, b, a, b].
        Object entries (dicts, strings) are shared between copies, not deep-copied.
        """
        if not isinstance(times, int) or times < 1:
            raise ValueError(f"repeat: times must be a positive int, got {times!r}")
        if interleave:
            tensors = {k: t.repeat_interleave(times, dim=0) for k, t in self.tensors.items()}
            non_tensors = {k: np.repeat(a, times, axis=0) for k, a in self.non_tensors.items()}
        else:
            tensors = {k: t.repeat(times, *([1] * (t.ndim - 1))) for k, t in self.tensors.items()}
            non_tensors = {
                k: np.tile(a, (times,) + (1,) * (a.ndim - 1)) for k, a in self.non_tensors.items()
            }
        return self._new(tensors, non_tensors, len(self) * times)

    def reorder(self, indices: Sequence[int] | np.ndarray | torch.Tensor) -> Batch:
        """Rows permuted so that row ``i`` of the result is row ``indices[i]`` of this batch.

        ``indices`` must be a permutation of ``range(len(self))`` (use ``batch[idx]`` for a
        subset or for repeats); ``batch.reorder(p).reorder(argsort(p))`` restores the order.
        """
        probe = indices.detach().cpu().numpy() if isinstance(indices, torch.Tensor) else np.asarray(indices)
        if probe.dtype == np.bool_ or probe.ndim != 1:
            raise ValueError(
                f"reorder: indices must be a 1-D sequence of row numbers, got {type(indices).__name__} "
                f"of dtype {probe.dtype} and shape {list(probe.shape)}"
            )
        rows = _normalize_index(probe, len(self))
        if rows.shape[0] != len(self) or np.unique(rows).shape[0] != len(self):
            raise ValueError(
                f"reorder: indices must be a permutation of range({len(self)}); use batch[indices] "
                "to take a subset or repeat rows"
            )
        return self._take(rows)

    def pad_to_divisor(self, divisor: int) -> tuple[Batch, int]:
        """Pad rows so that the length divides by ``divisor``; returns (padded batch, pad_size).

        Padding rows are copies of the first rows (cyclically), so they are valid model inputs;
        remove them with ``unpad(pad_size)`` after the padded work is gathered back.
        """
        if not isinstance(divisor, int) or divisor < 1:
            raise ValueError(f"pad_to_divisor: divisor must be a positive int, got {divisor!r}")
        n = len(self)
        pad = (-n) % divisor
        if pad == 0:
            return self._new(dict(self.tensors), dict(self.non_tensors), n), 0
        if n == 0:
            raise ValueError("pad_to_divisor: cannot pad an empty batch (there is no row to copy)")
        filler = self._take(np.arange(pad, dtype=np.int64) % n)
        return Batch.concat([self, filler]), pad

    def unpad(self, pad_size: int) -> Batch:
        """Drop the last ``pad_size`` rows (the inverse of ``pad_to_divisor``)."""
        if not isinstance(pad_size, int) or not 0 <= pad_size <= len(self):
            raise ValueError(f"unpad: pad_size must be an int in [0, {len(self)}], got {pad_size!r}")
        return self[: len(self) - pad_size]

    # ------------------------------------------------------------------ devices and files
    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> Batch:
        """Tensors moved to ``device`` (non-tensor columns and meta_info stay on the host)."""
        tensors = {k: t.to(device, non_blocking=non_blocking) for k, t in self.tensors.items()}
        return self._new(tensors, dict(self.non_tensors), len(self))

    def equals(self, other: Batch) -> bool:
        """Same length, keys, dtypes and values in every column and in meta_info."""
        return (
            isinstance(other, Batch)
            and len(self) == len(other)
            and self.tensors.keys() == other.tensors.keys()
            and self.non_tensors.keys() == other.non_tensors.keys()
            and all(_values_equal(t, other.tensors[k]) for k, t in self.tensors.items())
            and all(_values_equal(a, other.non_tensors[k]) for k, a in self.non_tensors.items())
            and _values_equal(self.meta_info, other.meta_info)
        )

    def save(self, path: str | os.PathLike) -> None:
        """Write the batch with ``torch.save`` (tensors moved to CPU, numpy arrays as they are).

        A tensor that is a view of a larger storage is copied first, so a slice of a big batch
        saves only its own rows.
        """
        tensors = {}
        for key, t in self.tensors.items():
            t = t.detach().cpu()
            if t.untyped_storage().nbytes() != t.numel() * t.element_size():
                t = t.clone()
            tensors[key] = t
        payload = {
            "format": _SAVE_FORMAT,
            "version": _SAVE_VERSION,
            "batch_size": len(self),
            "tensors": tensors,
            "non_tensors": dict(self.non_tensors),
            "meta_info": dict(self.meta_info),
        }
        torch.save(payload, os.fspath(path))

    @classmethod
    def load(
        cls, path: str | os.PathLike, *, map_location: str | torch.device = "cpu", allow_pickle: bool = False
    ) -> Batch:
        """Read a batch written by ``save``.

        By default the file is read with ``torch.load(weights_only=True)``, allowing only numpy's
        array and dtype constructors beyond torch's own safe types: tensors, numpy arrays (object
        arrays too) and plain Python values (dict, list, str, numbers, ...) load, but no arbitrary
        class is ever instantiated, so an untrusted file cannot run code. A file holding other
        objects (custom classes in a column or meta_info) is refused with a ValueError;
        ``allow_pickle=True`` loads it with full pickle, for files you trust only.
        """
        path = os.fspath(path)
        if allow_pickle:
            payload = torch.load(path, map_location=map_location, weights_only=False)
        else:
            try:
                with torch.serialization.safe_globals(_numpy_safe_globals()):
                    payload = torch.load(path, map_location=map_location, weights_only=True)
            except pickle.UnpicklingError as exc:
                raise ValueError(
                    f"Batch.load: {path} holds something weights-only loading refuses "
                    f"({_unpickler_reason(exc)}). "
                    "If you trust the file, load it with Batch.load(path, allow_pickle=True)"
                ) from exc
        if not isinstance(payload, dict) or payload.get("format") != _SAVE_FORMAT:
            raise ValueError(f"Batch.load: {path} was not written by Batch.save")
        if payload.get("version") != _SAVE_VERSION:
            raise ValueError(
                f"Batch.load: {path} has format version {payload.get('version')}, this verl reads "
                f"version {_SAVE_VERSION}"
            )
        return cls(
            tensors=payload["tensors"],
            non_tensors=payload["non_tensors"],
            meta_info=payload["meta_info"],
            batch_size=payload["batch_size"],
        )

    # ------------------------------------------------------------------ display
    def __repr__(self) -> str:
        def tensor_desc(t: torch.Tensor) -> str:
            where = "" if t.device.type == "cpu" else f" {t.device}"
            return f"{_dtype_name(t.dtype)}{list(t.shape)}{where}"

        tensors = ", ".join(f"{k}: {tensor_desc(t)}" for k, t in self.tensors.items())
        non_tensors = ", ".join(f"{k}: {a.dtype}{list(a.shape)}" for k, a in self.non_tensors.items())
        meta = ", ".join(f"{k}: {_short(v, 40)}" for k, v in self.meta_info.items())
        return (
            f"Batch(len={len(self)},\n"
            f"  tensors={{{tensors}}},\n"
            f"  non_tensors={{{non_tensors}}},\n"
            f"  meta_info={{{meta}}})"
        )


def _unpickler_reason(exc: BaseException) -> str:
    """The one informative line of torch's long weights-only refusal message."""
    text = str(exc)
    marker = "WeightsUnpickler error:"
    if marker in text:
        text = text.split(marker, 1)[1].strip().split("\n\n", 1)[0].strip()
    return text


def _numpy_safe_globals() -> list[Any]:
    """numpy's array/scalar/dtype reconstructors: safe to allowlist, they build data, not code.

    The module path differs between numpy 1 (``numpy.core``) and 2 (``numpy._core``); a file
    written under one major numpy version may need ``allow_pickle`` under the other.
    """
    allowed: list[Any] = [np.ndarray, np.dtype]
    try:
        from numpy._core import multiarray
    except ImportError:  # numpy 1.x
        from numpy.core import multiarray
    allowed += [multiarray._reconstruct, multiarray.scalar]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        allowed += [getattr(dtypes, name) for name in dtypes.__all__]
    return allowed
