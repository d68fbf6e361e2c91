"""Trainers and their infrastructure.

- :mod:`verl.trainer.main_sft` — ``python -m verl.trainer.main_sft`` (SFT on the Megatron model).
- :mod:`verl.trainer.sft_trainer` — ``SFTTrainer(cfg).fit()``.
- :mod:`verl.utils.checkpoint` — ``CheckpointManager``: atomic ``global_step_N`` checkpoints, resume.
- :mod:`verl.trainer.tracking` — ``Tracking`` (console/jsonl/tensorboard/wandb/mlflow), ``progress_bar``.
- :mod:`verl.trainer.eval_generation` — task accuracy of a Hugging Face checkpoint (greedy, rule scorers).

Modules are imported explicitly, so ``import verl.trainer`` stays cheap. The keyword-argument
facade ``verl.RLTrainer`` is the Python API's (``verl.api.facade``), above this package;
``from verl.trainer import RLTrainer`` (the tutorials' import path) resolves to that same class on
first access.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    # The one upward import of the trainer (tests/test_layers.py allows exactly this one): the
    # tutorials write ``from verl.trainer import RLTrainer``, a contract kept since the facade moved
    # to verl.api. Resolved on first access, so importing the trainer never imports the API.
    if name == "RLTrainer":
        from verl.api.facade import RLTrainer

        return RLTrainer
    raise AttributeError(f"module 'verl.trainer' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), "RLTrainer"])
