"""How one rank's rows are cut into micro-batches: a fixed row count, or a token budget.

:func:`fixed_split` is the classic cut: contiguous chunks of ``micro_batch_size`` rows, the last
padded with empty rows. :func:`token_split` is the reference verl's ``use_dynamic_bsz``: each
micro-batch holds at most ``budget`` real tokens (``attention_mask`` sums), so short sequences
share a micro-batch and long ones get one of their own, and memory per micro-batch is bounded
by tokens rather than rows.

The token split, as built here:

- it uses the fewest micro-batches ``k`` (from the lower bound ``ceil(tokens / budget)`` up) for
  which longest-first greedy packing fits every micro-batch under the budget; each row goes to
  the micro-batch with the fewest tokens that still has room for it (LPT scheduling with a
  capacity), which also balances the micro-batches' token counts;
- a sequence longer than the budget is refused (ValueError naming the budget and the length):
  the budget is a promise about memory, and the config check makes every budget at least the
  longest possible sequence (prompt length + response length), so this only meets a batch
  built outside the config's limits;
- every rank of the role runs the same ``k``: the ranks agree on the largest of their counts
  (one small all-reduce). Megatron's schedules would run unequal counts across data-parallel
  ranks (their only data-parallel collective is the gradient reduction after the last
  micro-batch), but the engine averages metrics over micro-batches before averaging them over
  ranks, and the actor's ratio-of-sums metrics are exact only when every rank divides by the
  same count; the tensor-, pipeline- and context-parallel peers must run the same count anyway
  (they exchange activations every micro-batch), and agreeing over the whole role makes that
  hold by construction rather than by every peer computing the same thing;
- with pipeline stages the micro-batches are padded with empty rows to the largest one's row
  count and run at the batch's full width (the stages exchange fixed shapes; trimming is off
  there, :mod:`verl.models.forward`), so the budget bounds the real tokens, not the padded
  compute; with one stage each micro-batch runs at its own rows and longest row;
- rows keep their batch order inside a micro-batch; :func:`verl.models.forward.forward_backward`
  scatters the outputs back, so results come in the caller's row order either way.

The loss contract (``verl.models.forward``) divides by the whole step's token or sequence count,
so any split gives the same loss and gradient up to float summation order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from verl.protocol.collectives import comm_device

__all__ = ["MicroBatchSplit", "fixed_split", "pack_by_tokens", "token_split"]


@dataclass(frozen=True, kw_only=True)
class MicroBatchSplit:
    """This rank's rows cut into micro-batches."""

    parts: tuple[np.ndarray, ...]
    """Row indices of each micro-batch (ascending), covering every row exactly once."""
    rows: int
    """Rows each micro-batch is padded to (with empty rows) where shapes must be fixed: always for
    a fixed split, with pipeline stages for a token split (the same on every rank of the role)."""
    pad: bool
    """Whether micro-batches are padded to ``rows``."""
    budget: int | None = None
    """The token budget (None: a fixed split)."""
    fill: float | None = None
    """Real tokens over ``count x budget``, over every data-parallel rank (None: a fixed split)."""

    @property
    def count(self) -> int:
        """Number of micro-batches."""
        return len(self.parts)


