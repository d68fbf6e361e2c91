"""``trainer.async_training.partial_rollout`` and ``stale_samples`` in the trainer: async GRPO on 2
ranks, the rollout on rank 1 (``trainer.placement.rollout=[1]``), ``max_staleness=2``, responses
of 12 tokens in segments of 5.

- every trained sample's tokens carry the versions that sampled them: a batch for step ``t`` begun
  with version ``b`` has its token ``j`` sampled by ``min(b + j // 5, t - 1)`` (one segment per
  update while it waits in the queue, the rest with the weights of its own step), and its
  ``rollout_version`` is ``b``; the bound holds per sample;
- a run killed at step 2 (its checkpoint holds the batches in flight) and resumed trains steps 3-4
  exactly as the uninterrupted run, per-token versions included; colocated (both roles on both
  ranks) the versions are the same;
- resumed with ``max_staleness=1`` and ``stale_samples=drop``, the samples begun 2 versions before
  their update are dropped (counted in ``async/stale_dropped``), their prompts sampled again with
  the current weights, and no trained sample exceeds the new bound.
"""

from __future__ import annotations

import shutil

import pytest

from verl.testing.distributed import run_distributed

from .test_rollout_modes import APART, _metrics, config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SEGMENT = 5
PARTIAL = [
    "trainer.rollout_mode=async",
    "trainer.async_training.max_staleness=2",
    "trainer.async_training.partial_rollout=true",
    f"trainer.async_training.partial_rollout_tokens={SEGMENT}",
    "trainer.total_training_steps=4",
]


def _body(model_dir: str, files: dict[str, str], root: str) -> dict:
    import torch

    from verl.trainer.ppo_trainer import PPOTrainer

    def run(name: str, *extra: str, stop_after: int | None = None, resume: str = "disable") -> dict:
        cfg = config(model_dir, files, f"{root}/{name}", *PARTIAL, *([] if name == "colocated" else APART), *extra, resume=resume)
        seen: dict[int, dict[str, list]] = {}
        with PPOTrainer(cfg) as trainer:
            update_step = trainer.pieces.update_step

            def recording(batch, metrics=None):  # the batch each update trains, as every rank holds it
                seen[trainer.pieces.step_in_progress()] = {
                    key: batch[key].tolist() for key in ("rollout_token_versions", "rollout_version", "response_mask", "responses")
                }
                return update_step(batch, metrics)

            trainer.pieces.update_step = recording
            start = trainer.resume()
            trainer.fit(stop_after=stop_after)
            return {"steps": (start, trainer.global_step), "seen": seen}

    out = {
        "colocated": run("colocated"),  # both roles on both ranks: the same schedule, one after the other
        "full": run("full"),
        "killed": run("killed", "trainer.save_freq=1", stop_after=2),
    }
    if torch.distributed.get_rank() == 0:
        shutil.copytree(f"{root}/killed", f"{root}/tighter")
    torch.distributed.barrier()
    out["resumed"] = run("killed", "trainer.save_freq=1", resume="auto")
    out["drop"] = run("tighter", "trainer.save_freq=1", "trainer.async_training.max_staleness=1",
                      "trainer.async_training.stale_samples=drop", resume="auto")
    for name in ("full", "killed", "tighter"):
        out[f"{name}_metrics"] = _metrics(f"{root}/{name}/logs", keep_all=True)
        out[f"{name}_compared"] = _metrics(f"{root}/{name}/logs")  # timings and the stream's bookkeeping left out
    return out


def _check_versions(seen: dict, step: int, began: int) -> None:
    """Every sample of ``step``'s batch began with version ``began``; token j: min(began + j // 5, step - 1)."""
    batch = seen[step]
    assert set(batch["rollout_version"]) == {began}, (step, set(batch["rollout_version"]))
    for versions, mask in zip(batch["rollout_token_versions"], batch["response_mask"]):
        length = int(sum(mask))
        expected = [min(began + j // SEGMENT, step - 1) for j in range(length)] + [-1] * (len(mask) - length)
        assert versions == expected, (step, versions, expected)


@pytest.mark.timeout(900)
def test_partial_rollout_and_stale_samples(tiny_model_dir, arithmetic_files, tmp_path):
    [out, _] = run_distributed(_body, 2, tiny_model_dir, arithmetic_files, str(tmp_path), timeout=860)
    assert out["full"]["steps"] == out["colocated"]["steps"] == (0, 4) and out["killed"]["steps"] == (0, 2)
    assert out["resumed"]["steps"] == (2, 4) and out["drop"]["steps"] == (2, 4)
    full, metrics = out["full"]["seen"], out["full_metrics"]
    # step 1 is generated at its start (version 0); its update's window begins the batches of steps
    # 2 and 3 (version 0), step 2's the batch of step 4 (version 1)
    for step, began in ((1, 0), (2, 0), (3, 0), (4, 1)):
        _check_versions(full, step, began)
        _check_versions(out["colocated"]["seen"], step, began)
    assert [metrics[s]["staleness/max"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 2.0, 2.0]
    assert metrics[1]["async/partial_spanning"] == 0.0
    spanning = [metrics[s]["async/partial_spanning"] for s in (2, 3, 4)]
    assert all(0.0 < share <= 1.0 for share in spanning), spanning  # a sample ended in its first segment spans none
    assert all("async/stale_dropped" not in metrics[s] for s in (1, 2, 3, 4))  # wait: nothing to drop
    # killed after step 2 and resumed: the batches in flight continue as in the uninterrupted run
    assert out["resumed"]["seen"] == {s: full[s] for s in (3, 4)}
    assert out["killed_compared"] == out["full_compared"]
    assert [out["killed_metrics"][s]["async/partial_segments"] for s in (3, 4)] == [metrics[s]["async/partial_segments"] for s in (3, 4)]
    # resumed with the bound 1 and drop: the batches of steps 3 (begun with version 0) and 4 (version
    # 1) are 2 versions stale at their updates: every sample is dropped and sampled again now
    tighter = out["tighter_metrics"]
    rows = len(full[3]["rollout_version"])
    assert [tighter[s]["async/stale_dropped"] for s in (3, 4)] == [float(rows), float(rows)]
    drop = out["drop"]["seen"]
    for step in (3, 4):
        assert set(drop[step]["rollout_version"]) == {step - 1}  # sampled again with the current weights
        _check_versions(drop, step, step - 1)
        assert tighter[step]["staleness/max"] == 0.0
    assert drop[3]["responses"] != full[3]["responses"]
