"""Collectives of ``verl.protocol`` (scatter, gather, all_gather, broadcast) on 2 and 4 ranks.

Each body runs on every rank through the project's worker pool (gloo here, NCCL where CUDA has
enough devices) and returns its result batch; the assertions run in the test process against
the same batch built locally, so ``expected`` never passes through the code under test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from verl.protocol import Batch, all_gather, broadcast, gather, scatter
from verl.testing.distributed import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


def mixed_batch(n: int, offset: int = 0) -> Batch:
    """``n`` rows of every dtype the trainer moves, values tied to the row number + ``offset``."""
    rows = torch.arange(offset, offset + n)
    gen = torch.Generator().manual_seed(offset)
    wide = torch.randn(4, n, generator=gen)
    return Batch.from_dict(
        tensors={
            "input_ids": rows[:, None] * 100 + torch.arange(5),  # [B, T] int64
            "attention_mask": (torch.arange(5) < (rows[:, None] % 5 + 1)),  # [B, T] bool
            "old_log_probs": torch.randn(n, 3, generator=gen),  # [B, R] float32
            "advantages": torch.randn(n, 3, generator=gen).to(torch.bfloat16),  # [B, R] bfloat16
            "values": torch.randn(n, 3, generator=gen).half(),  # [B, R] float16
            "position_ids": torch.arange(n * 2 * 5, dtype=torch.int32).reshape(n, 2, 5),  # [B, 2, T]
            "scores": rows.to(torch.uint8),  # [B] (odd byte count: checks the packing alignment)
            "transposed": wide.t(),  # [B, 4], not contiguous
        },
        non_tensors={
            "uid": [f"prompt-{i}" for i in rows.tolist()],
            "data_source": np.array([["gsm8k", "math"][i % 2] for i in rows.tolist()]),
            "reward_model": [{"ground_truth": str(i), "extra": [i, {"k": i}]} for i in rows.tolist()],
            "pairs": np.arange(2 * n).reshape(n, 2) + offset,
        },
        meta_info={"temperature": 0.6, "global_step": 7},
    )


def assert_same(actual: Batch, expected: Batch) -> None:
    assert actual is not None
    assert len(actual) == len(expected), (len(actual), len(expected))
    assert actual.keys() == expected.keys()
    for key, tensor in expected.tensors.items():
        assert actual[key].dtype == tensor.dtype, key
        assert torch.equal(actual[key].cpu(), tensor), key
    assert actual.equals(expected)


# ---------------------------------------------------------------------- bodies (run on every rank)


def body_scatter(n_rows: int, src: int) -> Batch:
    batch = mixed_batch(n_rows) if dist.get_rank() == src else None
    return scatter(batch, src=src).to("cpu")


def body_gather_uneven(dst: int) -> Batch | None:
    # Rank r holds r + 1 rows, starting where rank r - 1's rows end.
    rank = dist.get_rank()
    local = mixed_batch(rank + 1, offset=rank * (rank + 1) // 2)
    out = gather(local, dst=dst)
    return None if out is None else out.to("cpu")


def body_all_gather_uneven() -> Batch:
    rank = dist.get_rank()
    local = mixed_batch(rank + 1, offset=rank * (rank + 1) // 2)
    return all_gather(local).to("cpu")


def body_broadcast(src: int) -> Batch:
    batch = mixed_batch(3, offset=40) if dist.get_rank() == src else None
    return broadcast(batch, src=src).to("cpu")


def body_round_trip(n_rows: int) -> Batch | None:
    """The trainer's pattern: scatter to workers, each adds a column, gather back."""
    batch = mixed_batch(n_rows) if dist.get_rank() == 0 else None
    local = scatter(batch, src=0)
    local["rewards"] = local["old_log_probs"].float() * 2  # [B/n, R]
    out = gather(local, dst=0)
    return None if out is None else out.to("cpu")


def body_subgroup() -> dict:
    """World of 4, collectives on the group of global ranks [1, 3] (group ranks 0 and 1)."""
    group = dist.new_group([1, 3])
    rank = dist.get_rank()
    if rank not in (1, 3):
        try:
            all_gather(mixed_batch(1), group=group)
        except ValueError as exc:
            return {"non_member_error": str(exc)}
        return {"non_member_error": None}
    group_rank = dist.get_rank(group)
    # src=1 is a group rank: global rank 3 owns the batch.
    scattered = scatter(mixed_batch(6) if rank == 3 else None, group=group, src=1)
    gathered = gather(scattered, group=group, dst=1)
    everyone = all_gather(mixed_batch(group_rank + 2, offset=10 * group_rank), group=group)
    bcast = broadcast(mixed_batch(2, offset=50) if group_rank == 0 else None, group=group, src=0)
    return {
        "scattered": scattered.to("cpu"),
        "gathered": None if gathered is None else gathered.to("cpu"),
        "all_gathered": everyone.to("cpu"),
        "broadcast": bcast.to("cpu"),
    }


