"""``trainer.rollout_mode``: the streaming rollout (``verl.trainer.step.stream``) on 2 ranks, the
rollout on rank 1 and the actor on rank 0 (``trainer.placement.rollout=[1]``), GRPO.

- async with ``max_staleness=0`` is the synchronous run, number for number;
- one_step_off trains every sample exactly one version stale (the first step's: none), and its
  first step is the synchronous one (same weights, prompts and seeds);
- async with ``max_staleness=2`` never exceeds 2 (asserted per sample inside the step: the
  trainer raises before an update that would) and reaches it;
- a killed one_step_off run resumed from its checkpoint (which holds the batch generated ahead)
  trains the uninterrupted run's next step exactly;
- colocated (both roles on both ranks) one_step_off keeps the same staleness.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import pytest

from verl.testing.distributed import run_distributed

if TYPE_CHECKING:
    from verl.config import PPOConfig

from .test_rl_trainer import FAST as RL_FAST

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# The raw model scores nothing, so GRPO's advantages are 0: an entropy bonus makes every update
# move the weights (else a stale sample would be sampled by the same weights as a fresh one).
FAST = [
    *RL_FAST,
    "trainer.logger=[jsonl]",
    "trainer.total_training_steps=3",
    "actor_rollout_ref.actor.optim.lr=1e-2",
    "actor_rollout_ref.actor.entropy_coeff=0.1",
]
APART = ["trainer.placement.rollout=[1]"]
# Not compared between runs: timings and speeds, and the stream's own bookkeeping.
_NOT_COMPARED = ("timing_s/", "perf/", "rollout/tokens_per_s", "rollout/time_s", "async/", "staleness/")


def _metrics(log_dir: str, *, keep_all: bool = False) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    with open(os.path.join(log_dir, "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            step = record.pop("step")
            out.setdefault(step, {}).update(
                {k: v for k, v in record.items() if keep_all or not k.startswith(_NOT_COMPARED)}
            )
    return out


def config(
    model_dir: str, files: dict[str, str], folder: str, *extra: str, resume: str = "disable", world_size: int = 2
) -> "PPOConfig":
    """``grpo_tiny_cpu`` with ``FAST``, checkpoints and logs under ``folder``, then ``extra``."""
    from verl.config import PPOConfig, load_config

    return load_config(
        PPOConfig,
        config_file="grpo_tiny_cpu",
        overrides=[
            f"actor_rollout_ref.model.path={model_dir}",
            f"data.train_files={files['train']}",
            "data.val_files=null",
            *FAST,
            f"trainer.default_local_dir={folder}",
            f"trainer.log_dir={folder}/logs",
            f"trainer.resume_mode={resume}",
            *extra,
        ],
        world_size=world_size,
    )


def mark_overlap(trainer: Any) -> list[bool]:
    """Wrap the streaming rollout's ``generate_ahead`` (the generation ahead inside ``update_step``,
    called by the step's schedule); the returned flag's ``[0]`` is True while it runs."""
    stream = trainer.stream
    overlap, inside = stream.generate_ahead, [False]

    def ahead(ctx):
        inside[0] = True
        try:
            return overlap(ctx)
        finally:
            inside[0] = False

    stream.generate_ahead = ahead
    return inside


def _body(model_dir: str, files: dict[str, str], root: str) -> dict:
    from verl.trainer.ppo_trainer import PPOTrainer

    def run(name: str, *extra: str, stop_after: int | None = None, resume: str = "disable") -> tuple[int, int]:
        cfg = config(model_dir, files, f"{root}/{name}", *extra, resume=resume)
        with PPOTrainer(cfg) as trainer:
            start = trainer.resume()
            trainer.fit(stop_after=stop_after)
            return start, trainer.global_step

    steps = {
        "sync": run("sync", *APART),
        "async0": run("async0", *APART, "trainer.rollout_mode=async", "trainer.async_training.max_staleness=0"),
        "off": run("off", *APART, "trainer.rollout_mode=one_step_off"),
        "async2": run("async2", *APART, "trainer.rollout_mode=async", "trainer.async_training.max_staleness=2",
                      "trainer.total_training_steps=4"),
        "killed": run("killed", *APART, "trainer.rollout_mode=one_step_off", "trainer.save_freq=1", stop_after=2),
        "resumed": run("killed", *APART, "trainer.rollout_mode=one_step_off", "trainer.save_freq=1", resume="auto"),
        "colocated": run("colocated", "trainer.rollout_mode=one_step_off"),
    }
    out: dict = {"steps": steps, "queue": sorted(os.listdir(f"{root}/killed/global_step_2/rollout_queue"))}
    for name in ("sync", "async0", "off", "async2", "killed", "colocated"):
        out[name] = _metrics(f"{root}/{name}/logs")
        out[f"{name}_all"] = _metrics(f"{root}/{name}/logs", keep_all=True)
    return out


@pytest.mark.timeout(900)
def test_rollout_modes(tiny_model_dir, arithmetic_files, tmp_path):
    [out, _] = run_distributed(_body, 2, tiny_model_dir, arithmetic_files, str(tmp_path), timeout=860)
    assert out["steps"] == {
        "sync": (0, 3), "async0": (0, 3), "off": (0, 3), "async2": (0, 4),
        "killed": (0, 2), "resumed": (2, 3), "colocated": (0, 3),
    }
    sync, off, async2 = out["sync"], out["off_all"], out["async2_all"]
    # bound 0: nothing is generated ahead, so the run is the synchronous one exactly
    for step in (1, 2, 3):
        differ = {k: (v, sync[step].get(k)) for k, v in out["async0"][step].items() if sync[step].get(k) != v}
        assert not differ and set(out["async0"][step]) == set(sync[step]), (step, differ)
    assert all(out["async0_all"][s]["staleness/max"] == 0.0 for s in (1, 2, 3))
    # one_step_off: step 1's batch is generated at the start (the synchronous step 1), the next
    # ones while the previous update trains, with the weights before it: exactly one version stale
    assert out["off"][1] == sync[1]
    assert [(off[s]["staleness/min"], off[s]["staleness/max"]) for s in (1, 2, 3)] == [(0, 0), (1, 1), (1, 1)]
    assert [off[s]["async/generated_ahead"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert out["off"][2] != sync[2]  # other weights sampled it: the run differs from the second step on
    # async, bound 2: step 1 fills the queue with the batches of steps 2 and 3 (version 0), then
    # one batch per step; the bound holds per sample and is reached
    assert [async2[s]["staleness/max"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 2.0, 2.0]
    assert [async2[s]["async/generated_in_update"] for s in (1, 2, 3, 4)] == [2.0, 1.0, 0.0, 0.0]
    assert async2[1]["async/queue_size"] == 0.0 and async2[2]["async/queue_size"] == 1.0
    # the killed run's checkpoint holds the batch generated ahead for step 3; resumed, step 3 is
    # the uninterrupted run's, number for number, and steps 1-2 were logged once each
    assert out["queue"] == ["0.batch", "0.prompts", "index.json"]  # its prompts: for stale_samples=drop on resume
    assert out["killed"] == out["off"]
    # colocated: the same schedule, one after the other
    colocated = out["colocated_all"]
    assert [colocated[s]["staleness/max"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
