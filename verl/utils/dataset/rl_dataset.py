"""``from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn``, as the reference verl's
examples write it (the same objects as :mod:`verl.utils.dataset`)."""

from verl.data.rl_dataset import RLHFDataset, collate_fn

__all__ = ["RLHFDataset", "collate_fn"]
