"""Trainers and their infrastructure.

- :mod:`verl.trainer.main_sft` — ``python -m verl.trainer.main_sft`` (SFT on the Megatron model).
- :mod:`verl.trainer.sft_trainer` — ``SFTTrainer(cfg).fit()``.
- :mod:`verl.trainer.checkpoint` — ``CheckpointManager``: atomic ``global_step_N`` checkpoints, resume.
- :mod:`verl.trainer.tracking` — ``Tracking`` (console/jsonl/tensorboard/wandb/mlflow), ``progress_bar``.
- :mod:`verl.trainer.eval_generation` — task accuracy of a Hugging Face checkpoint (greedy, rule scorers).

Modules are imported explicitly (``RLTrainer``, the facade of :mod:`verl.trainer.api`, on first
access), so ``import verl.trainer`` stays cheap.
"""

import importlib as _importlib
from typing import Any as _Any


def __getattr__(name: str) -> _Any:
    # verl.trainer.RLTrainer is the keyword-argument facade (verl.trainer.api); the config-driven
    # trainer it drives stays verl.trainer.ppo_trainer.PPOTrainer.
    if name == "RLTrainer":
        return _importlib.import_module("verl.trainer.api").RLTrainer
    raise AttributeError(f"module 'verl.trainer' has no attribute {name!r}")
