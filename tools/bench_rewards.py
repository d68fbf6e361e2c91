"""Rewards for ``tools/bench.py compare-trl --reward words``: the same function scores both sides.

Our trainer loads ``compute_score`` through ``custom_reward_function.path`` / ``.name`` (this file);
TRL's ``GRPOTrainer`` gets ``trl_words_reward``. Both call ``words_score`` on the response's text.

``words_score`` is what a raw, randomly initialised model can earn, so the reward curves of a short
benchmark move (the 2-digit arithmetic scorer gives such a model 0 on every sample): the number of
spaces in the response over 8, at most 1 (as ``tests/trainer/words_reward.py``).
"""

from __future__ import annotations

from typing import Any

WORDS_CAP = 8


def words_score(text: str) -> float:
    """Spaces in ``text`` over 8, capped at 1.0."""
    return min(text.count(" "), WORDS_CAP) / float(WORDS_CAP)


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """verl's ``custom_reward_function`` contract; the data source and answer are not used."""
    return words_score(solution_str)


def completion_text(completion: Any) -> str:
    """The text of one TRL completion: a string, or (conversational prompts) a list of messages."""
    return completion[-1]["content"] if isinstance(completion, list) else completion


def trl_words_reward(prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
    """TRL's reward-function contract: one float per completion."""
    return [words_score(completion_text(c)) for c in completions]
