"""The Python API's dataflow: ``DataStream`` and its operators (see docs/python_api.md).

Each built-in operator wraps step pieces of :class:`verl.trainer.ppo_trainer.PPOTrainer`; the stream
runs them in order and ``DataStream.fit`` runs its step inside ``PPOTrainer.fit`` (one loop).
"""

from verl.trainer.step.base import Operator
from verl.trainer.step.ops import (
    ConditionalUpdateOperator,
    DPOUpdateOperator,
    FilterOperator,
    GroupFilterOperator,
    MultiRewardScorer,
    PPOUpdateOperator,
    PreferenceOperator,
    RewardModelScorer,
    RewardOperator,
    RolloutOperator,
    WeightedFilterOperator,
)
from verl.operator.review import HumanReviewOperator
from verl.operator.stream import DataStream, build_config, build_trainer

__all__ = [
    "ConditionalUpdateOperator",
    "DPOUpdateOperator",
    "DataStream",
    "FilterOperator",
    "GroupFilterOperator",
    "HumanReviewOperator",
    "MultiRewardScorer",
    "Operator",
    "PPOUpdateOperator",
    "PreferenceOperator",
    "RewardModelScorer",
    "RewardOperator",
    "RolloutOperator",
    "WeightedFilterOperator",
    "build_config",
    "build_trainer",
]
