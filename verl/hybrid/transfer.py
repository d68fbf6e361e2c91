"""Executing a reshard plan on one rank: local copies, then buckets exchanged with every peer in turn.

Schedule (the same on gloo and NCCL): step 0 copies the ranges this rank both holds and needs,
tensor to tensor, with one ``copy_ranges_`` call. Step ``k`` (1 .. W-1) sends to rank
``rank + k`` and receives from ``rank - k`` (mod W): the ranges of each pair, in the plan's
order, are cut into buckets of at most ``bucket_elements`` (a range crossing a bucket border
is split; sender and receiver cut the same way, from the same plan); for each bucket the
sender packs its ranges into the send buffer with one ``copy_ranges_`` call (``verl._C``), the two sides
post ``isend``/``irecv`` together, and the receiver unpacks the receive buffer with one call
straight into the destination tensors. A pair with nothing to move costs nothing, so with
TP == TP' and PP = 1 nothing crosses the network.

Everything that depends on the plan alone (the ranges of each peer, their cuts into buckets, the
range tables the copies take, the buffer size) is worked out on a rank's first push and kept on the
plan (:func:`schedule`): a later push runs one ``copy_ranges_`` call per bucket and per side and no
per-range Python.

Memory: one send and one receive buffer, each at most a bucket and at most half the largest piece
moved (the most of one tensor exchanged with one peer: ``ReshardPlan.bucket_elements``), allocated
once per push: peak extra memory <= min(2 x bucket, that piece), at or below the naive path's, which
holds the whole tensor (plus one cast buffer when the actor's dtype differs from the engine's, where
the receiver casts the bucket before unpacking).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from verl.hybrid.copy_ranges import copy_ranges_
from verl.hybrid.plan import DST_OFFSET, DST_TENSOR, LENGTH, SRC_OFFSET, SRC_TENSOR, ReshardPlan

__all__ = ["Schedule", "TransferStats", "bucket_cuts", "execute_plan", "schedule"]


@dataclass(frozen=True)
class TransferStats:
    """What one rank moved in :func:`execute_plan` (bytes) and how long it took."""

    local_bytes: int
    sent_bytes: int
    received_bytes: int
    buffer_bytes: int
    """Bytes of the send, receive (and cast) buffers allocated: the push's extra memory."""
    local_seconds: float
    """Time of the local copies (step 0)."""
    seconds: float
    """Time of the whole push on this rank."""


def bucket_cuts(ranges: np.ndarray, bucket_elements: int) -> list[np.ndarray]:
    """Cut ``ranges`` [N, 5] into buckets of at most ``bucket_elements``; returns, per bucket, ranges
    [M, 6]: the 5 plan columns plus the range's offset inside the bucket (splitting ranges at the borders)."""
    if bucket_elements < 1:
        raise ValueError(f"bucket size must be >= 1 element, got {bucket_elements}")
    if len(ranges) == 0:
        return []
    lengths = ranges[:, LENGTH]
    ends = np.cumsum(lengths)
    starts = ends - lengths
    total = int(ends[-1])
    out = []
    for b0 in range(0, total, bucket_elements):
        b1 = min(b0 + bucket_elements, total)
        sel = np.nonzero((ends > b0) & (starts < b1))[0]
        part = ranges[sel].copy()
        lo = np.maximum(starts[sel], b0)
        hi = np.minimum(ends[sel], b1)
        skip = lo - starts[sel]
        part[:, SRC_OFFSET] += skip
        part[:, DST_OFFSET] += skip
        part[:, LENGTH] = hi - lo
        out.append(np.concatenate([part, (lo - b0)[:, None]], axis=1))
    return out


def _pack_ranges(cut: np.ndarray) -> torch.Tensor:
    """(src tensor, src offset, bucket 0, bucket offset, length) rows of a bucket cut."""
    r = np.stack([cut[:, SRC_TENSOR], cut[:, SRC_OFFSET], np.zeros(len(cut), np.int64), cut[:, 5], cut[:, LENGTH]], 1)
    return torch.from_numpy(np.ascontiguousarray(r))


def _unpack_ranges(cut: np.ndarray) -> torch.Tensor:
    """(bucket 0, bucket offset, dst tensor, dst offset, length) rows of a bucket cut."""
    r = np.stack([np.zeros(len(cut), np.int64), cut[:, 5], cut[:, DST_TENSOR], cut[:, DST_OFFSET], cut[:, LENGTH]], 1)
    return torch.from_numpy(np.ascontiguousarray(r))


@dataclass(frozen=True)
class _Bucket:
    """One bucket of a peer step: its elements and the range tables that pack it (sender) or unpack it
    (receiver), int64 [M, 5] on the CPU."""

    elements: int
    pack: torch.Tensor
    unpack: torch.Tensor


def _buckets(ranges: np.ndarray, size: int) -> tuple[_Bucket, ...]:
    cuts = bucket_cuts(ranges, size) if size else []
    return tuple(_Bucket(int(c[-1, 5] + c[-1, LENGTH]), _pack_ranges(c), _unpack_ranges(c)) for c in cuts)


@dataclass(frozen=True)
class Schedule:
    """One rank's push of a plan, worked out once (:func:`schedule`): what :func:`execute_plan` runs."""

    size: int
    """Elements of each transfer buffer (:meth:`ReshardPlan.bucket_elements`)."""
    local_elements: int
    local_table: torch.Tensor
    """The same-rank ranges, int64 [N, 5]: one tensor-to-tensor call."""
    local_buckets: tuple[_Bucket, ...]
    """The same-rank ranges through the buffers (a cast on the way), when the dtypes differ."""
    sends: tuple[tuple[_Bucket, ...], ...]
    """Step k (1 .. W-1): the buckets to rank + k."""
    recvs: tuple[tuple[_Bucket, ...], ...]
    """Step k: the buckets from rank - k."""


