"""``verl.roles.dispatch``'s ``share_*`` over a process group that leaves a rank out (the streaming
rollout's ``RLWorld.trainer_group``: the ranks that only generate take no part): on 3 gloo ranks,
rank 2's columns and metrics reach rank 0 over the group {0, 2} while rank 1 joins nothing, then
the same over the world (``group=None``) as before."""

from __future__ import annotations

import pytest

from verl.testing.distributed import run_distributed

pytestmark = [pytest.mark.distributed]


def _body() -> dict:
    import torch
    import torch.distributed as dist

    from verl.roles.dispatch import share_columns, share_object

    rank = dist.get_rank()
    group = dist.new_group(ranks=[0, 2])
    out: dict = {}
    if rank != 1:
        given = {"old_log_probs": torch.arange(6.0).reshape(2, 3) + 10 * rank} if rank == 2 else None
        out["columns"] = share_columns(given, 2, group)["old_log_probs"].tolist()
        out["metrics"] = share_object({"actor/entropy": 0.5} if rank == 2 else None, 2, group)
    world = share_columns({"x": torch.full((2,), float(rank))} if rank == 1 else None, 1)
    out["world"] = world["x"].tolist()
    return out


@pytest.mark.timeout(300)
def test_share_over_a_group_without_one_rank():
    [r0, r1, r2] = run_distributed(_body, 3, backend="gloo", timeout=240)
    sent = [[20.0, 21.0, 22.0], [23.0, 24.0, 25.0]]
    assert r0["columns"] == r2["columns"] == sent
    assert r0["metrics"] == r2["metrics"] == {"actor/entropy": 0.5}
    assert "columns" not in r1
    assert r0["world"] == r1["world"] == r2["world"] == [1.0, 1.0]
