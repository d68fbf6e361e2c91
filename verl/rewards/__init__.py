"""Rule-based rewards: scorers keyed by ``data_source``, user reward functions, batch scoring.

- ``default_compute_score(data_source, solution_str, ground_truth, extra_info=None)``: the
  registry of built-in scorers (GSM8K, MATH/MATH-500/Numina, DAPO-Math/AIME, countdown,
  Geometry3K, the synthetic ``verl/arithmetic`` task); ``known_data_sources()`` lists them and
  ``register_scorer`` adds more.
- ``load_custom_reward_fn(path, name)``: a user function from ``custom_reward_function.path``/``.name``.
- ``RewardManager(tokenizer, compute_score=None, num_workers=0, ...)(batch)``: token-level
  scores for a rollout batch, optionally in a process pool; ``reward_manager_from_config``
  builds one from a PPO config.
- ``reference_compute_score``: the same call, scoring exactly as the reference verl 0.9.1 does
  (``reward_model.rule_scoring=reference``; the scorers are ``verl.rewards.reference``).
- ``format_reward``: whole-response layout check (``<think>..</think><answer>..</answer>`` by default).
"""

import importlib
from typing import Any

from verl.rewards.arithmetic import ANSWER_PREFIX as ARITHMETIC_ANSWER_PREFIX
from verl.rewards.arithmetic import format_arithmetic_answer
from verl.rewards.format_reward import THINK_ANSWER_PATTERN, format_reward
from verl.rewards.math_answer import math_equal, normalize_math_answer
from verl.rewards.registry import (
    FileRewardFunction,
    default_compute_score,
    get_scorer,
    known_data_sources,
    load_custom_reward_fn,
    reference_compute_score,
    register_scorer,
)
from verl.rewards.scoring import SampleScore, score_one

# The batch-facing manager needs torch; it is imported on first use so that process-pool
# workers, which unpickle scorers from this package, start without importing torch.
_LAZY = {
    name: "verl.rewards.manager"
    for name in (
        "OverlongBuffer",
        "REWARD_MANAGERS",
        "RULE_SCORING",
        "RewardManager",
        "RewardOutput",
        "reward_manager_from_config",
    )
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'verl.rewards' has no attribute {name!r}")

__all__ = [
    "ARITHMETIC_ANSWER_PREFIX",
    "FileRewardFunction",
    "OverlongBuffer",
    "REWARD_MANAGERS",
    "RULE_SCORING",
    "RewardManager",
    "RewardOutput",
    "SampleScore",
    "THINK_ANSWER_PATTERN",
    "default_compute_score",
    "format_arithmetic_answer",
    "format_reward",
    "get_scorer",
    "known_data_sources",
    "load_custom_reward_fn",
    "math_equal",
    "normalize_math_answer",
    "reference_compute_score",
    "register_scorer",
    "reward_manager_from_config",
    "score_one",
]
