"""``DataStream(device_map=...)`` with roles on devices of their own: the tutorials' stream (rollout ->
reward model -> PPO update) with the reward model on a rank of its own takes the steps of the same
stream with every role on one rank (each role has data-parallel size 1 in both; the samples and
the weights are the same, so the metrics are equal bit for bit on CPU)."""

from __future__ import annotations

import math

import pytest

from verl.testing.distributed import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 2


def _stream_body(model_dir: str, train_file: str, out: str, device_map: dict) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForSequenceClassification

    from verl import DataStream
    from verl.operator import PPOUpdateOperator, RewardModelScorer, RolloutOperator

    from .test_python_api import FAST

    torch.manual_seed(0)  # the reward head's initial weights, alike in every process
    reward_model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
    world = dist.get_world_size()
    overrides = [o for o in FAST if not o.startswith(("trainer.n_gpus_per_node", "trainer.device"))]
    stream = DataStream(
        model=model_dir,
        train_files=train_file,
        overrides=[*overrides, f"trainer.default_local_dir={out}/{world}/ckpt", f"trainer.log_dir={out}/{world}/logs"],
        device_map=device_map,
    )
    stream.add_operator(RolloutOperator(n=4, temperature=1.0)) \
        .add_operator(RewardModelScorer(rm_model=reward_model, tokenizer=model_dir)) \
        .add_operator(PPOUpdateOperator(kl_coef=0.001, estimator="grpo"))
    try:
        steps = [stream.step() for _ in range(STEPS)]
        trainer = stream.trainer
        where = sorted(r for r in ("actor", "ref", "reward_model") if trainer.pieces.runs(r))
        return {"steps": steps, "where": where, "placement": dict(trainer.cfg.trainer.placement)}
    finally:
        stream.close()


def _numbers(step: dict) -> dict:
    return {k: v for k, v in step.items() if "time" not in k and "timing" not in k and "_per_s" not in k
            and not k.startswith(("perf/", "memory/", "update_weights/"))}


@pytest.mark.timeout(600)
def test_the_tutorial_stream_with_the_reward_model_apart(tiny_model_dir, arithmetic_files, tmp_path):
    [one] = run_distributed(_stream_body, 1, tiny_model_dir, arithmetic_files["train"], str(tmp_path), {"actor": [0]},
                            timeout=280)
    two = run_distributed(_stream_body, 2, tiny_model_dir, arithmetic_files["train"], str(tmp_path),
                          {"actor": [0], "reward_model": [1], "rollout_sampler": [0]}, timeout=400)
    assert one["placement"] == {} and two[0]["placement"] == {"actor": [0], "reward_model": [1]}
    assert [t["where"] for t in two] == [["actor", "ref"], ["reward_model"]]
    assert one["where"] == ["actor", "ref", "reward_model"]
    for got_rank0, got_rank1, want in zip(two[0]["steps"], two[1]["steps"], one["steps"]):
        assert _numbers(got_rank0) == _numbers(got_rank1)  # every rank holds the step's metrics
        assert _numbers(got_rank0) == _numbers(want)
        assert want["reward/reward_model/mean"] != 0.0 and math.isfinite(want["loss"])
