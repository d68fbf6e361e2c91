"""Bounds-checked copy of many element ranges between flat tensors (``verl._C.copy_shards_``).

Resharding weights from the training layout to the rollout layout is, per bucket, a list of
"copy these ``length`` elements of that flat shard to this offset of the flat bucket". One
call moves all of them: on CPU in parallel over threads, on CUDA in one kernel launch on the
current stream.

``ranges`` is an int64 tensor ``[N, 3]`` (or a list of ``(src_offset, dst_offset, length)``
tuples), in element units. Every range is checked before anything is written:

- ``length >= 0``; ``0 <= src_offset`` and ``src_offset + length <= src.numel()``; the same
  for dst;
- the dst ranges are pairwise disjoint (zero-length ranges overlap nothing);
- when src and dst view one buffer (an in-place shuffle), no range reads memory that any
  range writes, since the copies run in parallel and in no fixed order;
- dst and src are flat (1-D contiguous) tensors of one dtype (any dtype) on one device.

A violation raises ``ValueError`` naming the range and its offsets, and dst is left as it
was. The copy bypasses autograd: dst must not require grad while grad mode is on.

``copy_shards_reference_`` is the pure-PyTorch reference with the same checks and the same
messages; tests compare the two.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

RangesLike = torch.Tensor | Sequence[Sequence[int]]

__all__ = ["copy_shards_", "copy_shards_reference_", "as_ranges", "extension_has_cuda"]


def _extension() -> ModuleType:
    """Import ``verl._C`` (torch is already imported, so libc10 resolves)."""
    try:
        from verl import _C
    except ImportError as exc:
        raise ImportError(
            "verl._C is not built; build it from the repository root with "
            "`pip install --no-build-isolation -e .` (or bash tools/setup_env.sh)"
        ) from exc
    return _C


def extension_has_cuda() -> bool:
    """Whether the installed ``verl._C`` carries the CUDA kernel."""
    return bool(_extension().with_cuda)


def as_ranges(ranges: RangesLike) -> torch.Tensor:
    """Ranges as the int64 ``[N, 3]`` tensor the kernel takes (a tensor keeps its device).

    Accepts an integer tensor ``[N, 3]`` or a sequence of ``(src_offset, dst_offset, length)``.
    """
    if isinstance(ranges, torch.Tensor):
        if ranges.dtype.is_floating_point or ranges.dtype.is_complex or ranges.dtype == torch.bool:
            raise ValueError(
                f"copy_shards_: ranges must hold integers (int64 [N, 3]), got dtype {ranges.dtype}"
            )
        tensor = ranges.to(torch.int64)
    else:
        rows = [tuple(row) for row in ranges]
        bad = next((i for i, row in enumerate(rows) if len(row) != 3), None)
        if bad is not None:
            raise ValueError(
                f"copy_shards_: ranges[{bad}] = {rows[bad]!r} is not a "
                "(src_offset, dst_offset, length) triple"
            )
        tensor = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), 3)
    if tensor.dim() != 2 or tensor.shape[1] != 3:
        raise ValueError(
            "copy_shards_: ranges must be an int64 tensor of shape [N, 3] holding (src_offset, "
            f"dst_offset, length) rows, got shape {list(tensor.shape)}"
        )
    return tensor


def _check_autograd(dst: torch.Tensor) -> None:
    if dst.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            "copy_shards_: dst requires grad and grad mode is on; the copy bypasses autograd, "
            "so call it under torch.no_grad() (or pass dst.detach())"
        )


def copy_shards_(dst: torch.Tensor, src: torch.Tensor, ranges: RangesLike) -> torch.Tensor:
    """Copy ``src[s:s+n]`` into ``dst[d:d+n]`` for every ``(s, d, n)`` in ``ranges``; returns dst.

    dst, src: flat tensors ``[numel]``, one dtype and device. ranges: int64 ``[N, 3]`` or a
    list of triples (put a tensor on CPU: ranges on a GPU are read back to the host for the
    checks). Raises ValueError, with dst untouched, on any invalid range (see module doc).
    """
    _check_autograd(dst)
    table = as_ranges(ranges)
    _extension().copy_shards_(dst, src, table)
    # The kernel writes dst's memory directly; tell autograd that dst changed.
    torch.autograd.graph.increment_version(dst)
    return dst


def _fail(message: str) -> None:
    raise ValueError(f"copy_shards_: {message}")


def _describe(i: int, s: int, d: int, n: int) -> str:
    return f"range {i} (src_offset={s}, dst_offset={d}, length={n})"


def _check_flat(t: torch.Tensor, name: str) -> None:
    if t.layout != torch.strided or t.dim() != 1 or not t.is_contiguous():
        shape = ", ".join(str(x) for x in t.shape)
        strides = ", ".join(str(x) for x in t.stride()) if t.layout == torch.strided else ""
        _fail(
            f"{name} must be a flat (1-D contiguous, strided) tensor, got shape [{shape}] with "
            f"strides [{strides}]; view a contiguous buffer as 1-D with .view(-1) (a copy made "
            "by .contiguous() or .reshape() would not receive the writes)"
        )


def _validate(dst: torch.Tensor, src: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The checks of the C++ ``check_copy_shards_args``, in the same order and words.

    Returns the indices of the non-empty ranges (caller order).
    """
    if dst.device != src.device:
        _fail(f"dst is on {dst.device} but src is on {src.device}; move both to the same device")
    if dst.dtype != src.dtype:
        _fail(
            f"dst has dtype {dst.dtype} but src has dtype {src.dtype}; copy_shards_ does not "
            "convert, cast src first"
        )
    _check_flat(dst, "dst")
    _check_flat(src, "src")

    rows = table.cpu()
    s, d, n = rows[:, 0], rows[:, 1], rows[:, 2]
    src_numel, dst_numel = src.numel(), dst.numel()
    negative = n < 0
    src_out = (s < 0) | (s > src_numel - n)
    dst_out = (d < 0) | (d > dst_numel - n)
    bad = torch.nonzero(negative | src_out | dst_out).flatten()
    if bad.numel():
        i = int(bad[0])
        si, di, ni = (int(v) for v in rows[i])
        if negative[i]:
            _fail(f"{_describe(i, si, di, ni)} has a negative length")
        if src_out[i]:
            _fail(
                f"{_describe(i, si, di, ni)} reads outside src (numel {src_numel}); need "
                "0 <= src_offset and src_offset + length <= src.numel()"
            )
        _fail(
            f"{_describe(i, si, di, ni)} writes outside dst (numel {dst_numel}); need "
            "0 <= dst_offset and dst_offset + length <= dst.numel()"
        )

    nonempty = torch.nonzero(n > 0).flatten()
    # By dst offset, ties in caller order: the dst ranges are disjoint iff neighbours are.
    order = nonempty[torch.sort(d[nonempty], stable=True).indices]
    ends = d[order] + n[order]
    clash = torch.nonzero(ends[:-1] > d[order][1:]).flatten()
    if clash.numel():
        k = int(clash[0])
        a, b = int(order[k]), int(order[k + 1])
        da, na, db, nb = int(d[a]), int(n[a]), int(d[b]), int(n[b])
        _fail(
            f"ranges {a} and {b} overlap in dst (range {a} writes dst[{da}:{da + na}], range {b} "
            f"writes dst[{db}:{db + nb}]); dst ranges must be disjoint"
        )

    elem = dst.element_size()
    src_base, dst_base = src.data_ptr(), dst.data_ptr()
    shares_memory = src_base < dst_base + dst_numel * elem and dst_base < src_base + src_numel * elem
    if order.numel() and shares_memory:
        write_begin = dst_base + d[order] * elem
        write_end = dst_base + ends * elem  # ascending: the dst ranges are disjoint
        read_begin = src_base + s[nonempty] * elem
        read_end = read_begin + n[nonempty] * elem
        # First written range ending after each read begins: the only candidate overlap.
        k = torch.searchsorted(write_end, read_begin, right=True)
        inside = k < order.numel()
        hit = torch.zeros_like(inside)
        hit[inside] = write_begin[k[inside]] < read_end[inside]
        first = torch.nonzero(hit).flatten()
        if first.numel():
            i = int(nonempty[first[0]])
            j = int(order[k[first[0]]])
            si, ni, dj, nj = int(s[i]), int(n[i]), int(d[j]), int(n[j])
            _fail(
                f"range {i} reads src[{si}:{si + ni}], which shares memory with dst[{dj}:{dj + nj}] "
                f"written by range {j}; when src and dst view one buffer, no range may read what "
                "another writes (copy src to a separate buffer first)"
            )
    return nonempty


def copy_shards_reference_(dst: torch.Tensor, src: torch.Tensor, ranges: RangesLike) -> torch.Tensor:
    """Pure-PyTorch ``copy_shards_``: same checks and messages, one ``copy_`` per range."""
    _check_autograd(dst)
    table = as_ranges(ranges)
    nonempty = _validate(dst, src, table)
    rows = table.cpu().tolist()
    with torch.no_grad():  # like the kernel: a raw copy, not an autograd op
        for i in nonempty.tolist():
            s, d, n = rows[i]
            dst.narrow(0, d, n).copy_(src.narrow(0, s, n))
    return dst
