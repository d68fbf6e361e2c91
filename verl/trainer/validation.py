"""Validation of the RL trainer: the validation prompts sampled with ``rollout.val_kwargs`` on the
rollout's ranks, scored by the reward on every rank, reduced to ``val-core/{data_source}/...``
(``verl.trainer.ppo_metrics.validation_metrics``); rank 0 keeps the generations for the report."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from verl.protocol import Batch
from verl.roles.dispatch import share_batch
from verl.roles.reward_model import DATA_SOURCE_COLUMN
from verl.trainer.ppo_metrics import validation_metrics
from verl.trainer.rl_data import to_batch
from verl.trainer.step.pieces import VAL_SEED_OFFSET

if TYPE_CHECKING:
    from verl.trainer.ppo_trainer import PPOTrainer

__all__ = ["generations", "validate"]


def validate(trainer: "PPOTrainer") -> dict[str, float]:
    """Validation metrics of the trainer's current policy (the same on every rank); {} without
    validation data."""
    val_loader, world = trainer.data.val_loader, trainer.world
    if val_loader is None:
        return {}
    trainer.post_phase("testing")
    start = time.perf_counter()
    samples: list[dict[str, Any]] = []  # one record per sample: data_source, prompt, reward, extras
    shown: list[dict[str, Any]] = []  # generations for the run report
    batches: list[Batch] = []
    offset = 0
    for data in val_loader:
        prompts = to_batch(data)
        prompts["uid"] = [f"val/{offset + i}" for i in range(len(prompts))]
        offset += len(prompts)
        batches.append(prompts)
    outs: list[Batch | None] = [None] * len(batches)
    with world.rollout_phase():  # the rollout's ranks generate; the reward is every rank's
        if world.rollout is not None:
            seed = VAL_SEED_OFFSET + trainer.pieces.sampling_seed(0)
            for i, prompts in enumerate(batches):
                outs[i] = world.rollout.generate(prompts, seed=seed, validate=True)
    keep = trainer.reporting and trainer.is_rank0
    for out in outs:
        if "rollout" in world.apart:
            out = share_batch(out, world.source["rollout"])
        result = world.reward.score(out)
        for i, (source, uid) in enumerate(zip(out.non_tensors[DATA_SOURCE_COLUMN], out.non_tensors["uid"])):
            record = {name: values[i] for name, values in result.extra.items()}
            samples.append({**record, "reward": float(result.scores[i]), "_source": str(source), "_uid": uid})
        if keep:
            shown.extend(generations(trainer.tokenizer, out, result.scores))
    names = list(dict.fromkeys(k for s in samples for k in s if not k.startswith("_")))
    metrics = validation_metrics(
        data_sources=[s["_source"] for s in samples],
        prompt_ids=[s["_uid"] for s in samples],
        variables={name: [s.get(name) for s in samples] for name in names},
    )
    metrics["timing_s/testing"] = time.perf_counter() - start
    if shown:
        trainer.samples_file.append(trainer.global_step, shown)
    return metrics


def generations(tokenizer: Any, out: Batch, scores: torch.Tensor) -> list[dict[str, Any]]:
    """(data_source, prompt, response, reward) of each sample of ``out``, as text. Multi-turn
    samples (the agent loop's ``agent_turns`` column) add ``turns``: ``[{"role": "assistant" |
    "tool" | "user", "text": ...}]`` in order, and their ``response`` is the whole conversation after the
    prompt, tool turns included (their ``response_mask`` covers the model's tokens only)."""
    r = out["responses"].shape[1]
    prompt_mask = out["attention_mask"][:, :-r].bool()
    agent = "agent_turns" in out
    if agent:
        response_mask = out["attention_mask"][:, -r:].bool()
    else:
        response_mask = out["response_mask"].bool() if "response_mask" in out else out["attention_mask"][:, -r:].bool()
    records = []
    for i, source in enumerate(out.non_tensors[DATA_SOURCE_COLUMN]):
        record = {
            "data_source": str(source),
            "prompt": tokenizer.decode(out["prompts"][i][prompt_mask[i]].tolist(), skip_special_tokens=True),
            "response": tokenizer.decode(out["responses"][i][response_mask[i]].tolist(), skip_special_tokens=True),
            "reward": round(float(scores[i]), 6),
        }
        if agent:
            ids = out["responses"][i].tolist()
            record["turns"] = [
                {"role": t["role"], "text": tokenizer.decode(ids[t["start"] : t["end"]], skip_special_tokens=True)}
                for t in out["agent_turns"][i]
            ]
        records.append(record)
    return records
