"""Collectives of ``Batch``: ``scatter``, ``gather``, ``all_gather``, ``broadcast``.

They move a ``Batch`` over a ``torch.distributed`` process group with the same code for gloo and
NCCL. Tensor metadata (keys, dtypes, shapes) and non-tensor columns travel by object
collectives; tensor data travels packed into one ``uint8`` buffer per rank by one tensor
collective, so big tensors are never pickled. ``src``/``dst`` are ranks *within the group*
(0 .. group size - 1), not global ranks: chunks are dealt and gathered in group-rank order, so
group ranks are what a caller reasons about (torch's ``group_src``/``group_dst``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from verl.protocol.batch import Batch, _merge_meta, _schema_mismatch

__all__ = ["all_gather", "broadcast", "comm_device", "gather", "scatter"]

# Tensor data of each column starts at a multiple of this many bytes inside a packed buffer, so
# that a uint8 slice can be viewed as any dtype (torch requires offset % itemsize == 0).
_PACK_ALIGN = 16

# ---------------------------------------------------------------------- collectives
#
# Every collective first exchanges a small header by an object collective: row count, tensor
# specs (key, dtype, shape without the batch dim), non-tensor columns where needed, meta_info,
# and an error slot. A problem found on one rank (not a Batch, uneven scatter, keys or dtypes
# that differ across ranks) travels in that header, so every rank of the group raises the same
# ValueError instead of some ranks waiting forever in the data collective. Tensor data then
# moves packed into one uint8 buffer per rank, each column at a _PACK_ALIGN-aligned offset, by a
# single tensor collective. Received tensors are views into that buffer, on the group's
# communication device: the current CUDA device for an NCCL group, the CPU for gloo.

_TensorSpecs = list[tuple[str, torch.dtype, tuple[int, ...]]]


def _group_position(group: dist.ProcessGroup | None, op: str) -> tuple[int, int]:
    """(this process's rank in ``group``, group size); refuses non-members."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"{op}: torch.distributed is not initialised; call init_process_group first")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"{op}: global rank {dist.get_rank()} is not a member of the process group it was given; "
            f"call {op} only on the group's ranks"
        )
    return rank, dist.get_world_size(group)


def _check_root(root: int, size: int, name: str, op: str) -> None:
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < size:
        raise ValueError(
            f"{op}: {name}={root!r} is not a rank of the group; {name} is a rank within the group "
            f"(0..{size - 1}), not a global rank"
        )


def _rank_label(group: dist.ProcessGroup | None, group_rank: int) -> str:
    if group is None or group is dist.group.WORLD:
        return f"rank {group_rank}"
    return f"group rank {group_rank} (global rank {dist.get_global_rank(group, group_rank)})"


def comm_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where tensor data must live for ``group``'s backend: CUDA for NCCL, else the CPU."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _specs(batch: Batch) -> _TensorSpecs:
    return [(key, t.dtype, tuple(t.shape[1:])) for key, t in batch.tensors.items()]


