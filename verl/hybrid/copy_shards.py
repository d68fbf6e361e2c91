"""Bounds-checked copy of many element ranges between two flat tensors (``verl._C.copy_shards_``).

Resharding weights from the training layout to the rollout layout is, per bucket, a list of
"copy these ``length`` elements of that flat shard to this offset of the flat bucket". One
call moves all of them: on CPU in parallel over threads, on CUDA in one kernel launch on the
current stream. :func:`verl.hybrid.copy_ranges.copy_ranges_` is the general form (many
source and destination tensors in one call); this is its one-to-one case, with the same
checks and the same copy core.

``ranges`` is an int64 tensor ``[N, 3]`` (or a list of ``(src_offset, dst_offset, length)``
tuples), in element units, on the CPU or on the tensors' device. Every range is checked
before anything is written:

- ``length >= 0``; ``0 <= src_offset`` and ``src_offset + length <= src.numel()``; the same
  for dst;
- the dst ranges are pairwise disjoint (zero-length ranges overlap nothing);
- when src and dst view one buffer (an in-place shuffle), no range reads memory that any
  range writes, since the copies run in parallel and in no fixed order;
- dst and src are flat (1-D contiguous) tensors of one dtype (any dtype) on one device;
- the copy bypasses autograd: dst must not require grad while grad mode is on.

A violation raises ``ValueError`` naming the range and its offsets, and dst is left as it
was. ``copy_shards_reference_`` is the pure-PyTorch reference with the same checks and the
same messages (verl/hybrid/range_checks.py); tests compare the two.
"""

from __future__ import annotations

import torch

from verl.hybrid.range_checks import (
    SHARDS,
    RangesLike,
    as_table,
    copy_reference,
    extension,
    extension_has_cuda,
)

__all__ = ["as_ranges", "copy_shards_", "copy_shards_reference_", "extension_has_cuda"]


def as_ranges(ranges: RangesLike) -> torch.Tensor:
    """Ranges as the int64 ``[N, 3]`` tensor the kernel takes (a tensor keeps its device).

    Accepts an integer tensor ``[N, 3]`` or a sequence of ``(src_offset, dst_offset, length)``.
    """
    return as_table(SHARDS, ranges)


def copy_shards_(dst: torch.Tensor, src: torch.Tensor, ranges: RangesLike) -> torch.Tensor:
    """Copy ``src[s:s+n]`` into ``dst[d:d+n]`` for every ``(s, d, n)`` in ``ranges``; returns dst.

    dst, src: flat tensors ``[numel]``, one dtype and device. ranges: int64 ``[N, 3]`` or a
    list of triples (put a tensor on CPU: ranges on a GPU are read back to the host for the
    checks). Raises ValueError, with dst untouched, on any invalid range (see module doc).
    """
    extension().copy_shards_(dst, src, as_ranges(ranges))
    # The kernel writes dst's memory directly; tell autograd that dst changed.
    torch.autograd.graph.increment_version(dst)
    return dst


def copy_shards_reference_(dst: torch.Tensor, src: torch.Tensor, ranges: RangesLike) -> torch.Tensor:
    """Pure-PyTorch ``copy_shards_``: same checks and messages, one ``copy_`` per range."""
    copy_reference(SHARDS, [dst], [src], as_ranges(ranges))
    return dst