def fixed_split(num_rows: int, micro_batch_size: int) -> MicroBatchSplit:
    """Contiguous chunks of ``micro_batch_size`` rows, the last padded with empty rows."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size}; it must be >= 1")
    count = max(1, -(-num_rows // micro_batch_size))
    index = np.arange(num_rows, dtype=np.int64)
    parts = tuple(index[i * micro_batch_size : (i + 1) * micro_batch_size] for i in range(count))
    return MicroBatchSplit(parts=parts, rows=micro_batch_size, pad=True)


def pack_by_tokens(lengths: Sequence[int] | np.ndarray, budget: int, parts: int) -> list[np.ndarray] | None:
    """``parts`` micro-batches with at most ``budget`` tokens each, or None when greedy packing fails.

    Longest row first, into the micro-batch with the fewest tokens that still has room (ties: the
    lower micro-batch, then the lower row, so every rank packs the same rows the same way).
    """
    values = np.asarray(lengths, dtype=np.int64)
    n = values.shape[0]
    sums = np.zeros(parts, dtype=np.int64)
    members: list[list[int]] = [[] for _ in range(parts)]
    for row in np.lexsort((np.arange(n), -values)):
        room = np.flatnonzero(sums + values[row] <= budget)
        if room.size == 0:
            return None
        target = int(room[np.argmin(sums[room])])  # argmin takes the first of equal sums
        members[target].append(int(row))
        sums[target] += values[row]
    return [np.sort(np.asarray(m, dtype=np.int64)) for m in members]


def _fewest(values: np.ndarray, budget: int, start: int, multiple_of: int) -> tuple[int, list[np.ndarray]]:
    """The smallest multiple of ``multiple_of`` >= ``start`` that :func:`pack_by_tokens` fits."""
    k = -(-start // multiple_of) * multiple_of
    while True:
        packed = pack_by_tokens(values, budget, k)
        if packed is not None:
            return k, packed
        k += multiple_of  # terminates: with k >= rows every row gets a micro-batch of its own


def token_split(
    attention_mask: torch.Tensor,
    budget: int,
    *,
    pg=None,
    multiple_of: int = 1,
    what: str = "the token budget",
) -> MicroBatchSplit:
    """Micro-batches of at most ``budget`` real tokens each (module docstring).

    Args:
        attention_mask: [B, T], this rank's rows (1 = real token).
        budget: real tokens per micro-batch at most.
        pg: the role's ``ProcessGroupCollection``: every rank of the role agrees on the count
            (and on the padded row count), and ``fill`` is over data-parallel ranks; None: this
            rank alone.
        multiple_of: the count is a multiple of it (interleaved pipeline schedules need a
            multiple of the pipeline size).
        what: the budget's name in error messages (the config key).
    """
    if budget < 1:
        raise ValueError(f"{what}={budget}; it must be >= 1")
    values = attention_mask.sum(-1).to(torch.int64).cpu().numpy()  # [B]
    n = int(values.shape[0])
    longest = int(values.max()) if n else 0
    total = int(values.sum())
    pp_size = 1 if pg is None else pg.pp.size()
    groups = [] if pg is None else [g for g in (pg.tp_dp_cp, pg.pp) if g is not None and g.size() > 1]
    start = max(1, -(-total // budget))
    # A rank with a row over the budget packs nothing (it could not); the agreement below then
    # makes every rank raise the same error instead of leaving the others in a collective.
    k, parts = _fewest(values, budget, start, multiple_of) if longest <= budget else (start, [])
    rows, fewest_rows = max((len(p) for p in parts), default=0), n
    while groups:
        # [count, -count, rows, -rows held, longest row]: one MAX all-reduce gives the largest
        # count and the smallest, the largest micro-batch, the fewest rows a rank holds and the
        # longest row; two steps (TP x DP x CP, then PP) cover the whole role.
        agree = torch.tensor([k, -k, rows, -n, longest], dtype=torch.int64)
        for group in groups:
            on_device = agree.to(comm_device(group))
            dist.all_reduce(on_device, op=dist.ReduceOp.MAX, group=group)
            agree = on_device.cpu()
        longest, fewest_rows, rows = int(agree[4]), -int(agree[3]), int(agree[2])
        if int(agree[0]) == -int(agree[1]) or int(agree[0]) > fewest_rows or longest > budget:
            k = int(agree[0])
            break
        # Some rank needs more micro-batches: every rank repacks into (at least) that many; the
        # count only grows and is bounded by the rows, so this ends (in one more round, nearly always).
        k, parts = _fewest(values, budget, int(agree[0]), multiple_of)
        rows = max(len(p) for p in parts)
    if longest > budget:
        raise ValueError(
            f"a sequence of {longest} tokens is longer than {what}={budget}; a micro-batch must hold "
            f"the longest sequence: raise {what} to at least {longest}"
        )
    if k > fewest_rows:
        # Raised on every rank alike (the numbers were agreed), so no rank waits in a collective.
        reason = f"a multiple of the pipeline size {pp_size}" if multiple_of > 1 else "the most any rank needs"
        raise ValueError(
            f"{what}={budget}: every rank must run {k} micro-batches ({reason}) but a rank holds "
            f"only {fewest_rows} rows; give each rank at least {k} rows"
        )
    tokens = torch.tensor([total], dtype=torch.float64)
    dp = 1
    if pg is not None and pg.dp.size() > 1:
        tokens = tokens.to(comm_device(pg.dp))
        dist.all_reduce(tokens, group=pg.dp)
        dp = pg.dp.size()
    fill = float(tokens[0]) / (dp * k * budget)
    return MicroBatchSplit(parts=tuple(parts), rows=rows, pad=pp_size > 1, budget=budget, fill=fill)
