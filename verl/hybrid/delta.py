"""Delta pushes: only the blocks of the actor's weights that changed since the last push cross the wire.

For a rollout engine apart from the actor (``DisaggregatedSync``), where every push crosses the
network, ``actor_rollout_ref.rollout.update_weights_mode=delta`` (the reference verl calls its
push ``delta_sharded``; both names are accepted) runs the same reshard plan and the same buckets
as :func:`verl.hybrid.transfer.execute_plan`, but per bucket:

- the sender packs the bucket, compares it block by block (``update_weights_delta_block_bytes``)
  with what it sent for that bucket last time (a host copy it keeps: one copy of the shards this
  rank sends), and sends a header (a bitmask of the changed blocks and a checksum of the WHOLE
  bucket) and then only the changed blocks;
- the receiver gathers the bucket's current values from the engine's own tensors, overwrites the
  changed blocks with what arrived, checks the bucket against the checksum, and unpacks it.

So the checksum proves, bucket by bucket, that the engine holds bit for bit what the actor
holds, whatever happened on the wire or to the engine's tensors in between (a block corrupted
in flight, an engine reloaded or written by someone else). A failed check anywhere (the ranks
agree with one all-reduce) makes the whole push run again in full; so do the first push and
every ``update_weights_full_every``-th. Comparisons and checksums are on the bits (integer views),
so ``-0.0``/``+0.0`` and NaN payloads are told apart and nothing is rounded.

Memory beyond :func:`execute_plan`'s buffers: the host copy of the sent shards (sender), one
bucket-sized comparison buffer on an accelerator, the changed blocks' mask and payload (at
most a bucket each), and checksum temporaries of at most ``_CHECKSUM_CHUNK`` elements.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from verl.hybrid.copy_ranges import copy_ranges_
from verl.hybrid.plan import DST_OFFSET, DST_TENSOR, LENGTH, ReshardPlan
from verl.hybrid.transfer import _pack_ranges, _peer, _single_dtype, _unpack_ranges, bucket_cuts

logger = logging.getLogger(__name__)

__all__ = ["DeltaStats", "DeltaTransfer", "bucket_checksum"]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHECKSUM_CHUNK = 1 << 20
_HEADER = 3  # [changed blocks, checksum sum, checksum position-weighted sum], then the blocks' bitmask
_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers of its element size (a view)."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def bucket_checksum(buf: torch.Tensor) -> tuple[int, int]:
    """Two 64-bit sums of ``buf``'s bits (1-D): the plain sum and a position-weighted one (so two
    swapped elements differ). Integer arithmetic (wrapping), so the same on every device."""
    bits = _bits(buf)
    plain = weighted = 0
    mask = (1 << 64) - 1
    for start in range(0, bits.numel(), _CHECKSUM_CHUNK):
        part = bits[start:start + _CHECKSUM_CHUNK].to(torch.int64)
        weights = torch.arange(start, start + part.numel(), dtype=torch.int64, device=part.device) % 65521 + 1
        plain = (plain + int(part.sum())) & mask
        weighted = (weighted + int((part * weights).sum())) & mask
    # As signed int64, to travel in an int64 header.
    return tuple(v - (1 << 64) if v >= 1 << 63 else v for v in (plain, weighted))  # type: ignore[return-value]


@dataclass(frozen=True)
class DeltaStats:
    """What one rank moved in one :meth:`DeltaTransfer.push`."""

    full: bool
    """Whether every block was sent (a first, a scheduled, or a redone push)."""
    sent_bytes: int
    """Bytes this rank sent: headers and changed blocks."""
    received_bytes: int
    full_bytes: int
    """Bytes this rank would have sent in a full push (the plan's share, without headers)."""
    blocks_sent: int
    blocks_total: int
    checksum_failures: int
    """Buckets whose checksum failed in this push, over the whole world (then it was redone in full)."""
    buffer_bytes: int
    seconds: float


class DeltaTransfer:
    """Executes a reshard plan push after push, sending only changed blocks (module docstring).

    Args:
        plan: the reshard plan (the same on every rank).
        rank: this rank in ``group``.
        bucket_elements: bucket size, in source elements.
        block_elements: the unit of change, in source elements.
        full_every: pushes 1, 1 + full_every, 1 + 2 full_every, ... send everything (at most
            ``full_every - 1`` delta pushes in a row); 1: every push is full.
        source_dtype: the actor's dtype (what is sent); dest_dtype: the engine's.
        device: where this rank's buffers live.
        group: the process group the plan's ranks are ranks of (None: the world).
    """

    def __init__(self, plan: ReshardPlan, rank: int, *, bucket_elements: int, block_elements: int, full_every: int,
                 source_dtype: torch.dtype, dest_dtype: torch.dtype, device: torch.device,
                 group: dist.ProcessGroup | None = None) -> None:
        if block_elements < 1 or full_every < 1 or bucket_elements < 1:
            raise ValueError(
                f"DeltaTransfer: bucket_elements={bucket_elements}, block_elements={block_elements}, "
                f"full_every={full_every}; each must be >= 1"
            )
        self.plan, self.rank, self.group = plan, rank, group
        self.block = block_elements
        self.full_every = full_every
        self.source_dtype, self.dest_dtype, self.device = source_dtype, dest_dtype, device
        self.size = plan.bucket_elements(rank, bucket_elements, local=source_dtype != dest_dtype)
        self.pushes = 0
        # (peer, bucket index) -> what this rank last sent of that bucket (host memory).
        self._sent: dict[tuple[int, int], torch.Tensor] = {}

    def _full_due(self) -> bool:
        return self.pushes == 0 or self.pushes % self.full_every == 0

    @torch.no_grad()
    def push(self, sources: Sequence[torch.Tensor], destinations: Sequence[torch.Tensor]) -> DeltaStats:
        """One push (collective over the group): in full when due, else the changed blocks; redone
        in full when any bucket's checksum failed anywhere."""
        start = time.perf_counter()
        if sources:
            _single_dtype(sources, "source")
        if destinations:
            _single_dtype(destinations, "destination")
        full = self._full_due()
        stats = self._run(sources, destinations, full=full)
        failures = torch.tensor([stats[3]], dtype=torch.int64, device=self._reduce_device())
        dist.all_reduce(failures, group=self.group)
        redone = int(failures.item())
        if redone and dist.get_rank(self.group) == 0:
            logger.warning(
                "delta weight push: %d bucket(s) failed their checksum (the engine's weights differed from what "
                "the actor sent); redoing the push in full", redone,
            )
        if redone:
            first = stats
            stats = self._run(sources, destinations, full=True)
            stats = (stats[0] + first[0], stats[1] + first[1], stats[2], 0, stats[4], stats[5], stats[6])
        self.pushes += 1
        sent, received, full_elements, _, blocks_sent, blocks_total, buffer_bytes = stats
        elem = torch.empty((), dtype=self.source_dtype).element_size()
        return DeltaStats(
            full=full or bool(redone), sent_bytes=sent, received_bytes=received,
            full_bytes=full_elements * elem, blocks_sent=blocks_sent, blocks_total=blocks_total,
            checksum_failures=redone, buffer_bytes=buffer_bytes, seconds=time.perf_counter() - start,
        )

    def _reduce_device(self) -> torch.device:
        backend = dist.get_backend(self.group)
        return self.device if backend == "nccl" else torch.device("cpu")

    def _run(self, sources: Sequence[torch.Tensor], destinations: Sequence[torch.Tensor], *, full: bool):
        plan, rank, size, block = self.plan, self.rank, self.size, self.block
        world = plan.world_size
        send_buf = torch.empty(size, dtype=self.source_dtype, device=self.device)
        recv_buf = torch.empty(size, dtype=self.source_dtype, device=self.device)
        # The receiver rebuilds and checks buckets in the engine's dtype, beside the payload received.
        work_buf = torch.empty(size, dtype=self.dest_dtype, device=self.device)
        previous = torch.empty(size if self.device.type != "cpu" else 0, dtype=self.source_dtype, device=self.device)
        elem = send_buf.element_size()
        buffer_bytes = (send_buf.numel() + recv_buf.numel() + previous.numel()) * elem + (
            work_buf.numel() * work_buf.element_size()
        )
        local = plan.ranges(rank, rank)
        if len(local):  # a rank both sends and receives: copied, nothing crosses the wire
            for cut in bucket_cuts(local, size):
                copy_ranges_([send_buf], list(sources), _pack_ranges(cut))
                work_buf[: _extent(cut)].copy_(send_buf[: _extent(cut)])
                copy_ranges_(list(destinations), [work_buf], _unpack_ranges(cut))
        sent = received = full_elements = failures = blocks_sent = blocks_total = 0
        for k in range(1, world):
            to, frm = (rank + k) % world, (rank - k) % world
            out_cuts = bucket_cuts(plan.ranges(rank, to), size) if size else []
            in_cuts = bucket_cuts(plan.ranges(frm, rank), size) if size else []
            for j in range(max(len(out_cuts), len(in_cuts))):
                header_ops, outgoing, incoming = [], None, None
                if j < len(out_cuts):
                    outgoing = self._pack(out_cuts[j], (to, j), sources, send_buf, previous, full=full)
                    header_ops.append(dist.P2POp(dist.isend, outgoing[0], _peer(to, self.group), self.group))
                    sent += outgoing[0].numel() * outgoing[0].element_size()
                    full_elements += _extent(out_cuts[j])
                    blocks_sent += int(outgoing[0][0])
                    blocks_total += _blocks(_extent(out_cuts[j]), block)
                if j < len(in_cuts):
                    n = _extent(in_cuts[j])
                    incoming = torch.empty(_header_size(_blocks(n, block)), dtype=torch.int64, device=self.device)
                    header_ops.append(dist.P2POp(dist.irecv, incoming, _peer(frm, self.group), self.group))
                    received += incoming.numel() * incoming.element_size()
                _exchange(header_ops)
                payload_ops, element_mask = [], None
                if outgoing is not None and outgoing[1].numel():
                    payload_ops.append(dist.P2POp(dist.isend, outgoing[1], _peer(to, self.group), self.group))
                    sent += outgoing[1].numel() * elem
                if incoming is not None:
                    n = _extent(in_cuts[j])
                    flags = _unpack_bits(incoming[_HEADER:], _blocks(n, block))
                    element_mask = None if bool(flags.all()) else _element_mask(flags, n, block)
                    m = n if element_mask is None else int(element_mask.sum())
                    if m:
                        payload_ops.append(dist.P2POp(dist.irecv, recv_buf[:m], _peer(frm, self.group), self.group))
                        received += m * elem
                _exchange(payload_ops)
                if incoming is not None:
                    failures += not self._unpack(in_cuts[j], incoming, element_mask, destinations, recv_buf, work_buf)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return sent, received, full_elements, failures, blocks_sent, blocks_total, buffer_bytes

    def _pack(self, cut: np.ndarray, key: tuple[int, int], sources: Sequence[torch.Tensor], send_buf: torch.Tensor,
              previous: torch.Tensor, *, full: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The header and the payload (changed blocks) of one outgoing bucket; remembers the bucket."""
        n = _extent(cut)
        copy_ranges_([send_buf], list(sources), _pack_ranges(cut))
        bucket = send_buf[:n]
        last = self._sent.get(key)
        if full or last is None or last.numel() != n:
            flags = torch.ones(_blocks(n, self.block), dtype=torch.bool, device=self.device)
        else:
            if previous.numel():  # compare on the accelerator
                previous[:n].copy_(last, non_blocking=True)
                last = previous[:n]
            differs = _bits(bucket) != _bits(last)
            flags = _block_flags(differs, self.block)
        check = bucket_checksum(bucket.to(self.dest_dtype) if self.dest_dtype != bucket.dtype else bucket)
        header = torch.zeros(_header_size(flags.numel()), dtype=torch.int64, device=self.device)
        header[:_HEADER] = torch.tensor([int(flags.sum()), *check], dtype=torch.int64)
        bits = _pack_bits(flags)
        header[_HEADER:].view(torch.uint8)[: bits.numel()] = bits
        payload = bucket if bool(flags.all()) else bucket[_element_mask(flags, n, self.block)]
        if key not in self._sent or self._sent[key].numel() != n:
            pin = self.device.type == "cuda"
            self._sent[key] = torch.empty(n, dtype=bucket.dtype, pin_memory=pin)
        self._sent[key].copy_(bucket)
        return header, payload

    @staticmethod
    def _unpack(cut: np.ndarray, header: torch.Tensor, element_mask: torch.Tensor | None,
                destinations: Sequence[torch.Tensor], recv_buf: torch.Tensor, work_buf: torch.Tensor) -> bool:
        """Rebuild one incoming bucket (engine's values + changed blocks), check it, write it; False when
        the checksum failed."""
        n = _extent(cut)
        bucket = work_buf[:n]
        if element_mask is None:
            bucket.copy_(recv_buf[:n])
        else:
            # The bucket as the engine holds it now: the unpack ranges read backwards.
            gather = np.stack(
                [cut[:, DST_TENSOR], cut[:, DST_OFFSET], np.zeros(len(cut), np.int64), cut[:, 5], cut[:, LENGTH]], 1)
            copy_ranges_([work_buf], list(destinations), torch.from_numpy(np.ascontiguousarray(gather)))
            m = int(element_mask.sum())
            if m:
                bucket[element_mask] = recv_buf[:m].to(bucket.dtype)
        ok = bucket_checksum(bucket) == (int(header[1]), int(header[2]))
        copy_ranges_(list(destinations), [work_buf], _unpack_ranges(cut))
        return ok


def _extent(cut: np.ndarray) -> int:
    """Elements of a bucket cut."""
    return int(cut[:, 5][-1] + cut[:, LENGTH][-1])


def _blocks(n: int, block: int) -> int:
    return -(-n // block)


def _header_size(blocks: int) -> int:
    """int64 elements of a bucket's header: three numbers and one bit per block."""
    return _HEADER + -(-blocks // 64)


def _pack_bits(flags: torch.Tensor) -> torch.Tensor:
    """[n] bool -> [ceil(n / 8)] uint8, little-endian bit order."""
    padded = torch.zeros(-(-flags.numel() // 8) * 8, dtype=torch.uint8, device=flags.device)
    padded[: flags.numel()] = flags
    return (padded.view(-1, 8) * _BIT_WEIGHTS.to(flags.device)).sum(dim=1, dtype=torch.uint8)


def _unpack_bits(words: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` flags packed by :func:`_pack_bits` into ``words`` (int64, viewed as bytes)."""
    raw = words.view(torch.uint8)[: -(-n // 8)]
    bits = raw.unsqueeze(1).bitwise_and(_BIT_WEIGHTS.to(raw.device)).ne(0)
    return bits.view(-1)[:n]


def _block_flags(differs: torch.Tensor, block: int) -> torch.Tensor:
    """Per block of ``block`` elements: whether any element differs (the last block may be short)."""
    n = differs.numel()
    padded = torch.zeros(_blocks(n, block) * block, dtype=torch.bool, device=differs.device)
    padded[:n] = differs
    return padded.view(-1, block).any(dim=1)


def _element_mask(flags: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """The elements of the flagged blocks, [n] bool."""
    return flags.repeat_interleave(block)[:n]


def _exchange(ops: list[dist.P2POp]) -> None:
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
