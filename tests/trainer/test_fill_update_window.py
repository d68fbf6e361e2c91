"""``trainer.async_training.fill_update_window``: async GRPO with partial rollout on 2 ranks, the
rollout on rank 1 (and on 3 ranks, the rollout on ranks 1 and 2, data parallel), ``max_staleness=2``, responses of 12 tokens in segments of 5, and an actor update
slowed by a sleep (patched into rank 0's ``update_actor``). The rollout's rank keeps running
segments while the update runs, until the actor's rank signals that it is done.

Which version samples which token now depends on timing, so the test asserts invariants, not a
pattern: the rollout's rank ran more than one segment of a batch in one update window (the fixed
schedule runs exactly one); per sample, the bound; per token, versions non-decreasing, the first
the sample's ``rollout_version``, each at most the version its update starts from; and every
segment ran on the weights of the version it records (the engine's weights, summed, at each
segment: one sum per version, a different one for each). With two rollout ranks, both ran the same
segments (each segment is a collective of theirs: a rank that stopped alone would hang the other).
"""

from __future__ import annotations

import pytest

from verl.testing.distributed import run_distributed

from .test_free_running import _check_batches, _check_weights
from .test_partial_rollout_trainer import PARTIAL, SEGMENT
from .test_rollout_modes import APART, _metrics, config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SLOW_UPDATE_S = 3.0


def _body(model_dir: str, files: dict[str, str], root: str, world: int) -> dict:
    import time

    import torch

    from verl.trainer.ppo_trainer import PPOTrainer
    from verl.trainer.step.partial import PartialBatch

    cfg = config(
        model_dir, files, f"{root}/fill", *PARTIAL,
        *(APART if world == 2 else ["trainer.placement.rollout=[1,2]", "trainer.n_gpus_per_node=3"]),
        "trainer.async_training.fill_update_window=true",
        world_size=world,
    )
    seen: dict[int, dict[str, list]] = {}
    window: list[int | None] = [None]  # the step whose update runs now
    segments: list[tuple[int | None, int, int, float]] = []  # (window, batch, version, the engine's weights summed)
    with PPOTrainer(cfg) as trainer:
        update_step, advance = trainer.pieces.update_step, PartialBatch.advance

        def recording(batch, metrics=None):
            step = trainer.pieces.step_in_progress()
            seen[step] = {key: batch[key].tolist() for key in ("rollout_token_versions", "rollout_version", "response_mask")}
            window[0] = step
            try:
                return update_step(batch, metrics)
            finally:
                window[0] = None

        def counting(self, segment, version):  # the rollout's rank
            weights = sum(float(p.detach().double().sum()) for p in trainer.rollout.engine.model.parameters())
            segments.append((window[0], id(self), int(version), weights))
            return advance(self, segment, version)

        trainer.pieces.update_step = recording
        PartialBatch.advance = counting
        if trainer.pieces.runs("actor"):
            update_actor = trainer.pieces.update_actor

            def slow(batch):
                time.sleep(SLOW_UPDATE_S)
                return update_actor(batch)

            trainer.pieces.update_actor = slow
        try:
            trainer.fit()
        finally:
            PartialBatch.advance = advance
        out = {"steps": trainer.global_step, "seen": seen, "segments": segments, "rank": torch.distributed.get_rank()}
    out["metrics"] = _metrics(f"{root}/fill/logs", keep_all=True) if out["rank"] == 0 else None
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
def test_fill_update_window_keeps_generating_until_the_update_ends(tiny_model_dir, arithmetic_files, tmp_path, world):
    [actor, rollout, *more] = run_distributed(_body, world, tiny_model_dir, arithmetic_files, str(tmp_path), world,
                                              timeout=560)
    assert actor["steps"] == rollout["steps"] == 4
    assert actor["segments"] == []  # the actor's rank generates nothing
    for other in more:  # the second rollout rank: the same segments, in the same windows, on the same weights
        assert other["steps"] == 4 and other["seen"] == rollout["seen"]
        assert [s[:1] + s[2:] for s in other["segments"]] == [s[:1] + s[2:] for s in rollout["segments"]]
    segments = rollout["segments"]
    # more than one segment of a batch in one update window (the fixed schedule runs one of each)
    per_window: dict[tuple[int, int], int] = {}
    for step, batch, _, _ in segments:
        if step is not None:
            per_window[(step, batch)] = per_window.get((step, batch), 0) + 1
    assert max(per_window.values()) > 1, per_window
    # every segment ran on the weights of the version it records
    _check_weights(segments)
    # window s generates with the weights its update starts from (version s - 1)
    assert all(version == step - 1 for step, _, version, _ in segments if step is not None)
    assert actor["seen"] == rollout["seen"]  # every rank trains the same batch
    _check_batches(actor["seen"])  # the bound per sample, the per-token invariants
    for step, batch in actor["seen"].items():  # a token j comes no earlier than the fixed schedule's: segments only move earlier
        for versions, mask, began in zip(batch["rollout_token_versions"], batch["response_mask"], batch["rollout_version"]):
            sampled = versions[: int(sum(mask))]
            assert all(v <= min(began + j // SEGMENT, step - 1) for j, v in enumerate(sampled)), (step, versions)
    metrics = actor["metrics"]
    assert [metrics[s]["staleness/max"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 2.0, 2.0]


def _agree_body(agree: bool) -> bool:
    """Rank 0 has read the actor's update count change on the store, rank 1 not yet (its
    ``_updates_before`` is the count now): ``_update_is_done`` on each, with the rollout's group
    (``agree``) or without one."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from verl.trainer.step.stream import _UPDATES_KEY, StreamRolloutOperator

    store = StreamRolloutOperator._store()
    count = int(store.add(_UPDATES_KEY, 0))
    dist.barrier()  # both read the same count before either compares
    op = StreamRolloutOperator.__new__(StreamRolloutOperator)
    op._updates_before = count - 1 if dist.get_rank() == 0 else count
    op._trainer = SimpleNamespace(rollout=SimpleNamespace(world=dist.group.WORLD if agree else None))
    return op._update_is_done(store)


@pytest.mark.timeout(300)
def test_rollout_ranks_stop_together_when_only_one_has_seen_the_update_end():
    # Without the agreement the two ranks answer differently (one would run a segment, a collective,
    # that the other never joins); with it both stop.
    assert run_distributed(_agree_body, 2, False) == [True, False]
    assert run_distributed(_agree_body, 2, True) == [True, True]
