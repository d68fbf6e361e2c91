"""What ``copy_shards_`` and ``copy_ranges_`` share on the Python side: the extension import,
the conversion of their arguments, and the pure-PyTorch mirror of their C++ checks
(csrc/copy_ranges.cpp) with the same order and the same messages.

``copy_shards_`` is checked as ``copy_ranges_`` with one destination and one source; only the
way errors name things differs (:class:`Naming`). The checks are vectorised over the range
table, so the references stay usable on the thousands of ranges a reshard bucket holds.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import NoReturn

import torch

RangesLike = torch.Tensor | Sequence[Sequence[int]]

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def extension() -> ModuleType:
    """Import ``verl._C`` (torch is already imported, so libc10 resolves); an install that did
    not compile it compiles it here, once (verl/utils/extension.py)."""
    try:
        from verl import _C
    except ImportError as exc:
        raise ImportError(
            f"verl._C cannot be imported: {exc} (to compile it ahead of time instead: "
            "`pip install --no-build-isolation -e .` from the repository root, or bash tools/setup_env.sh)"
        ) from exc
    return _C


def extension_has_cuda() -> bool:
    """Whether the installed ``verl._C`` carries the CUDA kernel."""
    return bool(extension().with_cuda)


@dataclass(frozen=True)
class Naming:
    """How one entry point's errors name things (the C++ ``Naming``): ``copy_shards_`` has one
    ``src`` and one ``dst``; ``copy_ranges_`` has lists (``srcs[2]``, ``dsts[0]``) and rows
    that carry tensor indices."""

    op: str
    lists: bool

    @property
    def columns(self) -> tuple[str, ...]:
        if self.lists:
            return ("src_index", "src_offset", "dst_index", "dst_offset", "length")
        return ("src_offset", "dst_offset", "length")

    def tensor(self, side: str, index: int) -> str:
        """``side`` is "src" or "dst"."""
        return f"{side}s[{index}]" if self.lists else side

    def describe(self, i: int, row: Sequence[int]) -> str:
        """Row i as the errors show it; ``row`` is (src_index, src_offset, dst_index, dst_offset,
        length)."""
        si, s, di, d, n = row
        if self.lists:
            return f"range {i} (src_index={si}, src_offset={s}, dst_index={di}, dst_offset={d}, length={n})"
        return f"range {i} (src_offset={s}, dst_offset={d}, length={n})"

    def fail(self, message: str) -> NoReturn:
        raise ValueError(f"{self.op}: {message}")


SHARDS = Naming("copy_shards_", lists=False)
RANGES = Naming("copy_ranges_", lists=True)


def as_table(naming: Naming, ranges: RangesLike) -> torch.Tensor:
    """Ranges as the int64 ``[N, len(naming.columns)]`` tensor the kernel takes (a tensor keeps
    its device). Accepts an integer tensor of that shape or a sequence of rows of Python ints."""
    width = len(naming.columns)
    columns = f"({', '.join(naming.columns)})"
    if isinstance(ranges, torch.Tensor):
        if ranges.dtype.is_floating_point or ranges.dtype.is_complex or ranges.dtype == torch.bool:
            naming.fail(f"ranges must hold integers (int64 [N, {width}]), got dtype {ranges.dtype}")
        tensor = ranges.to(torch.int64)
    else:
        rows = [tuple(row) for row in ranges]
        kind = "triple" if width == 3 else f"{width}-tuple"
        for i, row in enumerate(rows):
            if len(row) != width:
                naming.fail(f"ranges[{i}] = {row!r} is not a {columns} {kind}")
            try:
                values = [operator.index(v) for v in row]
            except TypeError:
                naming.fail(f"ranges[{i}] = {row!r} holds a value that is not an integer")
            if not all(_INT64_MIN <= v <= _INT64_MAX for v in values):
                naming.fail(f"ranges[{i}] = {row!r} holds a value outside int64")
        tensor = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), width)
    if tensor.dim() != 2 or tensor.shape[1] != width:
        naming.fail(
            f"ranges must be an int64 tensor of shape [N, {width}] holding {columns} rows, got shape "
            f"{list(tensor.shape)}"
        )
    return tensor


def as_tensor_list(naming: Naming, tensors: Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
    """``tensors`` (``dsts`` or ``srcs`` of copy_ranges_) as a list, every item a tensor."""
    if isinstance(tensors, torch.Tensor):
        naming.fail(f"{name} must be a sequence of tensors, got one tensor; pass [tensor]")
    items = list(tensors)
    for k, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            naming.fail(f"{name}[{k}] is not a tensor (got {type(t).__name__})")
    return items


def _geometry(t: torch.Tensor) -> str:
    shape = ", ".join(str(x) for x in t.shape)
    strides = ", ".join(str(x) for x in t.stride()) if t.layout == torch.strided else ""
    return f"[{shape}] with strides [{strides}]"


def _check_layout(naming: Naming, t: torch.Tensor, name: str) -> None:
    strided_contiguous = t.layout == torch.strided and t.is_contiguous()
    if not naming.lists and not (strided_contiguous and t.dim() == 1):
        naming.fail(
            f"{name} must be a flat (1-D contiguous, strided) tensor, got shape {_geometry(t)}; view "
            "a contiguous buffer as 1-D with .view(-1) (a copy made by .contiguous() or .reshape() "
            "would not receive the writes)"
        )
    if naming.lists and not strided_contiguous:
        naming.fail(
            f"{name} must be a contiguous (strided) tensor, got shape {_geometry(t)}; pass the tensor "
            "that owns the memory (a copy made by .contiguous() would not receive the writes)"
        )


def _check_tensors(naming: Naming, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> torch.device:
    """The C++ ``check_tensors``: one device, one dtype, layout, a device the kernel supports,
    no destination whose write autograd would miss. Returns the device."""
    named = [(t, naming.tensor("dst", k)) for k, t in enumerate(dsts)]
    named += [(t, naming.tensor("src", k)) for k, t in enumerate(srcs)]
    if not named:
        return torch.device("cpu")
    first, first_name = named[0]
    for t, name in named:
        if t.device != first.device:
            naming.fail(
                f"{first_name} is on {first.device} but {name} is on {t.device}; move every tensor "
                "to one device"
            )
        if t.dtype != first.dtype:
            naming.fail(
                f"{first_name} has dtype {first.dtype} but {name} has dtype {t.dtype}; {naming.op} "
                f"does not convert, cast {name} first"
            )
    for t, name in named:
        _check_layout(naming, t, name)
    device = first.device
    # The reference can copy on any device; it refuses what every build of the kernel refuses.
    if device.type not in ("cpu", "cuda"):
        naming.fail(
            f"tensors on {device} are not supported by this build of verl._C (supported: cpu, and "
            "cuda when built with CUDA)"
        )
    for k, t in enumerate(dsts):
        if t.requires_grad and torch.is_grad_enabled():
            name = naming.tensor("dst", k)
            naming.fail(
                f"{name} requires grad and grad mode is on; the copy bypasses autograd, so call it "
                f"under torch.no_grad() (or pass {name}.detach())"
            )
    return device


def _rows(naming: Naming, table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The table on the host as [N, 5] (src_index, src_offset, dst_index, dst_offset, length)."""
    if table.device != device and table.device.type != "cpu":
        where = "the cpu" if device.type == "cpu" else f"the cpu or on {device}"
        naming.fail(f"ranges is on {table.device} but the tensors are on {device}; pass ranges on {where}")
    rows = table.cpu()
    if naming.lists:
        return rows
    zeros = torch.zeros_like(rows[:, :1])
    return torch.cat([zeros, rows[:, :1], zeros, rows[:, 1:]], dim=1)


