"""Roles on ranks of their own (``trainer.placement``): each role apart runs in a world of its own
and hands its results to every rank; the steps equal the same run with every role on one rank,
and a run resumed from the checkpoint the roles apart wrote takes the uninterrupted run's step.

The reference for a split run is the one-rank run of the same config: there every role is
colocated on rank 0 with data-parallel size 1, as each role apart is on its own rank, and the
rollout engine (with the actor in both) samples with the same seeds. So the steps must be equal
bit for bit on CPU: same weights, same samples, same kernels; only where the numbers come from
differs (another process, handed over by a broadcast).
"""

from __future__ import annotations

import json
import math
import os

import pytest

from verl.testing.distributed import run_distributed

from .test_rl_trainer import FAST as RL_FAST

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# test_rl_trainer's fast shapes (later overrides win), with two mini-batches per step for each
# trained role and the roles' forward micro-batches of 8.
FAST = [
    *RL_FAST,
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "critic.ppo_mini_batch_size=4",
    "reward_model.micro_batch_size_per_gpu=8",
    "trainer.logger=[]",
]

# (name, config, engine, extra overrides, placement on 2 ranks)
RUNS = [
    # The critic and the rollout engine (generation disaggregated: the weights sent across) on rank 1.
    ("ppo-critic-apart", "ppo_tiny_cpu", "hf", [], ["trainer.placement.critic=[1]", "trainer.placement.rollout=[1]"]),
    (
        "grpo-rm-and-ref-apart",
        "grpo_tiny_cpu",
        "vllm",
        ["reward_model.enable=true", "reward_model.model.path={model}"],
        ["trainer.placement.reward_model=[1]", "trainer.placement.ref=[1]"],
    ),
    # vLLM on a rank of its own, in a world of its own, fed the actor's weights before each generation.
    ("grpo-rollout-apart", "grpo_tiny_cpu", "vllm", [], ["trainer.placement.rollout=[1]"]),
]
STEPS = 2


def _config(config: str, engine: str, model_dir: str, files: dict[str, str], root: str, world: int, *extra: str):
    from verl.config import PPOConfig, load_config

    return load_config(
        PPOConfig,
        config_file=config,
        overrides=[
            f"actor_rollout_ref.model.path={model_dir}",
            f"data.train_files={files['train']}",
            "data.val_files=null",
            *FAST,
            f"actor_rollout_ref.rollout.name={engine}",
            f"trainer.n_gpus_per_node={world}",
            f"trainer.default_local_dir={root}",
            *(e.format(model=model_dir) for e in extra),
        ],
        world_size=world,
    )


def _runs_body(model_dir: str, files: dict[str, str], root: str, split: bool) -> dict[str, object]:
    import torch.distributed as dist

    from verl.trainer.ppo_trainer import PPOTrainer

    world = dist.get_world_size()
    out: dict[str, object] = {}
    for name, config, engine, extra, placement in RUNS:
        cfg = _config(
            config, engine, model_dir, files, f"{root}/{name}", world, *extra, *(placement if split else []),
            "trainer.save_freq=-1",
        )
        with PPOTrainer(cfg) as trainer:
            out[name] = {
                "steps": [trainer.train_step() for _ in range(STEPS if split else STEPS + 1)],
                "roles": sorted(r for r in ("actor", "ref", "critic", "reward_model") if trainer.pieces.runs(r)),
                "rollout": trainer.rollout is not None,
            }
            if split:
                out[name]["checkpoint"] = trainer.save_checkpoint()
        if split:  # a new trainer resumes from the checkpoint the roles apart wrote, and takes step 3
            cfg = _config(config, engine, model_dir, files, f"{root}/{name}", world, *extra, *placement,
                          "trainer.resume_mode=auto")
            with PPOTrainer(cfg) as trainer:
                out[name]["resumed_at"] = trainer.resume()
                out[name]["steps"].append(trainer.train_step())
    return out


