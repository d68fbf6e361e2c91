"""A push to a rollout engine apart from the actor reports its totals over every rank: the actor's sent
bytes reach the step's metrics beside the engine's received bytes (``RLWorld.rollout_phase`` through
``verl.hybrid.weight_sync.push_totals``), where the rollout's ranks alone used to report theirs.

The sends are stand-ins that return what ``DisaggregatedSync.push`` returns on each side of a delta
push (the actor's rank counts what it sent, the engine's what it received), so that the reduction
and the world's wiring are checked alone; the real push's figures are tests/hybrid/test_delta_push.py's.
"""

from __future__ import annotations

import contextlib

from verl.testing.distributed import run_distributed

# What each rank's DisaggregatedSync.push returns in a delta push from rank 0 (the actor) to rank 1 (the engine).
ACTOR = {
    "timing_s/update_weights": 0.5, "update_weights/bytes_sent": 300.0, "update_weights/bytes_received": 0.0,
    "update_weights/bytes_full": 1200.0, "update_weights/sent_share": 0.25, "update_weights/full": 0.0,
    "update_weights/blocks_sent": 7.0, "update_weights/blocks_total": 30.0, "update_weights/checksum_failures": 0.0,
    "update_weights/buffer_bytes": 64.0,
}
ENGINE = {
    "timing_s/update_weights": 0.75, "update_weights/bytes_sent": 0.0, "update_weights/bytes_received": 300.0,
    "update_weights/bytes_full": 0.0, "update_weights/sent_share": 0.0, "update_weights/full": 0.0,
    "update_weights/blocks_sent": 0.0, "update_weights/blocks_total": 0.0, "update_weights/checksum_failures": 1.0,
    "update_weights/buffer_bytes": 96.0,
}


class _Send:
    def __init__(self, metrics: dict[str, float]) -> None:
        self.metrics = metrics

    def push(self) -> dict[str, float]:
        return dict(self.metrics)


class _Rollout:
    @contextlib.contextmanager
    def phase(self):
        yield {}  # an engine apart pushes nothing itself (the send did)


def _body() -> dict:
    import torch.distributed as dist

    from verl.trainer.world import RLWorld

    rank = dist.get_rank()
    world = RLWorld(cfg=None, world_size=2, topology=None, mine=frozenset(["actor"] if rank == 0 else ["rollout"]),
                    source={"actor": 0, "rollout": 1}, apart=frozenset(["actor", "rollout"]),
                    rollout=_Rollout() if rank == 1 else None, send=_Send(ACTOR if rank == 0 else ENGINE))
    with world.rollout_phase() as metrics:
        return dict(metrics)


def test_rollout_phase_reports_the_actors_sent_bytes_with_the_engines():
    actor_rank, engine_rank = run_distributed(_body, 2, timeout=120)
    assert actor_rank == {}  # the actor's rank holds no engine; the step's metrics come from the engine's rank
    expected = {
        "timing_s/update_weights": 0.75,  # the slower rank's
        "update_weights/bytes_sent": 300.0,  # the actor's (the engine's rank alone reported 0)
        "update_weights/bytes_received": 300.0,
        "update_weights/bytes_full": 1200.0,
        "update_weights/sent_share": 0.25,  # sent over a full push, from the totals (the engine's rank had 0)
        "update_weights/full": 0.0,
        "update_weights/blocks_sent": 7.0,
        "update_weights/blocks_total": 30.0,
        "update_weights/checksum_failures": 1.0,
        "update_weights/buffer_bytes": 96.0,  # the larger rank's buffers
    }
    assert engine_rank == expected
