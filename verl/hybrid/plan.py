"""The resharding plan: which element ranges of which training rank's shards fill which rollout tensors.

Computed once, identically on every rank, from data only (the HF config, the actor's layout
TP x PP (x VPP) x DP, the rollout layout TP' x DP' over the same ranks, and the destination's
parameter layout): no tensor is touched and nothing is communicated, so a 70B plan for 32
ranks can be computed and printed on a laptop (``tools/bench.py reshard --plan-only``).

For every rollout rank ``d`` and every box of Hugging Face tensor it needs
(:mod:`verl.hybrid.layout`), the plan intersects that box with the regions the training ranks
hold. A region held by several ranks (data-parallel replicas; norms on every TP rank) is taken
from ``d`` itself when ``d`` holds it (a local copy: nothing crosses the network), else from a
rank ``d`` already receives from, else from the holder asked for the fewest bytes so far
(deterministic greedy balance; regions with one holder are assigned first).
Each intersection becomes one element range ``(src tensor, src offset, dst tensor, dst
offset, length)`` when both sides store it contiguously, else one range per row (a column
block of ``o_proj``/``down_proj`` when TP != TP'). Ranges of one (source, destination) pair are
sorted by destination and adjacent ones merged.

Every destination element is covered exactly once or the plan is refused (a bug or a layout
the plan does not know), and the figures a user looks at come from here:
:meth:`ReshardPlan.rank_stats` (bytes received from each peer, copied locally, tensors touched)
and :meth:`ReshardPlan.describe` (a table).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from verl.hybrid.layout import Box, Layout

if TYPE_CHECKING:
    from verl.models.hf_config import HFModelSpec

__all__ = ["RankStats", "ReshardPlan", "build_plan", "cluster_layouts"]

# Columns of a range array.
SRC_TENSOR, SRC_OFFSET, DST_TENSOR, DST_OFFSET, LENGTH = range(5)


@dataclass(frozen=True)
class RankStats:
    """What one rank does in a push (element counts; multiply by the element size for bytes)."""

    rank: int
    local_elements: int
    """Elements copied from this rank's own shards (no communication)."""
    received: dict[int, int]
    """Peer rank -> elements received from it."""
    sent: dict[int, int]
    """Peer rank -> elements sent to it."""
    tensors_touched: int
    """Destination tensors written on this rank."""

    @property
    def received_elements(self) -> int:
        """Elements that cross the network into this rank."""
        return sum(self.received.values())

    @property
    def sent_elements(self) -> int:
        """Elements this rank sends to others."""
        return sum(self.sent.values())


