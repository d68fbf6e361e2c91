"""Moving a batch to a role's data-parallel ranks and back.

The trainer holds every step's batch whole on every rank (the same rows, in the same order). A
role works on its share: :func:`shard` gives data-parallel rank ``r`` of ``D`` its ``r``-th
contiguous chunk (the batch padded to a multiple of ``D`` with copies of its first rows), and
:func:`collect` all-gathers the chunks' results over the same group and drops the padding, so
every rank holds the whole result again. The ranks that share a data-parallel index (a role's
tensor- and pipeline-parallel peers, a rollout engine's TP' ranks) get identical chunks.

With ``balance=True`` the rows are first reordered so that the chunks hold about the same
number of tokens (``attention_mask`` sums; the reference verl's ``balance_batch``), and
:func:`collect` undoes the reordering: results come back in the caller's order either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from verl.protocol import Batch, all_gather

__all__ = ["Shard", "balanced_order", "collect", "shard"]


@dataclass(frozen=True, kw_only=True)
class Shard:
    """This rank's chunk of a batch and what :func:`collect` needs to put the results back."""

    rows: Batch
    """This rank's rows."""
    pad: int
    """Padding rows added to the whole batch (copies of its first rows, dropped by ``collect``)."""
    order: np.ndarray | None
    """The whole batch's row permutation applied before chunking (None: the batch order)."""


def balanced_order(lengths: torch.Tensor, parts: int) -> np.ndarray:
    """A permutation of ``len(lengths)`` rows (a multiple of ``parts``) whose ``parts`` equal
    contiguous chunks have nearly equal sums of ``lengths`` [B].

    Greedy: longest row first, into the chunk with the smallest sum that still has room. Ties
    break by row number, so every rank computes the same permutation.
    """
    n = int(lengths.shape[0])
    assert n % parts == 0, (n, parts)
    per_part = n // parts
    values = lengths.to(torch.int64).cpu().numpy()
    by_length = np.lexsort((np.arange(n), -values))  # longest first, then by row
    sums = np.zeros(parts, dtype=np.int64)
    members: list[list[int]] = [[] for _ in range(parts)]
    for row in by_length:
        open_parts = [p for p in range(parts) if len(members[p]) < per_part]
        target = min(open_parts, key=lambda p: (sums[p], p))
        members[target].append(int(row))
        sums[target] += values[row]
    return np.concatenate([np.sort(np.asarray(m, dtype=np.int64)) for m in members])


def _group_size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def shard(batch: Batch, group: dist.ProcessGroup | None, *, balance: bool = False) -> Shard:
    """This rank's contiguous chunk of ``batch`` over ``group`` (see the module docstring)."""
    size, rank = _group_size_rank(group)
    if size == 1:
        return Shard(rows=batch, pad=0, order=None)
    padded, pad = batch.pad_to_divisor(size)
    order = None
    if balance and "attention_mask" in padded:
        order = balanced_order(padded["attention_mask"].sum(dim=-1), size)
        padded = padded.reorder(order)
    return Shard(rows=padded.chunk(size)[rank], pad=pad, order=order)


def collect(local: Batch, group: dist.ProcessGroup | None, piece: Shard) -> Batch:
    """The results of every rank's chunk, whole and in the original row order, on every rank."""
    size, _ = _group_size_rank(group)
    if size == 1:
        return local
    whole = all_gather(local, group)
    if piece.order is not None:
        whole = whole.reorder(np.argsort(piece.order, kind="stable"))
    return whole.unpad(piece.pad)


# ---------------------------------------------------------------- roles on part of the world
#
# A role placed on ranks of its own (trainer.placement) computes on those ranks only; these hand
# its results to every rank of the world, so that every rank again holds the same whole batch.
# Every rank of the world calls them, in the same order; ``src`` is the role's first global rank.


def share_columns(
    columns: dict[str, torch.Tensor] | None, src: int, group: dist.ProcessGroup | None = None
) -> dict[str, torch.Tensor]:
    """``columns`` (name -> [B, ...] tensor, given on rank ``src``; None elsewhere) on every rank
    (of ``group``; None: the world) (CPU). ``src`` is a global rank, as in every ``share_*``."""
    whole = share_batch(Batch.from_dict(columns) if dist.get_rank() == src else None, src, group)
    return {name: tensor.cpu() for name, tensor in whole.tensors.items()}


def share_object(value: object, src: int, group: dist.ProcessGroup | None = None) -> object:
    """A picklable ``value`` (metrics, per-sample lists) from rank ``src`` on every rank (of ``group``)."""
    box = [value if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def share_batch(batch: Batch | None, src: int, group: dist.ProcessGroup | None = None) -> Batch:
    """A whole ``batch`` (given on rank ``src``; None elsewhere) on every rank (of ``group``),
    tensors on the CPU."""
    from verl.protocol.collectives import broadcast

    group_src = src if group is None else dist.get_group_rank(group, src)
    whole = broadcast(batch if dist.get_rank() == src else None, group, src=group_src)
    if dist.get_rank() == src:
        return whole
    return Batch(
        tensors={k: t.cpu() for k, t in whole.tensors.items()},
        non_tensors=whole.non_tensors,
        meta_info=whole.meta_info,
        batch_size=len(whole),
    )