def _check_rows(
    naming: Naming, dsts: list[torch.Tensor], srcs: list[torch.Tensor], rows: torch.Tensor
) -> None:
    """The C++ ``check_rows``: the first bad row in caller order, its first failing check."""
    si, s, di, d, n = rows.unbind(1)
    src_index_bad = (si < 0) | (si >= len(srcs))
    dst_index_bad = (di < 0) | (di >= len(dsts))
    negative = n < 0
    # Per-row numels; rows with a bad index look up any tensor (they fail on the index first).
    src_numels = torch.tensor([t.numel() for t in srcs] or [0], dtype=torch.int64)
    dst_numels = torch.tensor([t.numel() for t in dsts] or [0], dtype=torch.int64)
    src_numel = src_numels[si.clamp(0, max(len(srcs) - 1, 0))]
    dst_numel = dst_numels[di.clamp(0, max(len(dsts) - 1, 0))]
    # `offset > numel - length` cannot overflow for length >= 0 (negative lengths fail first).
    src_out = (s < 0) | (s > src_numel - n)
    dst_out = (d < 0) | (d > dst_numel - n)
    bad = torch.nonzero(src_index_bad | dst_index_bad | negative | src_out | dst_out).flatten()
    if not bad.numel():
        return
    i = int(bad[0])
    row = [int(v) for v in rows[i]]
    what = naming.describe(i, row)
    if src_index_bad[i]:
        naming.fail(f"{what} has src_index out of range; need 0 <= src_index < len(srcs) = {len(srcs)}")
    if dst_index_bad[i]:
        naming.fail(f"{what} has dst_index out of range; need 0 <= dst_index < len(dsts) = {len(dsts)}")
    if negative[i]:
        naming.fail(f"{what} has a negative length")
    if src_out[i]:
        src = naming.tensor("src", row[0])
        naming.fail(
            f"{what} reads outside {src} (numel {int(src_numel[i])}); need 0 <= src_offset and "
            f"src_offset + length <= {src}.numel()"
        )
    dst = naming.tensor("dst", row[2])
    naming.fail(
        f"{what} writes outside {dst} (numel {int(dst_numel[i])}); need 0 <= dst_offset and "
        f"dst_offset + length <= {dst}.numel()"
    )


