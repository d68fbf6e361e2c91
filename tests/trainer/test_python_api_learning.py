"""The tutorial's ``DataStream`` learns: GRPO on the tiny model raises a rule-based reward.

Each stream builds its own trainer (``DataStream(model=..., overrides=...)``, a world of one, the
transformers engine), so every variant starts from the same weights, prompts and seeds:
rollout -> reward -> PPO update with GRPO, plus a filter, a weighted sum of scorers, or a
user-written operator in place of the reward operator.

The reward is one the raw tiny model can learn in a few steps: the number of words in its
8-token response (spaces, i.e. word-starting tokens, over 8). The tiny model starts at ~0.42; at
``lr=1e-2`` with 4 passes over each batch the policy moves towards word-starting tokens within
10 steps of 4 prompts x 4 samples.
"""

from __future__ import annotations

import pytest
import torch

from verl.operator import (
    DataStream,
    FilterOperator,
    MultiRewardScorer,
    PPOUpdateOperator,
    RewardModelScorer,
    RewardOperator,
    RolloutOperator,
)

from . import words_reward

pytestmark = pytest.mark.slow

STEPS = 10
LR = 1e-2
# The mean reward of the last two steps must exceed that of the first two by this much. Measured
# on CPU: rises of 0.24-0.35 (the docstrings below); the same streams with lr=0 (fresh prompts
# each step, unchanged weights) move by +0.047 (0.422, 0.383 ... 0.430, 0.469), so they fail.
MARGIN = 0.15


def words(data_source, solution_str, ground_truth, extra_info=None):
    """Words in the response: spaces over the 8-token response length, at most 1."""
    return words_reward.compute_score(data_source, solution_str, ground_truth, extra_info)


def _cpu(out) -> list[str]:
    return [
        "trainer.device=cpu", "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=hf",
        "data.max_prompt_length=24", "data.max_response_length=8", "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_epochs=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
        f"trainer.total_training_steps={STEPS}", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.save_freq=-1", "trainer.save_hf=false", "trainer.resume_mode=disable",
        "trainer.logger=[jsonl]", "data.val_files=null",
        f"trainer.default_local_dir={out}/ckpt", f"trainer.log_dir={out}/logs",
    ]


class WordTokens:
    """A user-written operator that is the reward: the share of response tokens that start a word,
    put on each response's last token (``token_level_scores`` [B, R])."""

    inputs = ("responses", "response_mask")
    outputs = ("token_level_scores",)

    def __init__(self, tokenizer):
        self.starts_word = torch.tensor(
            [tokenizer.decode([i]).startswith(" ") for i in range(len(tokenizer))], dtype=torch.float32
        )  # [V]

    def process(self, batch):
        mask = batch["response_mask"]  # [B, R]
        share = (self.starts_word[batch["responses"]] * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
        scores = torch.zeros_like(mask)
        last = (mask.sum(-1).long() - 1).clamp(min=0)
        scores[torch.arange(len(mask)), last] = share
        batch["token_level_scores"] = scores
        return batch, {"reward_mean": float(share.mean())}


def _run(stream: DataStream) -> list[dict[str, float]]:
    steps = []
    try:
        for _ in range(STEPS):
            steps.append(stream.step())
    finally:
        stream.close()
    return steps


def _assert_rises(steps: list[dict[str, float]]) -> None:
    rewards = [m["reward_mean"] for m in steps]
    start, end = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
    shown = ", ".join(f"{r:.3f}" for r in rewards)
    assert end > start + MARGIN, f"reward_mean per step: {shown}; expected the last two to beat the first two by {MARGIN}"


def _stream(tiny_model_dir, arithmetic_files, tmp_path) -> DataStream:
    return DataStream(model=tiny_model_dir, train_files=arithmetic_files["train"], overrides=_cpu(tmp_path))


def test_reward_rises_rollout_reward_update(tiny_model_dir, arithmetic_files, tmp_path):
    """Measured: 0.422, 0.430, 0.508, ... 0.711, 0.844 (first two 0.426, last two 0.777)."""
    stream = (
        _stream(tiny_model_dir, arithmetic_files, tmp_path)
        .add_operator(RolloutOperator(n=4, temperature=1.0))
        .add_operator(RewardModelScorer(words))
        .add_operator(PPOUpdateOperator(estimator="grpo", kl_coef=0.001, lr=LR))
    )
    _assert_rises(_run(stream))


def test_reward_rises_with_a_filter(tiny_model_dir, arithmetic_files, tmp_path):
    """Measured: 0.422, 0.438, 0.500, ... 0.641, 0.711 (0.430 -> 0.676): slower than without the
    filter, which drops 2-4 of the 16 samples of each early step (the poorest, so less signal)."""
    stream = (
        _stream(tiny_model_dir, arithmetic_files, tmp_path)
        .add_operator(RolloutOperator(n=4, temperature=1.0))
        .add_operator(RewardOperator(words))
        .add_operator(FilterOperator(threshold=0.375))  # responses of fewer than 3 words leave the step
        .add_operator(PPOUpdateOperator(estimator="grpo", kl_coef=0.001, lr=LR))
    )
    steps = _run(stream)
    assert steps[0]["filter/dropped"] > 0, "the filter should drop some of the first step's samples"
    _assert_rises(steps)


def test_reward_rises_with_a_multi_reward_scorer(tiny_model_dir, arithmetic_files, tmp_path):
    """Measured: 0.422, 0.430, 0.508, ... 0.703, 0.836 (0.426 -> 0.770); the arithmetic scorer
    (weight 0.5) almost never pays the raw model, so the words drive the rise."""
    stream = (
        _stream(tiny_model_dir, arithmetic_files, tmp_path)
        .add_operator(RolloutOperator(n=4, temperature=1.0))
        .add_operator(MultiRewardScorer([(words, 1.0), ("verl/arithmetic", 0.5)]))
        .add_operator(PPOUpdateOperator(estimator="grpo", kl_coef=0.001, lr=LR))
    )
    _assert_rises(_run(stream))


def test_reward_rises_with_a_user_operator_as_the_reward(tiny_model_dir, arithmetic_files, tmp_path):
    """Measured: 0.422, 0.430, 0.508, ... 0.711, 0.812 (0.426 -> 0.762)."""
    from verl.data.tokenizer import load_tokenizer

    stream = (
        _stream(tiny_model_dir, arithmetic_files, tmp_path)
        .add_operator(RolloutOperator(n=4, temperature=1.0))
        .add_operator(WordTokens(load_tokenizer(tiny_model_dir)))
        .add_operator(PPOUpdateOperator(estimator="grpo", kl_coef=0.001, lr=LR))
    )
    _assert_rises(_run(stream))