@dataclass
class ReshardPlan:
    """Range arrays per (source rank, destination rank), tensor keys per rank (see module docstring)."""

    world_size: int
    src_keys: list[list[str]]
    """Per rank: the source (actor) tensor keys, sorted; a range's SRC_TENSOR indexes this list."""
    dst_keys: list[list[str]]
    """Per rank: the destination tensor keys, sorted; a range's DST_TENSOR indexes this list."""
    pairs: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    """(src rank, dst rank) -> int64 [N, 5] ranges, sorted by destination; src == dst: local copies."""
    schedules: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """What a push works out from the plan once per rank and bucket size (:func:`verl.hybrid.transfer.schedule`);
    a plan's ranges are not changed once it is built."""

    def ranges(self, src: int, dst: int) -> np.ndarray:
        """The ranges ``src`` sends to ``dst`` (an empty [0, 5] array when none)."""
        return self.pairs.get((src, dst), np.zeros((0, 5), dtype=np.int64))

    def rank_stats(self, rank: int) -> RankStats:
        """Traffic and work of ``rank``."""
        received, sent = {}, {}
        touched: set[int] = set()
        local = 0
        for (s, d), r in self.pairs.items():
            n = int(r[:, LENGTH].sum())
            if d == rank:
                touched.update(int(t) for t in np.unique(r[:, DST_TENSOR]))
            if s == d == rank:
                local = n
            elif d == rank:
                received[s] = n
            elif s == rank:
                sent[d] = n
        return RankStats(rank=rank, local_elements=local, received=received, sent=sent, tensors_touched=len(touched))

    def largest_piece(self, rank: int, *, local: bool = False) -> int:
        """Elements of the largest piece ``rank`` exchanges: the most of one destination tensor that it
        sends to or receives from one peer (``local``: its own copies count too)."""
        largest = 0
        for (s, d), r in self.pairs.items():
            if rank not in (s, d) or (s == d and not local) or not len(r):
                continue
            per_tensor = np.bincount(r[:, DST_TENSOR], weights=r[:, LENGTH])
            largest = max(largest, int(per_tensor.max()))
        return largest

    def bucket_elements(self, rank: int, bucket_elements: int, *, local: bool = False) -> int:
        """The push's bucket on ``rank``: ``bucket_elements``, but no more than half of :meth:`largest_piece`
        (0 when nothing moves). The push holds two buffers of it, so its extra memory stays at or below
        the largest piece, which the naive path holds too (gathered whole, with the rest of its tensor):
        at or below the naive path's peak for any model, where a bucket-sized pair of buffers would be far
        above it for a small one."""
        largest = self.largest_piece(rank, local=local)
        return min(bucket_elements, max(1, largest // 2)) if largest else 0

    def peak_extra_bound(self, rank: int, element_size: int, bucket_bytes: int) -> int:
        """Bound on the push's extra memory on ``rank`` in bytes: two buckets (one filling, one in
        flight) of :meth:`bucket_elements` (same dtypes on both sides: no cast buffer)."""
        return 2 * self.bucket_elements(rank, bucket_bytes // element_size) * element_size

    def describe(self, element_size: int) -> str:
        """A readable table: per rank, bytes copied locally, received (and from whom), sent, tensors touched."""
        lines = [f"{'rank':>4}  {'local':>12}  {'received':>12}  {'sent':>12}  {'tensors':>7}  received from"]
        for rank in range(self.world_size):
            st = self.rank_stats(rank)
            peers = ", ".join(f"{p}: {_fmt(n * element_size)}" for p, n in sorted(st.received.items())) or "-"
            lines.append(
                f"{rank:>4}  {_fmt(st.local_elements * element_size):>12}  "
                f"{_fmt(st.received_elements * element_size):>12}  {_fmt(st.sent_elements * element_size):>12}  "
                f"{st.tensors_touched:>7}  {peers}"
            )
        return "\n".join(lines)


def cluster_layouts(
    spec: "HFModelSpec",
    *,
    world_size: int,
    train_tp: int,
    train_pp: int,
    train_vpp: int | None = None,
    train_ep: int = 1,
    rollout_tp: int,
    destination: str = "vllm",
) -> tuple[list[Layout], list[Layout]]:
    """Source (actor, Megatron) and destination (``vllm`` or ``hf-shards``) layouts of every rank of a
    colocated world, from the config alone: the actor at TP x PP (x VPP, x EP: each rank holds its
    expert-parallel rank's experts) in Megatron's rank order, the rollout replicas of TP' consecutive
    ranks (what ``WeightSync`` plans on a live world)."""
    from verl.hybrid.layout import hf_layout, megatron_layout, vllm_layout
    from verl.parallel.topology import Topology

    if destination not in ("vllm", "hf-shards"):
        raise ValueError(f"destination={destination!r}; use 'vllm' or 'hf-shards'")
    topo = Topology.colocated(
        world_size=world_size, tensor_parallel=train_tp, pipeline_parallel=train_pp, rollout_tensor_parallel=rollout_tp
    )
    stage = world_size // train_pp
    sources, dests = [], []
    for rank in range(world_size):
        c = topo.coords("actor", rank)
        sources.append(megatron_layout(spec, tp=train_tp, tp_rank=c.tp, pp=train_pp, pp_rank=c.pp,
                                       vpp=train_vpp, vocab_pad_multiple=None,
                                       ep=train_ep, ep_rank=(c.local_rank % stage) % train_ep))
        t = rank % rollout_tp
        dests.append(vllm_layout(spec, tp=rollout_tp, tp_rank=t) if destination == "vllm"
                     else hf_layout(spec, tp=rollout_tp, tp_rank=t))
    return sources, dests


def _fmt(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def _intersection_ranges(s: Box, d: Box, s_index: int, d_index: int) -> np.ndarray:
    """Ranges copying the overlap of source box ``s`` into destination box ``d`` ([0, 5] when disjoint)."""
    r0, r1 = max(s.row0, d.row0), min(s.row1, d.row1)
    c0, c1 = max(s.col0, d.col0), min(s.col1, d.col1)
    if r0 >= r1 or c0 >= c1:
        return np.zeros((0, 5), dtype=np.int64)
    ncols = c1 - c0
    src0 = s.offset + (r0 - s.row0) * s.row_stride + (c0 - s.col0)
    dst0 = d.offset + (r0 - d.row0) * d.row_stride + (c0 - d.col0)
    if ncols == s.row_stride == d.row_stride or r1 - r0 == 1:
        return np.array([[s_index, src0, d_index, dst0, (r1 - r0) * ncols]], dtype=np.int64)
    rows = np.arange(r1 - r0, dtype=np.int64)
    out = np.empty((r1 - r0, 5), dtype=np.int64)
    out[:, SRC_TENSOR] = s_index
    out[:, SRC_OFFSET] = src0 + rows * s.row_stride
    out[:, DST_TENSOR] = d_index
    out[:, DST_OFFSET] = dst0 + rows * d.row_stride
    out[:, LENGTH] = ncols
    return out


def _overlap(s: Box, d: Box) -> int:
    """Elements of the region both boxes cover (what :func:`_intersection_ranges` would copy)."""
    return max(0, min(s.row1, d.row1) - max(s.row0, d.row0)) * max(0, min(s.col1, d.col1) - max(s.col0, d.col0))


def _merge(ranges: np.ndarray) -> np.ndarray:
    """Sort by destination and fuse ranges that continue each other on both sides."""
    if len(ranges) < 2:
        return ranges
    ranges = ranges[np.lexsort((ranges[:, DST_OFFSET], ranges[:, DST_TENSOR]))]
    starts = np.ones(len(ranges), dtype=bool)
    prev, cur = ranges[:-1], ranges[1:]
    continues = (
        (cur[:, SRC_TENSOR] == prev[:, SRC_TENSOR])
        & (cur[:, DST_TENSOR] == prev[:, DST_TENSOR])
        & (cur[:, SRC_OFFSET] == prev[:, SRC_OFFSET] + prev[:, LENGTH])
        & (cur[:, DST_OFFSET] == prev[:, DST_OFFSET] + prev[:, LENGTH])
    )
    starts[1:] = ~continues
    group = np.cumsum(starts) - 1
    merged = ranges[starts]  # boolean indexing copies
    merged[:, LENGTH] = np.bincount(group, weights=ranges[:, LENGTH]).astype(np.int64)
    return merged


def build_plan(sources: Sequence[Layout], destinations: Sequence[Layout]) -> ReshardPlan:
    """The plan moving ``sources[r]`` (rank r's actor shards) into ``destinations[r]`` (its rollout tensors).

    Raises ValueError when a destination element has no source (naming the tensor and region).
    """
    world = len(sources)
    if len(destinations) != world:
        raise ValueError(f"build_plan: {world} source layouts but {len(destinations)} destination layouts")
    src_keys = [sorted(layout.shapes) for layout in sources]
    dst_keys = [sorted(layout.shapes) for layout in destinations]
    src_index = [{k: i for i, k in enumerate(keys)} for keys in src_keys]
    dst_index = [{k: i for i, k in enumerate(keys)} for keys in dst_keys]
    # hf name -> region -> holders [(rank, box)], regions in a fixed order.
    regions: dict[str, dict[tuple[int, int, int, int], list[tuple[int, Box]]]] = defaultdict(dict)
    for rank, layout in enumerate(sources):
        for box in layout.boxes:
            region = (box.row0, box.row1, box.col0, box.col1)
            regions[box.hf_name].setdefault(region, []).append((rank, box))
    asked = [0] * world  # elements each rank has been asked to send so far (balance)
    parts: dict[tuple[int, int], list[np.ndarray]] = defaultdict(list)
    for dst, layout in enumerate(destinations):
        # (box, holders of one region it overlaps): regions with a single holder first, so that a
        # replicated region (a norm on every TP rank) then comes from a peer this rank already
        # receives from rather than adding a peer for a few kilobytes.
        work = []
        for box in layout.boxes:
            held = regions.get(box.hf_name)
            if not held:
                raise ValueError(f"reshard plan: no training rank holds {box.hf_name} (destination {box.tensor!r})")
            overlapping = [
                holders for (r0, r1, c0, c1), holders in held.items()
                if r0 < box.row1 and r1 > box.row0 and c0 < box.col1 and c1 > box.col0
            ]
            work += [(box, holders) for holders in overlapping]
            covered = sum(_overlap(h[0][1], box) for h in overlapping)
            if covered != box.numel:
                raise ValueError(
                    f"reshard plan: rows {box.row0}:{box.row1} x cols {box.col0}:{box.col1} of {box.hf_name} "
                    f"(destination {box.tensor!r} on rank {dst}) are covered {covered} of {box.numel} elements "
                    "by the training ranks' shards"
                )
        peers: set[int] = set()
        for box, holders in sorted(work, key=lambda item: len(item[1])):
            mine = [h for h in holders if h[0] == dst]
            src, src_box = mine[0] if mine else min(holders, key=lambda h: (h[0] not in peers, asked[h[0]], h[0]))
            piece = _intersection_ranges(src_box, box, src_index[src][src_box.tensor], dst_index[dst][box.tensor])
            if src != dst:
                asked[src] += _overlap(src_box, box)
                peers.add(src)
            parts[(src, dst)].append(piece)
    plan = ReshardPlan(world_size=world, src_keys=src_keys, dst_keys=dst_keys)
    for pair, chunks in parts.items():
        plan.pairs[pair] = _merge(np.concatenate(chunks))
    return plan
