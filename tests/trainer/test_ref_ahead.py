"""The reference on the rollout's rank in a streaming mode (``trainer.placement.rollout=[1]``,
``trainer.placement.ref=[1]``, one_step_off GRPO with a KL loss, 3 steps): the rollout's rank
computes each batch's reference log-probs as it generates it (``RLWorld.ref_ahead``), the batch
brings them to rank 0, and rank 0's step runs no reference pass and waits for none.

- rank 0 never runs the reference; rank 1 runs it once per batch, steps 2's and 3's inside the
  update step before it (while rank 0 trains), step 1's at the step's start (nothing was ahead);
- the run trains what the same run with the reference on the actor's rank trains, number for
  number (the same samples, reference log-probs and updates);
- rank 1 only generates (``RLWorld.generates_only``): rank 0 exchanges with no one over its group;
- a run killed after step 2 (its queue holds step 3's batch with its reference log-probs) and
  resumed trains the uninterrupted run's step 3 exactly;
- a batch whose samples are dropped as stale (``stale_samples=drop``) gets its reference
  log-probs anew with the samples drawn again.
"""

from __future__ import annotations

import os

import pytest

from verl.testing.distributed import run_distributed

from .test_rollout_modes import APART, _metrics, config, mark_overlap

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

REF_APART = [*APART, "trainer.placement.ref=[1]"]


def _body(model_dir: str, files: dict[str, str], root: str) -> dict:
    import torch

    from verl.trainer.ppo_trainer import PPOTrainer

    rank = torch.distributed.get_rank()
    calls: dict[str, list] = {}

    def run(name: str, *extra: str, stop_after: int | None = None, resume: str = "disable") -> tuple[int, int]:
        cfg = config(model_dir, files, f"{root}/{name}", "trainer.rollout_mode=one_step_off", *extra, resume=resume)
        with PPOTrainer(cfg) as trainer:
            assert trainer.use_reference
            seen = calls.setdefault(name, [])
            reference = trainer.pieces.compute_ref_log_prob
            inside = mark_overlap(trainer) if trainer.stream is not None else [False]

            def counted(batch):  # (the step the batch is for: uid "step-1/draw/i", inside an update step)
                seen.append((int(batch.non_tensors["uid"][0].split("/")[0]) + 1, inside[0]))
                return reference(batch)

            trainer.pieces.compute_ref_log_prob = counted
            seen.append(("world", trainer.world.ref_ahead, trainer.world.generates_only))
            start = trainer.resume()
            trainer.fit(stop_after=stop_after)
            return start, trainer.global_step

    steps = {
        "actor_ref": run("actor_ref", *APART),
        "ahead": run("ahead", *REF_APART),
        "killed": run("killed", *REF_APART, "trainer.save_freq=1", stop_after=2),
        "resumed": run("killed", *REF_APART, "trainer.save_freq=1", resume="auto"),
        # a queue saved with a looser bound (steps 2's and 3's batches, version 0), resumed with
        # bound 1 and stale_samples=drop: step 3's samples are sampled again, their reference anew
        "loose": run("loose", *REF_APART, "trainer.rollout_mode=async", "trainer.async_training.max_staleness=2",
                     "trainer.save_freq=1", stop_after=1),
        "tight": run("loose", *REF_APART, "trainer.rollout_mode=async", "trainer.async_training.max_staleness=1",
                     "trainer.async_training.stale_samples=drop", resume="auto"),
    }
    out: dict = {"rank": rank, "steps": steps, "calls": calls}
    if rank == 0:
        for name in ("actor_ref", "ahead", "killed", "loose"):
            out[name] = _metrics(f"{root}/{name}/logs")
            out[f"{name}_all"] = _metrics(f"{root}/{name}/logs", keep_all=True)
        out["queue"] = sorted(os.listdir(f"{root}/killed/global_step_2/rollout_queue"))
    return out


@pytest.mark.timeout(900)
def test_reference_on_the_rollouts_rank_is_computed_with_the_batch(tiny_model_dir, arithmetic_files, tmp_path):
    [actor, rollout] = run_distributed(_body, 2, tiny_model_dir, arithmetic_files, str(tmp_path), timeout=860)
    assert actor["steps"] == rollout["steps"] == {
        "actor_ref": (0, 3), "ahead": (0, 3), "killed": (0, 2), "resumed": (2, 3), "loose": (0, 1), "tight": (1, 3),
    }
    # the reference with the actor: rank 0 runs it in each step, rank 1 (only the rollout) never
    assert actor["calls"]["actor_ref"] == [("world", False, False), (1, False), (2, False), (3, False)]
    assert rollout["calls"]["actor_ref"] == [("world", False, True)]
    # the reference with the rollout: rank 0 never runs it; rank 1 runs it once per batch, step 1's
    # at its start, the next steps' inside the update step before theirs (while rank 0 trains)
    assert actor["calls"]["ahead"] == [("world", True, False)]
    assert rollout["calls"]["ahead"] == [("world", True, True), (1, False), (2, True), (3, True)]
    # killed after step 2 (step 3's batch, with its reference log-probs, in the queue); resumed,
    # rank 1 computes none again
    assert rollout["calls"]["killed"] == [("world", True, True), (1, False), (2, True), (3, True), ("world", True, True)]
    ahead, base = actor["ahead"], actor["actor_ref"]
    for step in (1, 2, 3):  # the same rows in the same micro-batches of the same model: bit for bit
        differ = {k: (v, base[step].get(k)) for k, v in ahead[step].items() if base[step].get(k) != v}
        assert not differ and set(ahead[step]) == set(base[step]), (step, differ)
    assert ahead[1]["actor/kl_loss"] > 0 or ahead[2]["actor/kl_loss"] > 0  # the reference is used
    everything = actor["ahead_all"]
    assert [everything[s]["staleness/max"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert [everything[s]["timing_s/ref_ahead"] > 0 for s in (1, 2, 3)] == [True] * 3
    assert all("timing_s/ref" not in everything[s] for s in (1, 2, 3))  # rank 0 timed no reference pass
    # the resumed run: step 3 is the uninterrupted run's, number for number
    assert "0.batch" in actor["queue"]
    assert actor["killed"] == ahead
    # the drop: step 3's batch (begun at version 0, trained from 2) is sampled again at its step and
    # its reference log-probs computed then, on rank 1 (its old ones went with the dropped samples)
    assert rollout["calls"]["loose"] == [("world", True, True), (1, False), (2, True), (3, True), ("world", True, True), (3, False)]
    loose = actor["loose_all"]
    assert [loose[s].get("async/stale_dropped") for s in (2, 3)] == [0.0, 32.0]
    assert loose[3]["staleness/max"] == 0.0 and loose[3]["actor/kl_loss"] > 0
