"""The streaming rollout's schedule with the rollout on a rank of its own (``trainer.placement.rollout=[1]``,
one_step_off GRPO, 3 steps): the rollout's rank begins generating the next step's batch before the
actor's rank has finished the step's old-log-prob pass (``StepPieces.update_step`` calls the
generation ahead first on the ranks that only generate; they join no collective until the updates
end).

No clock is read: rank 0's old-log-prob pass waits (on torch.distributed's store) until rank 1 has
begun its generation ahead for that step, and rank 1 records, as it begins, whether rank 0 had
already finished that pass. A schedule that generates only after the passes (the update window
alone) deadlocks here (rank 1 waits in a collective for rank 0's pass) and the wait fails after
``WAIT_S`` with the step named. The run itself is the normal one: one version stale from step 2.
"""

from __future__ import annotations

import pytest

from verl.testing.distributed import run_distributed

from .test_rollout_modes import APART, _metrics, config, mark_overlap

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WAIT_S = 240  # a deadlock guard only: on a loaded machine rank 1 gets there in seconds


def _body(model_dir: str, files: dict[str, str], root: str) -> dict:
    import datetime

    import torch
    from torch.distributed.distributed_c10d import _get_default_store

    from verl.trainer.ppo_trainer import PPOTrainer

    cfg = config(
        model_dir, files, f"{root}/off", *APART, "trainer.rollout_mode=one_step_off",
        "actor_rollout_ref.actor.old_log_prob=recompute",  # (FAST's one mini-batch would take them from the update)
    )
    store = _get_default_store()
    events: list[tuple] = []
    with PPOTrainer(cfg) as trainer:
        rank = torch.distributed.get_rank()
        if trainer.rollout is not None:  # rank 1: mark the generation ahead as it begins
            generate = trainer.rollout.generate
            inside = mark_overlap(trainer)

            def generating(*args, **kwargs):
                if inside[0]:
                    step = trainer.global_step
                    events.append(("gen_ahead_begins", step, store.check([f"test/old_done/{step}"])))
                    store.set(f"test/gen_ahead/{step}", "1")
                return generate(*args, **kwargs)

            trainer.rollout.generate = generating
        if trainer.pieces.runs("actor"):  # rank 0: the old-log-prob pass ends only once rank 1 generates ahead
            old_log_prob = trainer.pieces.compute_old_log_prob

            def waiting(batch):
                step = trainer.global_step
                out = old_log_prob(batch)
                if step < trainer.total_steps:  # (the last step has nothing left to generate ahead)
                    try:
                        store.wait([f"test/gen_ahead/{step}"], datetime.timedelta(seconds=WAIT_S))
                    except Exception as exc:
                        raise AssertionError(
                            f"step {step}: the rollout's rank did not begin generating ahead while the actor's "
                            f"old-log-prob pass ran ({exc})"
                        ) from None
                store.set(f"test/old_done/{step}", "1")
                events.append(("old_log_prob_ends", step))
                return out

            trainer.pieces.compute_old_log_prob = waiting
        trainer.fit()
        out = {"rank": rank, "steps": trainer.global_step, "events": events}
    out["metrics"] = _metrics(f"{root}/off/logs", keep_all=True) if out["rank"] == 0 else None
    return out


@pytest.mark.timeout(600)
def test_generation_ahead_begins_before_the_old_log_prob_pass_ends(tiny_model_dir, arithmetic_files, tmp_path):
    [actor, rollout] = run_distributed(_body, 2, tiny_model_dir, arithmetic_files, str(tmp_path), timeout=560)
    assert actor["steps"] == rollout["steps"] == 3
    assert actor["events"] == [("old_log_prob_ends", 1), ("old_log_prob_ends", 2), ("old_log_prob_ends", 3)]
    # rank 1 generated steps 2's and 3's batches ahead, each begun before rank 0's pass of that step ended
    assert rollout["events"] == [("gen_ahead_begins", 1, False), ("gen_ahead_begins", 2, False)]
    metrics = actor["metrics"]
    assert [(metrics[s]["staleness/min"], metrics[s]["staleness/max"]) for s in (1, 2, 3)] == [(0, 0), (1, 1), (1, 1)]
    assert [metrics[s]["async/generated_in_update"] for s in (1, 2, 3)] == [1.0, 1.0, 0.0]