def _comparable(step: dict[str, float]) -> dict[str, float]:
    # Timings, memory and throughput differ run to run; every other metric is a number of the step.
    skip = ("timing_s/", "perf/", "memory/", "update_weights/", "rollout/kv_", "rollout/time_s", "rollout/tokens_per_s")
    return {k: v for k, v in step.items() if not k.startswith(skip)}


@pytest.mark.timeout(900)
def test_roles_apart_take_the_steps_of_one_rank(tiny_model_dir, arithmetic_files, tmp_path):
    [expected] = run_distributed(_runs_body, 1, tiny_model_dir, arithmetic_files, str(tmp_path / "one"), False, timeout=420)
    actual = run_distributed(_runs_body, 2, tiny_model_dir, arithmetic_files, str(tmp_path / "two"), True, timeout=560)
    # Where each role was built: the roles apart on rank 1 only; the rollout with the actor.
    assert actual[0]["ppo-critic-apart"]["roles"] == ["actor", "ref"]
    assert actual[1]["ppo-critic-apart"]["roles"] == ["critic"]
    assert actual[0]["grpo-rm-and-ref-apart"]["roles"] == ["actor"]
    assert actual[1]["grpo-rm-and-ref-apart"]["roles"] == ["ref", "reward_model"]
    assert [a["ppo-critic-apart"]["rollout"] for a in actual] == [False, True]
    assert [a["grpo-rm-and-ref-apart"]["rollout"] for a in actual] == [True, False]
    assert [a["grpo-rollout-apart"]["rollout"] for a in actual] == [False, True]
    assert [a["grpo-rollout-apart"]["roles"] for a in actual] == [["actor", "ref"], []]
    for name, *_ in RUNS:
        # Every rank reports the same metrics (the roles apart handed theirs over)...
        for a, b in zip(actual[0][name]["steps"], actual[1][name]["steps"]):
            assert _comparable(a) == _comparable(b), name
        # ... and they are the one-rank run's, bit for bit (same weights, samples and kernels).
        assert len(actual[0][name]["steps"]) == len(expected[name]["steps"]) == STEPS + 1
        for i, (got, want) in enumerate(zip(actual[0][name]["steps"], expected[name]["steps"])):
            got, want = _comparable(got), _comparable(want)
            assert got.keys() == want.keys(), (name, sorted(set(got) ^ set(want)))
            different = {k: (got[k], want[k]) for k in got if not (got[k] == want[k] or (math.isnan(got[k]) and math.isnan(want[k])))}
            assert not different, (name, i + 1, different)
        # The timings name the exchange where roles apart hand over their results.
        assert "timing_s/exchange" in actual[0][name]["steps"][0]
        assert "timing_s/exchange" not in expected[name]["steps"][0]
    # Resumed from the split run's checkpoint at step 2, step 3 is the uninterrupted run's step 3.
    assert [a[name]["resumed_at"] for a in actual for name, *_ in RUNS] == [STEPS] * 2 * len(RUNS)
    ppo = actual[0]["ppo-critic-apart"]["steps"]
    assert ppo[1]["critic/vf_loss"] > 0 and ppo[1]["actor/reward_kl_penalty"] != 0.0
    assert actual[0]["grpo-rm-and-ref-apart"]["steps"][0]["reward/model_score_mean"] != 0.0
    # The weights sent to the engine apart: every element, each step (the tiny model in float32).
    sent = actual[1]["grpo-rollout-apart"]["steps"][0]["update_weights/bytes_received"]
    assert sent == actual[0]["grpo-rollout-apart"]["steps"][0]["update_weights/bytes_received"] > 0
    # The checkpoint holds each role's state, written by its own ranks in their own worlds.
    path = actual[0]["ppo-critic-apart"]["checkpoint"]
    for role in ("actor", "critic"):
        with open(os.path.join(path, role, "engine.json"), encoding="utf-8") as f:
            assert json.load(f)["world_size"] == 1, role
