"""``role_world``: inside it a role's ranks are the world (torch's private default-group state,
pinned here: this test fails when torch changes how group-less calls find their group)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from verl.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed


def _inside_and_after() -> dict[str, object]:
    from torch.distributed import distributed_c10d

    from verl.parallel.role_world import role_world, spans_world

    rank = dist.get_rank()
    # Roles apart on 3 ranks: {0} and {1, 2}, each group made by the whole world.
    groups = {(0,): dist.new_group([0]), (1, 2): dist.new_group([1, 2])}
    mine = groups[(0,)] if rank == 0 else groups[(1, 2)]
    count_before = distributed_c10d._world.group_count
    out: dict[str, object] = {"spans": (spans_world(None), spans_world(dist.group.WORLD), spans_world(mine))}
    with role_world(mine):
        out["rank"], out["size"] = dist.get_rank(), dist.get_world_size()
        gathered: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, rank)  # no group: the role's ranks only
        out["gathered"] = gathered
        dist.barrier()
        # A group made inside, by the role's ranks numbered as its world numbers them.
        inner = dist.new_group(list(range(dist.get_world_size())))
        out["inner_rank"] = dist.get_rank(inner)
        value = torch.tensor([float(rank)])
        dist.all_reduce(value, group=inner)
        out["inner_sum"] = value.item()
        out["default_members"] = dist.get_process_group_ranks(dist.group.WORLD)
        with role_world(mine):  # nested: the same world, unchanged
            out["nested_size"] = dist.get_world_size()
    # After: the world again, its group counter in step on every rank, so a group made now by
    # every rank (the world's sequence) still meets.
    out["after"] = (dist.get_rank(), dist.get_world_size(), distributed_c10d._world.group_count == count_before)
    late = dist.new_group([0, 1, 2])
    value = torch.tensor([1.0])
    dist.all_reduce(value, group=late)
    out["late_sum"] = value.item()
    out["mine_members"] = dist.get_process_group_ranks(mine)
    if rank == 1:
        try:
            with role_world(groups[(0,)]):
                pass
        except ValueError as exc:
            out["refused"] = str(exc)
    return out


def test_a_role_world_is_the_world_inside_and_leaves_no_trace():
    actual = run_distributed(_inside_and_after, 3)
    assert [a["spans"] for a in actual] == [(True, True, False)] * 3
    assert [(a["rank"], a["size"]) for a in actual] == [(0, 1), (0, 2), (1, 2)]
    assert [a["gathered"] for a in actual] == [[0], [1, 2], [1, 2]]
    assert [a["inner_rank"] for a in actual] == [0, 0, 1]
    assert [a["inner_sum"] for a in actual] == [0.0, 3.0, 3.0]
    assert [a["default_members"] for a in actual] == [[0], [0, 1], [0, 1]]
    assert [a["nested_size"] for a in actual] == [1, 2, 2]
    assert [a["after"] for a in actual] == [(0, 3, True), (1, 3, True), (2, 3, True)]
    assert [a["late_sum"] for a in actual] == [3.0] * 3
    assert [a["mine_members"] for a in actual] == [[0], [1, 2], [1, 2]]
    assert "global rank 1 is not one of the group's ranks [0]" in actual[1]["refused"]


def _counters_after_the_world_ends() -> tuple[int, int, bool]:
    import gc
    import weakref

    from verl.parallel import role_world as rw

    rank = dist.get_rank()
    # Another call's world may still be alive in this pooled worker (an object a test kept): its
    # counter is its own, keyed by that world's group, and no concern of this one.
    before = len(rw._COUNTERS)
    world = weakref.ref(dist.group.WORLD)
    groups = {(0,): dist.new_group([0]), (1, 2): dist.new_group([1, 2])}
    with rw.role_world(groups[(0,)] if rank == 0 else groups[(1, 2)]):
        dist.new_group(list(range(dist.get_world_size())))  # advances the role world's counter
    during = len(rw._COUNTERS) - before
    del groups
    dist.destroy_process_group()
    gc.collect()
    gone = world() is None or world() not in rw._COUNTERS
    return during, len(rw._COUNTERS) - before, gone


def test_a_role_worlds_group_counter_ends_with_its_world():
    """The counter a role world names its groups by belongs to the world it was made in.

    Kept past the world (it was keyed by the id of the world's group), it was picked up by a later
    world whose group reused that id, on some ranks and not others: those ranks named the role's
    next group differently and waited for each other in new_group until the test timed out (1 in
    ~13 runs of two roles apart on a loaded machine). Nothing of a world may outlive it. (Counted
    against the counters present before: a loaded pass found another call's world still alive in
    the pooled worker, its counter with it.)
    """
    actual = run_distributed(_counters_after_the_world_ends, 3)
    assert actual == [(1, 0, True)] * 3


def _recorded_then_restored() -> tuple[list[tuple[str, int, bool]], float]:
    from verl.testing.collectives import record_collectives

    rank = dist.get_rank()
    pair = dist.new_group([0, 1])  # every rank makes every group (torch names them by a counter)
    value = torch.tensor([1.0])
    with record_collectives() as calls:
        dist.all_reduce(value)
        gathered: list[object] = [None] * 3
        dist.all_gather_object(gathered, rank)
        if rank < 2:
            dist.barrier(group=pair)
    seen = [(c.op, c.size, c.group is dist.group.WORLD) for c in calls]
    after = torch.tensor([2.0])
    dist.all_reduce(after)  # the methods work again once the block is left
    return seen, after.item()


def test_the_collective_recorder_sees_each_group_and_restores_torch():
    """``verl.testing.collectives`` (the tests' check that roles apart stay off the world's group)."""
    actual = run_distributed(_recorded_then_restored, 3)
    world = [("allreduce", 3, True), ("allgather", 3, True), ("allgather", 3, True)]
    assert [seen for seen, _ in actual] == [world + [("barrier", 2, False)]] * 2 + [world]
    assert [after for _, after in actual] == [6.0] * 3


def _two_threads_two_worlds() -> dict[str, object]:
    """Ranks 1 and 2 hold a role apart: a second thread runs group-less collectives inside the
    role's world while the main thread runs group-less collectives of the whole world."""
    import threading

    from verl.parallel.role_world import role_world

    rank = dist.get_rank()
    pair = dist.new_group([1, 2])
    rounds = 30
    out: dict[str, object] = {}
    started = threading.Barrier(2) if rank > 0 else None

    def role() -> None:
        with role_world(pair):
            started.wait()
            sums, ranks = [], set()
            for _ in range(rounds):
                value = torch.tensor([10.0 * rank])
                dist.all_reduce(value)  # no group: the role's ranks only
                sums.append(value.item())
                ranks.add((dist.get_rank(), dist.get_world_size()))
            out["role"] = (sorted(set(sums)), sorted(ranks))

    thread = threading.Thread(target=role) if rank > 0 else None
    if thread is not None:
        thread.start()
        started.wait()  # the role's block is open on the other thread from here
    sums, ranks = [], set()
    for _ in range(rounds):
        value = torch.tensor([float(rank)])
        dist.all_reduce(value)  # no group: the whole world
        sums.append(value.item())
        ranks.add((dist.get_rank(), dist.get_world_size()))
    out["world"] = (sorted(set(sums)), sorted(ranks))
    if thread is not None:
        thread.join()
    out["after"] = dist.get_process_group_ranks(pair) if rank > 0 else None
    return out


def test_a_role_world_on_one_thread_leaves_the_other_threads_in_the_world():
    """The free-running generator's engine runs in the rollout's world on a thread of its own while
    the main thread takes part in the world's collectives (``verl.trainer.step.generator``)."""
    actual = run_distributed(_two_threads_two_worlds, 3)
    assert [a["world"] for a in actual] == [([3.0], [(r, 3)]) for r in range(3)]
    assert [a.get("role") for a in actual] == [None, ([30.0], [(0, 2)]), ([30.0], [(1, 2)])]
    assert [a["after"] for a in actual] == [None, [1, 2], [1, 2]]
