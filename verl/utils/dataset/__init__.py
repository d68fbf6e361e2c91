"""The reference verl's import path of the RL dataset: ``from verl.utils.dataset import RLHFDataset``.

The class lives in :mod:`verl.data.rl_dataset`; subclass it to read data your own way (see its
docstring) and name the subclass in ``data.custom_cls.path`` / ``data.custom_cls.name``.
"""

from verl.data.rl_dataset import RLHFDataset, collate_fn

__all__ = ["RLHFDataset", "collate_fn"]
