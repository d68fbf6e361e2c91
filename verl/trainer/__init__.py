"""Trainers and their infrastructure.

- :mod:`verl.trainer.main_sft` — ``python -m verl.trainer.main_sft`` (SFT on the Megatron model).
- :mod:`verl.trainer.sft_trainer` — ``SFTTrainer(cfg).fit()``.
- :mod:`verl.utils.checkpoint` — ``CheckpointManager``: atomic ``global_step_N`` checkpoints, resume.
- :mod:`verl.trainer.tracking` — ``Tracking`` (console/jsonl/tensorboard/wandb/mlflow), ``progress_bar``.
- :mod:`verl.trainer.eval_generation` — task accuracy of a Hugging Face checkpoint (greedy, rule scorers).

Modules are imported explicitly, so ``import verl.trainer`` stays cheap. The keyword-argument
facade ``verl.RLTrainer`` is the Python API's (``verl.api.facade``), above this package.
"""