def body_errors() -> dict:
    """Every rank must raise the same error (none may hang), and the group must stay usable."""
    rank = dist.get_rank()
    messages = {}
    try:
        scatter(mixed_batch(5) if rank == 0 else None, src=0)
    except ValueError as exc:
        messages["uneven_scatter"] = str(exc)
    local = mixed_batch(2)
    if rank == 1:
        local["advantages"] = local["advantages"].float()
    try:
        gather(local, dst=0)
    except ValueError as exc:
        messages["dtype_mismatch"] = str(exc)
    local = mixed_batch(2)
    local.meta_info["global_step"] = 7 + rank
    try:
        all_gather(local)
    except ValueError as exc:
        messages["meta_mismatch"] = str(exc)
    try:
        broadcast("not a batch" if rank == 0 else None, src=0)
    except ValueError as exc:
        messages["not_a_batch"] = str(exc)
    try:
        scatter(None, src=dist.get_world_size())
    except ValueError as exc:
        messages["bad_src"] = str(exc)
    # The group still works after all of that.
    messages["after"] = len(all_gather(mixed_batch(1)))
    return messages


def body_no_tensor_data() -> dict:
    rank = dist.get_rank()
    only_objects = Batch.from_dict(non_tensors={"uid": ["a", "b"]}, meta_info={"step": 1})
    empty = Batch.from_dict(tensors={"x": torch.zeros(0, 3)}, non_tensors={"uid": []})
    return {
        "broadcast_objects": broadcast(only_objects if rank == 0 else None, src=0),
        "scatter_empty": scatter(empty if rank == 0 else None, src=0).to("cpu"),
        "all_gather_empty": all_gather(empty).to("cpu"),
    }


# ---------------------------------------------------------------------- tests (parent process)


@pytest.mark.parametrize("world_size", [2, 4])
def test_scatter_gives_each_rank_its_contiguous_chunk(world_size):
    src = world_size - 1
    results = run_distributed(body_scatter, world_size, 2 * world_size, src)
    expected_chunks = mixed_batch(2 * world_size).chunk(world_size)
    for rank, (actual, expected) in enumerate(zip(results, expected_chunks)):
        assert list(actual["uid"]) == [f"prompt-{2 * rank}", f"prompt-{2 * rank + 1}"]
        assert_same(actual, expected)


@pytest.mark.parametrize("world_size", [2, 4])
def test_gather_concatenates_in_rank_order_with_uneven_lengths(world_size):
    dst = 1
    results = run_distributed(body_gather_uneven, world_size, dst)
    total = world_size * (world_size + 1) // 2
    # mixed_batch's random columns depend on the offset seed: rebuild them per rank's part.
    expected = Batch.concat([mixed_batch(r + 1, offset=r * (r + 1) // 2) for r in range(world_size)])
    assert list(expected["uid"]) == [f"prompt-{i}" for i in range(total)]
    for rank, actual in enumerate(results):
        if rank == dst:
            assert_same(actual, expected)
        else:
            assert actual is None


def test_all_gather_gives_every_rank_the_same_concatenation():
    world_size = 4
    results = run_distributed(body_all_gather_uneven, world_size)
    expected = Batch.concat([mixed_batch(r + 1, offset=r * (r + 1) // 2) for r in range(world_size)])
    for actual in results:
        assert_same(actual, expected)


@pytest.mark.parametrize("world_size", [2, 4])
def test_broadcast_reaches_every_rank(world_size):
    results = run_distributed(body_broadcast, world_size, world_size - 1)
    for actual in results:
        assert_same(actual, mixed_batch(3, offset=40))


def test_scatter_then_gather_round_trip():
    results = run_distributed(body_round_trip, 2, 6)
    expected = mixed_batch(6)
    expected["rewards"] = expected["old_log_probs"] * 2
    assert_same(results[0], expected)
    assert results[1] is None


def test_collectives_on_a_subgroup_use_group_ranks():
    results = run_distributed(body_subgroup, 4)
    for rank in (0, 2):
        assert "not a member" in results[rank]["non_member_error"]
        assert f"global rank {rank}" in results[rank]["non_member_error"]
    source = mixed_batch(6)
    assert_same(results[1]["scattered"], source[:3])
    assert_same(results[3]["scattered"], source[3:])
    assert results[1]["gathered"] is None
    assert_same(results[3]["gathered"], source)
    expected_all = Batch.concat([mixed_batch(2, offset=0), mixed_batch(3, offset=10)])
    for rank in (1, 3):
        assert_same(results[rank]["all_gathered"], expected_all)
        assert_same(results[rank]["broadcast"], mixed_batch(2, offset=50))


def test_errors_are_raised_on_every_rank_and_do_not_hang():
    results = run_distributed(body_errors, 2, timeout=60.0)
    for rank, messages in enumerate(results):
        assert "pad_to_divisor(2)" in messages["uneven_scatter"]
        assert "5 rows" in messages["uneven_scatter"]
        assert "tensors['advantages'] is float32 in rank 1 but bfloat16 in rank 0" in messages["dtype_mismatch"]
        assert "meta_info['global_step'] differs between rank 0 (7) and rank 1 (8)" in messages["meta_mismatch"]
        assert "rank 0 passed a str, not a Batch" in messages["not_a_batch"]
        assert "src=2 is not a rank of the group" in messages["bad_src"]
        assert messages["after"] == 2
    assert results[0] == results[1]


def test_batches_without_tensor_bytes():
    results = run_distributed(body_no_tensor_data, 2)
    for actual in results:
        objects = actual["broadcast_objects"]
        assert len(objects) == 2 and list(objects["uid"]) == ["a", "b"] and objects.meta_info == {"step": 1}
        assert len(actual["scatter_empty"]) == 0 and actual["scatter_empty"]["x"].shape == (0, 3)
        assert len(actual["all_gather_empty"]) == 0
