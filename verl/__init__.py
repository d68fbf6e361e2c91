"""verl: reinforcement-learning post-training for LLMs on Megatron-core and vLLM.

The Python API (docs/python_api.md) is imported on first use, so ``import verl`` stays light:
``verl.DataStream`` and the operators (``verl.RolloutOperator`` ...) from :mod:`verl.operator`,
``verl.RLTrainer`` from :mod:`verl.trainer.api`, ``verl.VerlMonitor`` from :mod:`verl.monitor`.
"""

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "DataStream": "verl.operator",
    "Operator": "verl.operator",
    "RolloutOperator": "verl.operator",
    "RewardOperator": "verl.operator",
    "RewardModelScorer": "verl.operator",
    "MultiRewardScorer": "verl.operator",
    "FilterOperator": "verl.operator",
    "WeightedFilterOperator": "verl.operator",
    "GroupFilterOperator": "verl.operator",
    "PPOUpdateOperator": "verl.operator",
    "PreferenceOperator": "verl.operator",
    "DPOUpdateOperator": "verl.operator",
    "ConditionalUpdateOperator": "verl.operator",
    "HumanReviewOperator": "verl.operator",
    "RLTrainer": "verl.trainer.api",
    "VerlMonitor": "verl.monitor",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'verl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = ["__version__", *_LAZY]
