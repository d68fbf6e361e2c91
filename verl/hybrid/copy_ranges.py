"""Bounds-checked copy of many element ranges between many tensors (``verl._C.copy_ranges_``).

The hybrid engine moves weights through flat buckets: a source rank packs many ranges of
many of its parameter tensors into one bucket, the receiver unpacks the bucket straight
into many destination parameters, and ranges whose both ends live on one rank go tensor to
tensor. Each of those is ONE call here: on CPU in parallel over threads, on CUDA in one
kernel launch on the current stream.

``copy_ranges_(dsts, srcs, ranges)``: for every row ``(src_index, src_offset, dst_index,
dst_offset, length)`` of ``ranges``,
``dsts[dst_index].view(-1)[dst_offset : dst_offset + length] =
srcs[src_index].view(-1)[src_offset : src_offset + length]``, in element units.

``ranges`` is an int64 tensor ``[N, 5]`` (or a sequence of 5-tuples), on the CPU or on the
tensors' device. Every row is checked before anything is written:

- ``0 <= src_index < len(srcs)`` and ``0 <= dst_index < len(dsts)``;
- ``length >= 0``; ``0 <= src_offset`` and ``src_offset + length <= srcs[src_index].numel()``;
  the same for the destination (no int64 overflow: huge values are refused, not wrapped);
- destination ranges are pairwise disjoint in memory: within each destination tensor, and
  across destinations that share memory (zero-length ranges overlap nothing);
- when sources and destinations share memory (one tensor in both lists, views of one
  buffer, an in-place permutation), no range reads memory that any range writes, since the
  copies run in parallel and in no fixed order;
- all tensors are contiguous (any shape: they are viewed flat), of one dtype (any dtype),
  on one device; a tensor may appear several times in either list;
- the copy bypasses autograd: no destination may require grad while grad mode is on.

A violation raises ``ValueError`` naming the row, its tensor indices and offsets, and no
tensor is written. ``copy_ranges_reference_`` is the pure-PyTorch reference with the same
checks and the same messages (verl/hybrid/range_checks.py); tests compare the two.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from verl.hybrid.range_checks import RANGES, RangesLike, as_table, as_tensor_list, copy_reference, extension

__all__ = ["as_range_table", "copy_ranges_", "copy_ranges_reference_"]


def as_range_table(ranges: RangesLike) -> torch.Tensor:
    """Ranges as the int64 ``[N, 5]`` tensor the kernel takes (a tensor keeps its device).

    Accepts an integer tensor ``[N, 5]`` or a sequence of
    ``(src_index, src_offset, dst_index, dst_offset, length)``.
    """
    return as_table(RANGES, ranges)


def _arguments(
    dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], ranges: RangesLike
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """The arguments as the kernel takes them; the Python-only checks (the C++ side sees
    lists of tensors and a tensor table by then)."""
    table = as_range_table(ranges)
    return as_tensor_list(RANGES, dsts, "dsts"), as_tensor_list(RANGES, srcs, "srcs"), table


def copy_ranges_(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], ranges: RangesLike) -> None:
    """Copy ``srcs[i].view(-1)[s:s+n]`` into ``dsts[j].view(-1)[d:d+n]`` for every row
    ``(i, s, j, d, n)`` of ``ranges`` (int64 ``[N, 5]`` or 5-tuples, element units).

    dsts, srcs: contiguous tensors of one dtype and device, any shapes. Raises ValueError,
    writing nothing, on any invalid row (see module doc).
    """
    dst_list, src_list, table = _arguments(dsts, srcs, ranges)
    extension().copy_ranges_(dst_list, src_list, table)
    # The kernel writes the destinations' memory directly; tell autograd they changed.
    torch.autograd.graph.increment_version(dst_list)


def copy_ranges_reference_(
    dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], ranges: RangesLike
) -> None:
    """Pure-PyTorch ``copy_ranges_``: same checks and messages, one ``copy_`` per range."""
    copy_reference(RANGES, *_arguments(dsts, srcs, ranges))