def schedule(plan: ReshardPlan, rank: int, bucket_elements: int, *, cast: bool) -> Schedule:
    """``rank``'s :class:`Schedule` of ``plan`` for this bucket size (``cast``: the two sides' dtypes differ),
    computed on first use and kept on the plan (a plan is not changed once built)."""
    key = (rank, bucket_elements, cast)
    cached = plan.schedules.get(key)
    if cached is not None:
        return cached
    world = plan.world_size
    size = plan.bucket_elements(rank, bucket_elements, local=cast)
    local = plan.ranges(rank, rank)
    made = Schedule(
        size=size,
        local_elements=int(local[:, LENGTH].sum()),
        local_table=torch.from_numpy(np.ascontiguousarray(local)),
        local_buckets=_buckets(local, size) if cast else (),
        sends=tuple(_buckets(plan.ranges(rank, (rank + k) % world), size) for k in range(1, world)),
        recvs=tuple(_buckets(plan.ranges((rank - k) % world, rank), size) for k in range(1, world)),
    )
    plan.schedules[key] = made
    return made


def _single_dtype(tensors: Sequence[torch.Tensor], what: str) -> torch.dtype:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise ValueError(f"{what} tensors have several dtypes {sorted(map(str, dtypes))}; the transfer needs one")
    return next(iter(dtypes))


@torch.no_grad()
def execute_plan(
    plan: ReshardPlan,
    rank: int,
    sources: Sequence[torch.Tensor],
    destinations: Sequence[torch.Tensor],
    *,
    bucket_elements: int,
    group: dist.ProcessGroup | None = None,
    source_dtype: torch.dtype | None = None,
    device: torch.device | None = None,
) -> TransferStats:
    """Move this rank's part of ``plan`` (collective over ``group``, every rank calls it).

    ``sources`` / ``destinations``: this rank's tensors in ``plan.src_keys[rank]`` /
    ``plan.dst_keys[rank]`` order, contiguous, one dtype per side, on one device. A rank may hold
    no sources (it only receives: give ``source_dtype``, what its peers send) or no destinations
    (it only sends: give ``device``, where its buffers live), as when the rollout engine runs on
    ranks apart from the actor's.
    """
    start = time.perf_counter()
    world = plan.world_size
    if sources:
        src_dtype = _single_dtype(sources, "source")
        if source_dtype is not None and source_dtype != src_dtype:
            raise ValueError(f"execute_plan: source_dtype={source_dtype} but the sources are {src_dtype}")
    elif source_dtype is not None:
        src_dtype = source_dtype
    else:
        raise ValueError("execute_plan: this rank holds no sources; pass source_dtype (what its peers send)")
    dst_dtype = _single_dtype(destinations, "destination") if destinations else src_dtype
    if device is None:
        if not (destinations or sources):
            raise ValueError("execute_plan: this rank holds no tensors; pass device (where its buffers live)")
        device = (destinations or sources)[0].device
    elem = torch.empty((), dtype=src_dtype).element_size()
    cast_needed = src_dtype != dst_dtype
    # Buffers sized to the transfer: a bucket, or the largest piece this rank moves when smaller.
    plan_of = schedule(plan, rank, bucket_elements, cast=cast_needed)
    size = plan_of.size
    send_buf = torch.empty(size, dtype=src_dtype, device=device)
    recv_buf = torch.empty(size, dtype=src_dtype, device=device)
    cast_buf = torch.empty(size if cast_needed else 0, dtype=dst_dtype, device=device)
    buffer_bytes = 2 * size * elem + cast_buf.numel() * cast_buf.element_size()
    srcs, dsts = list(sources), list(destinations)

    def unpack(buf: torch.Tensor, bucket: _Bucket) -> None:
        if cast_needed:
            cast_buf[: bucket.elements].copy_(buf[: bucket.elements])
            buf = cast_buf
        copy_ranges_(dsts, [buf], bucket.unpack)

    local_start = time.perf_counter()
    if plan_of.local_elements:
        if cast_needed:  # through the buffers, cast on the way
            for bucket in plan_of.local_buckets:
                copy_ranges_([send_buf], srcs, bucket.pack)
                unpack(send_buf, bucket)
        else:
            copy_ranges_(dsts, srcs, plan_of.local_table)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    local_seconds = time.perf_counter() - local_start
    sent = received = 0
    for k in range(1, world):
        to, frm = (rank + k) % world, (rank - k) % world
        out_buckets, in_buckets = plan_of.sends[k - 1], plan_of.recvs[k - 1]
        for j in range(max(len(out_buckets), len(in_buckets))):
            ops = []
            if j < len(out_buckets):
                n = out_buckets[j].elements
                copy_ranges_([send_buf], srcs, out_buckets[j].pack)
                ops.append(dist.P2POp(dist.isend, send_buf[:n], _peer(to, group), group))
                sent += n
            if j < len(in_buckets):
                n = in_buckets[j].elements
                ops.append(dist.P2POp(dist.irecv, recv_buf[:n], _peer(frm, group), group))
                received += n
            for req in dist.batch_isend_irecv(ops):
                req.wait()
            if j < len(in_buckets):
                unpack(recv_buf, in_buckets[j])
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return TransferStats(
        local_bytes=plan_of.local_elements * elem,
        sent_bytes=sent * elem,
        received_bytes=received * elem,
        buffer_bytes=buffer_bytes,
        local_seconds=local_seconds,
        seconds=time.perf_counter() - start,
    )


def _peer(group_rank: int, group: dist.ProcessGroup | None) -> int:
    """The global rank of ``group_rank`` (P2P ops take global ranks)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)
