"""``role_world(group)``: a block in which ``torch.distributed``'s default group is one role's ranks.

A role placed on part of the world (``trainer.placement``: a critic or reward model on ranks of
its own) runs code that was written for a world of its own: Megatron-core's
``dist_checkpointing`` (rank 0 writes the common state, metadata is all-gathered over the
default group), the engine's checkpoint and export files (rank 0 writes, the rest wait at a
barrier), the Hugging Face weight loader (rank 0 reads, then broadcasts). Inside the block those
calls see the role's ranks as the world: ``dist.get_rank()`` is the rank within the role,
``dist.get_world_size()`` the role's size, and ``barrier``/``all_gather_object``/``broadcast``
without a group reach the role's ranks only, so two roles on disjoint ranks can save, load and
export at the same time without waiting for each other. Groups passed explicitly (a role's TP,
DP, ... groups) are untouched: their global ranks keep their meaning.

A group that is the whole world (every colocated role) changes nothing.

Groups made inside the block (``new_group`` by the role's ranks, numbered as the role's world
numbers them: 0 .. size - 1) belong to that world: ``dist.get_rank(g)`` answers for them only
inside it (torch maps a group's members by the default group's ranks), so a role's groups are
made and used inside its block (``Topology.build_groups``, ``megatron_state.activate_role``).
torch names groups by a process-wide counter that every rank of a world must advance alike; the
block gives each role's world a counter of its own (starting far above the world's), so groups
made inside it never put the world's ranks out of step for groups made outside later.

This is the one place verl touches torch's private default-group state. Checked against:

| torch | what is read/written | why |
| --- | --- | --- |
| 2.13 (CPU), 2.11 (CUDA) | ``distributed_c10d._world.default_pg`` (property with a setter; ``GroupMember.WORLD`` and ``group.WORLD`` read it) | the group every group-less c10d call uses |
| 2.13 (CPU), 2.11 (CUDA) | ``distributed_c10d._world.group_count`` (property with a setter) | the counter ``new_group`` names groups by |
| 2.13 (CPU), 2.11 (CUDA) | ``distributed_c10d._world.pg_group_ranks[group]`` (global rank -> group rank) | the role's world numbers its members 0 .. size - 1 inside (sharded checkpoints check the default group's members) |

Per thread: the default group and the group counter a block sets belong to the thread that
entered it (the two slots above answer per thread while one of its blocks is open; torch's own
setters, outside any block, still write the process-wide value). So one thread can run a role's
engine inside its world while another makes the world's collectives (the free-running generator,
``verl.trainer.step.generator``). The members' numbering (``pg_group_ranks[group]``) is one dict
for the process: while any thread is inside ``group``'s block, every thread sees ``group``'s
members numbered 0 .. size - 1, so code on another thread must not ask for that group's ranks then
(the generator's owner pauses it before any call of the rollout's own).

``tests/parallel/test_role_world.py`` fails when this behaviour changes. Where the slot is missing
(another torch), :func:`role_world` raises for a group that is not the world, naming the torch
version, so a split placement fails at build time instead of hanging later.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist

__all__ = ["role_world", "spans_world"]


def spans_world(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` is None, the world, or a group of every rank of the world."""
    if group is None or group is dist.group.WORLD:
        return True
    return dist.get_world_size(group) == dist.get_world_size()


# The enclosing world's default group -> {a role world's global ranks: its group counter}. Keyed by
# the group object (the entries go when it is freed), never by id(): a later world's group may
# reuse a dead one's id on some ranks only, and those ranks alone then continued the dead world's
# count, so the role's ranks named the same new group differently and each waited for the other
# for ever (in new_group, under load).
_COUNTERS: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple[int, ...], int]] = weakref.WeakKeyDictionary()
_COUNTER_BASE = 1_000_000
# The blocks this thread is inside, innermost last: [group, its group counter] each.
_LOCAL = threading.local()
_LOCK = threading.Lock()
# A group whose block some thread is inside -> [threads inside, its members' numbering outside].
_NUMBERED: dict[dist.ProcessGroup, list] = {}


def _blocks() -> list[list]:
    blocks = getattr(_LOCAL, "blocks", None)
    if blocks is None:
        blocks = _LOCAL.blocks = []
    return blocks


def _per_thread(world) -> None:
    """Make ``world``'s ``default_pg`` and ``group_count`` slots answer the innermost block of the
    asking thread, and the process-wide value outside any (once per process)."""
    cls = type(world)
    with _LOCK:
        if getattr(cls, "_verl_per_thread", False):
            return
        default_pg, group_count = cls.default_pg, cls.group_count

        def get_pg(self):
            blocks = getattr(_LOCAL, "blocks", None)
            return blocks[-1][0] if blocks else default_pg.fget(self)

        def get_count(self):
            blocks = getattr(_LOCAL, "blocks", None)
            return blocks[-1][1] if blocks else group_count.fget(self)

        def set_count(self, value):
            blocks = getattr(_LOCAL, "blocks", None)
            if blocks:
                blocks[-1][1] = value
            else:
                group_count.fset(self, value)

        cls.default_pg = property(get_pg, default_pg.fset, doc=default_pg.__doc__)
        cls.group_count = property(get_count, set_count, doc=group_count.__doc__)
        cls._verl_per_thread = True


def _slot():
    from torch.distributed import distributed_c10d

    world = getattr(distributed_c10d, "_world", None)
    if world is None or not all(
        isinstance(getattr(type(world), name, None), property) for name in ("default_pg", "group_count", "pg_group_ranks")
    ):
        raise RuntimeError(
            f"role_world: torch {torch.__version__} has no distributed_c10d._world.default_pg, which a role on "
            "part of the world needs (trainer.placement); place every role on every rank, or use a torch that "
            "verl.parallel.role_world lists"
        )
    return world


@contextlib.contextmanager
def role_world(group: dist.ProcessGroup | None) -> Iterator[None]:
    """Run the block with ``group`` as the default process group (see the module docstring).

    ``group`` None or the whole world: the block runs unchanged. Nested blocks restore the
    enclosing one's group on exit. Only a member of ``group`` may enter it.
    """
    if spans_world(group):
        yield
        return
    world = _slot()
    blocks = _blocks()
    if blocks and blocks[-1][0] is group:  # nested in this thread: the same world, unchanged
        yield
        return
    _per_thread(world)
    previous = world.default_pg
    with _LOCK:  # inside, the role's world numbers its ranks 0 .. size - 1, its own members included
        entry = _NUMBERED.get(group)
        numbering = entry[1] if entry is not None else world.pg_group_ranks[group]  # (another thread may be inside)
        if dist.get_rank() not in numbering:
            raise ValueError(
                f"role_world: global rank {dist.get_rank()} is not one of the group's ranks "
                f"{sorted(numbering)}; only the role's ranks run its calls"
            )
        ranks = tuple(sorted(numbering, key=numbering.__getitem__))
        if entry is None:
            entry = _NUMBERED[group] = [0, numbering]
            world.pg_group_ranks[group] = {i: i for i in range(len(ranks))}
        entry[0] += 1
    counters = _COUNTERS.setdefault(previous, {})
    blocks.append([group, counters.get(ranks, _COUNTER_BASE * (1 + ranks[0]))])
    try:
        yield
    finally:
        counters[ranks] = blocks.pop()[1]
        with _LOCK:
            entry[0] -= 1
            if entry[0] == 0:
                world.pg_group_ranks[group] = entry[1]
                del _NUMBERED[group]
