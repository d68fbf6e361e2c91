"""Rewards for ``tools/bench.py compare-trl --reward words``: the same function scores both sides.

Our trainer loads ``compute_score`` through ``custom_reward_function.path`` / ``.name`` (this file);
TRL's ``GRPOTrainer`` gets a reward function that calls the same ``compute_score`` on each completion.

``words_score`` is what a raw, randomly initialised model can earn, so the reward curves of a short
benchmark move (the 2-digit arithmetic scorer gives such a model 0 on every sample): the share of
the response's characters that are spaces (0 for an empty response). It is a share, not a count, so
it does not saturate: ``tests/trainer/words_reward.py``'s count (spaces over 8, at most 1) suits its
8-token responses, but the bench's raw models write 11-17 spaces in 32 tokens and 52-65 in 128
(measured on the made 247k and 34.5M Qwen2s), so that count scored 0.97-1.0 from the first step and
its curve could not move. Sampled at temperature 1, those models' responses are 11-14% spaces.

``compute_score_waiting`` is the same score after a wait of ``VERL_BENCH_REWARD_WAIT_S`` seconds per
sample (``bench.py async --reward-wait-ms``, which sets it): a reward whose scorer waits on something
else (a sandbox running the response's code, a remote judge) rather than computing, so the rank
scoring it is idle meanwhile.
"""

from __future__ import annotations

import os
import time
from typing import Any


def words_score(text: str) -> float:
    """Spaces in ``text`` over its length in characters (0.0 for an empty text)."""
    return text.count(" ") / len(text) if text else 0.0


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """verl's ``custom_reward_function`` contract; the data source and answer are not used."""
    return words_score(solution_str)


def compute_score_waiting(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """:func:`compute_score` after waiting ``VERL_BENCH_REWARD_WAIT_S`` seconds (module docstring)."""
    time.sleep(float(os.environ.get("VERL_BENCH_REWARD_WAIT_S", "0")))
    return words_score(solution_str)