def _layout(specs: _TensorSpecs, rows: int) -> tuple[list[tuple[int, int]], int]:
    """Byte (offset, length) of each column in a packed buffer of ``rows`` rows, and its size."""
    spans, pos = [], 0
    for _, dtype, tail in specs:
        nbytes = rows * math.prod(tail) * dtype.itemsize
        spans.append((pos, nbytes))
        pos += -(-nbytes // _PACK_ALIGN) * _PACK_ALIGN
    return spans, pos


def _pack(batch: Batch, specs: _TensorSpecs, device: torch.device, size: int) -> torch.Tensor:
    """The batch's tensors as one uint8 buffer ``[size]`` (``size`` >= the layout's own size)."""
    spans, total = _layout(specs, len(batch))
    assert total <= size, (total, size)
    buf = torch.empty(size, dtype=torch.uint8, device=device)
    for (key, _, _), (offset, nbytes) in zip(specs, spans):
        if nbytes:
            flat = batch.tensors[key].detach().reshape(-1).view(torch.uint8)
            buf[offset : offset + nbytes].copy_(flat)
    return buf


def _unpack(buf: torch.Tensor, specs: _TensorSpecs, rows: int) -> dict[str, torch.Tensor]:
    spans, total = _layout(specs, rows)
    assert buf.numel() >= total, (buf.numel(), total)
    return {
        key: buf[offset : offset + nbytes].view(dtype).reshape(rows, *tail)
        for (key, dtype, tail), (offset, nbytes) in zip(specs, spans)
    }


def _header(batch: Any, op: str, label: str, *, with_non_tensors: bool) -> dict[str, Any]:
    if not isinstance(batch, Batch):
        return {"error": f"{op}: {label} passed a {type(batch).__name__}, not a Batch"}
    return {
        "error": None,
        "rows": len(batch),
        "specs": _specs(batch),
        "non_tensor_keys": list(batch.non_tensors),
        "non_tensors": dict(batch.non_tensors) if with_non_tensors else None,
        "meta_info": batch.meta_info,
    }


def _check_headers(headers: Sequence[dict[str, Any]], group: dist.ProcessGroup | None, op: str) -> None:
    """Raise the same ValueError on every rank if the gathered batches cannot be concatenated."""
    for header in headers:
        if header["error"]:
            raise ValueError(header["error"])
    labels = [_rank_label(group, r) for r in range(len(headers))]
    schemas = [
        ({key: (dtype, tail) for key, dtype, tail in h["specs"]}, h["non_tensor_keys"]) for h in headers
    ]
    mismatch = _schema_mismatch(schemas, labels, op)
    if mismatch:
        raise ValueError(mismatch)
    _merge_meta([h["meta_info"] for h in headers], labels, op)


def _assemble(
    headers: Sequence[dict[str, Any]],
    non_tensors: Sequence[dict[str, np.ndarray]],
    buffers: Sequence[torch.Tensor],
    specs: _TensorSpecs,
) -> Batch:
    parts = [
        Batch(
            tensors=_unpack(buf, specs, h["rows"]),
            non_tensors=nt,
            meta_info=h["meta_info"],
            batch_size=h["rows"],
        )
        for h, nt, buf in zip(headers, non_tensors, buffers)
    ]
    return Batch.concat(parts)


def scatter(batch: Batch | None, group: dist.ProcessGroup | None = None, src: int = 0) -> Batch:
    """Split ``batch`` (given on group rank ``src``) into equal contiguous chunks, one per rank.

    Group rank ``r`` receives rows ``[r * B / n, (r + 1) * B / n)``. The length must divide by
    the group size ``n`` (pad with ``Batch.pad_to_divisor`` first); otherwise every rank raises
    the same ValueError. ``batch`` is ignored on the other ranks (pass ``None``). ``src`` is a
    rank within ``group``; ``group=None`` is the whole world.
    """
    rank, size = _group_position(group, "scatter")
    _check_root(src, size, "src", "scatter")
    device = comm_device(group)
    chunks: list[Batch] | None = None
    objects: list[dict[str, Any]] | None = None
    if rank == src:
        header = _header(batch, "scatter", _rank_label(group, src), with_non_tensors=False)
        if header["error"] is None and len(batch) % size:
            header = {
                "error": (
                    f"scatter: the batch on {_rank_label(group, src)} has {len(batch)} rows, which do "
                    f"not split evenly over the group's {size} ranks; pad it first with "
                    f"`padded, pad = batch.pad_to_divisor({size})` and unpad(pad) after gathering back"
                )
            }
        if header["error"] is not None:
            objects = [header] * size
        else:
            chunks = batch.chunk(size)
            objects = [_header(c, "scatter", "", with_non_tensors=True) for c in chunks]
    received: list[Any] = [None]
    dist.scatter_object_list(received, objects, group=group, group_src=src)
    header = received[0]
    if header["error"]:
        raise ValueError(header["error"])
    specs, rows = header["specs"], header["rows"]
    _, total = _layout(specs, rows)
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    if total:
        send = [_pack(c, specs, device, total) for c in chunks] if chunks is not None else None
        dist.scatter(buf, send, group=group, group_src=src)
    return Batch(
        tensors=_unpack(buf, specs, rows),
        non_tensors=header["non_tensors"],
        meta_info=header["meta_info"],
        batch_size=rows,
    )


def gather(batch: Batch, group: dist.ProcessGroup | None = None, dst: int = 0) -> Batch | None:
    """Concatenate every rank's batch, in group-rank order, on group rank ``dst``.

    Returns the concatenated batch on ``dst`` and ``None`` elsewhere. Ranks may hold different
    row counts, but keys, dtypes, non-batch dims and meta_info must agree (``Batch.concat``'s
    rule); otherwise every rank raises the same ValueError. ``dst`` is a rank within ``group``.
    """
    rank, size = _group_position(group, "gather")
    _check_root(dst, size, "dst", "gather")
    device = comm_device(group)
    headers: list[Any] = [None] * size
    dist.all_gather_object(
        headers, _header(batch, "gather", _rank_label(group, rank), with_non_tensors=False), group=group
    )
    _check_headers(headers, group, "gather")
    non_tensors: list[Any] | None = [None] * size if rank == dst else None
    dist.gather_object(batch.non_tensors, non_tensors, group=group, group_dst=dst)
    specs = headers[0]["specs"]
    width = max(_layout(specs, h["rows"])[1] for h in headers)
    buffers = [torch.empty(width, dtype=torch.uint8, device=device) for _ in range(size)]
    if width:
        send = _pack(batch, specs, device, width)
        dist.gather(send, buffers if rank == dst else None, group=group, group_dst=dst)
    if rank != dst:
        return None
    return _assemble(headers, non_tensors, buffers, specs)


def all_gather(batch: Batch, group: dist.ProcessGroup | None = None) -> Batch:
    """Concatenate every rank's batch, in group-rank order, on every rank of ``group``.

    Same agreement rules as ``gather``; ranks may hold different row counts.
    """
    rank, size = _group_position(group, "all_gather")
    device = comm_device(group)
    headers: list[Any] = [None] * size
    dist.all_gather_object(
        headers, _header(batch, "all_gather", _rank_label(group, rank), with_non_tensors=True), group=group
    )
    _check_headers(headers, group, "all_gather")
    specs = headers[0]["specs"]
    width = max(_layout(specs, h["rows"])[1] for h in headers)
    buffers = [torch.empty(width, dtype=torch.uint8, device=device) for _ in range(size)]
    if width:
        dist.all_gather(buffers, _pack(batch, specs, device, width), group=group)
    return _assemble(headers, [h["non_tensors"] for h in headers], buffers, specs)


def broadcast(batch: Batch | None, group: dist.ProcessGroup | None = None, src: int = 0) -> Batch:
    """Send ``batch`` from group rank ``src`` to every rank of ``group``.

    ``src`` gets its own batch object back unchanged; the other ranks get a copy whose tensors
    live on the group's communication device. ``batch`` is ignored off ``src`` (pass ``None``).
    """
    rank, size = _group_position(group, "broadcast")
    _check_root(src, size, "src", "broadcast")
    device = comm_device(group)
    box: list[Any] = [None]
    if rank == src:
        box[0] = _header(batch, "broadcast", _rank_label(group, src), with_non_tensors=True)
    dist.broadcast_object_list(box, group=group, group_src=src)
    header = box[0]
    if header["error"]:
        raise ValueError(header["error"])
    specs, rows = header["specs"], header["rows"]
    _, total = _layout(specs, rows)
    if rank == src:
        if total:
            dist.broadcast(_pack(batch, specs, device, total), group=group, group_src=src)
        return batch
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    if total:
        dist.broadcast(buf, group=group, group_src=src)
    return Batch(
        tensors=_unpack(buf, specs, rows),
        non_tensors=header["non_tensors"],
        meta_info=header["meta_info"],
        batch_size=rows,
    )