def _check_overlaps(
    naming: Naming, dsts: list[torch.Tensor], srcs: list[torch.Tensor], rows: torch.Tensor
) -> torch.Tensor:
    """The C++ ``check_overlaps``, on byte addresses: writes pairwise disjoint, no read of a
    written byte. Returns the non-empty rows, in caller order."""
    nonempty = torch.nonzero(rows[:, 4] > 0).flatten()
    live = rows[nonempty]
    if not live.numel():
        return live
    si, s, di, d, n = live.unbind(1)
    elem = dsts[0].element_size()
    dst_base = torch.tensor([t.data_ptr() for t in dsts], dtype=torch.int64)
    src_base = torch.tensor([t.data_ptr() for t in srcs], dtype=torch.int64)
    write_begin = dst_base[di] + d * elem
    # By write address, ties in caller order: the writes are disjoint iff neighbours are.
    order = torch.sort(write_begin, stable=True).indices
    begin_sorted = write_begin[order]
    end_sorted = begin_sorted + n[order] * elem  # ascending once the writes are disjoint
    clash = torch.nonzero(end_sorted[:-1] > begin_sorted[1:]).flatten()
    if clash.numel():
        # The overlapping neighbours listed first (smallest lower index, then higher one), as
        # in C++: where separate allocations lie in memory must not change the message.
        # Positions in `live` (ascending with the row indices, so the same order).
        low = torch.minimum(order[clash], order[clash + 1])
        high = torch.maximum(order[clash], order[clash + 1])
        pick = int(torch.argmin(low * len(order) + high))
        a, b = int(low[pick]), int(high[pick])
        ia, ib = int(nonempty[a]), int(nonempty[b])
        da, db = naming.tensor("dst", int(di[a])), naming.tensor("dst", int(di[b]))
        where = da if int(di[a]) == int(di[b]) else f"the memory {da} and {db} share"
        tail = (
            "destination ranges must be disjoint in memory" if naming.lists else "dst ranges must be disjoint"
        )
        wrote_a, wrote_b = f"{da}[{int(d[a])}:{int(d[a] + n[a])}]", f"{db}[{int(d[b])}:{int(d[b] + n[b])}]"
        naming.fail(
            f"ranges {ia} and {ib} overlap in {where} (range {ia} writes {wrote_a}, range {ib} writes "
            f"{wrote_b}); {tail}"
        )

    read_begin = src_base[si] + s * elem
    read_end = read_begin + n * elem
    # First written range ending after each read begins: the only candidate overlap.
    k = torch.searchsorted(end_sorted, read_begin, right=True)
    inside = k < len(order)
    hit = torch.zeros_like(inside)
    hit[inside] = begin_sorted[k[inside]] < read_end[inside]
    first = torch.nonzero(hit).flatten()
    if first.numel():
        r, w = int(first[0]), int(order[k[first[0]]])
        src = naming.tensor("src", int(si[r]))
        dst = naming.tensor("dst", int(di[w]))
        tail = (
            "when sources and destinations share memory, no range may read what any range writes "
            "(copy the source to a separate buffer first)"
            if naming.lists
            else "when src and dst view one buffer, no range may read what another writes (copy src "
            "to a separate buffer first)"
        )
        naming.fail(
            f"range {int(nonempty[r])} reads {src}[{int(s[r])}:{int(s[r] + n[r])}], which shares memory "
            f"with {dst}[{int(d[w])}:{int(d[w] + n[w])}] written by range {int(nonempty[w])}; {tail}"
        )
    return live


def validate(
    naming: Naming, dsts: list[torch.Tensor], srcs: list[torch.Tensor], table: torch.Tensor
) -> torch.Tensor:
    """Every check of the C++ entry point, in its order (``table`` from :func:`as_table`, whose
    form the C++ side checks again). Returns the non-empty rows ``[M, 5]`` (src_index,
    src_offset, dst_index, dst_offset, length), caller order, on the host."""
    device = _check_tensors(naming, dsts, srcs)
    rows = _rows(naming, table, device)
    _check_rows(naming, dsts, srcs, rows)
    return _check_overlaps(naming, dsts, srcs, rows)


def copy_reference(
    naming: Naming, dsts: list[torch.Tensor], srcs: list[torch.Tensor], table: torch.Tensor
) -> None:
    """The pure-PyTorch copy: :func:`validate`, then one ``copy_`` per non-empty range (in
    caller order; the checks make the order irrelevant)."""
    live = validate(naming, dsts, srcs, table)
    with torch.no_grad():  # like the kernel: a raw copy, not an autograd op
        for si, s, di, d, n in live.tolist():
            dsts[di].view(-1).narrow(0, d, n).copy_(srcs[si].view(-1).narrow(0, s, n))
