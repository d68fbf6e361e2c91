"""A seeded sampler and a data loader whose position survives a checkpoint.

The loader counts the samples it has handed to the caller (not what its workers have
prefetched), so ``state_dict()`` taken between two steps and given to ``load_state_dict``
of a fresh loader makes the next batches exactly those an uninterrupted run would see.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler


class ResumableSampler(Sampler[int]):
    """Indices of one epoch, a seeded permutation (or in order), from a start offset.

    The permutation of epoch ``e`` depends only on ``(seed, e)``, so any position
    ``(epoch, offset)`` can be resumed without replaying earlier epochs.
    """

    def __init__(self, num_samples: int, *, shuffle: bool = True, seed: int = 0):
        if num_samples <= 0:
            raise ValueError(f"cannot sample from an empty dataset (num_samples={num_samples})")
        self.num_samples = num_samples
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.offset = 0

    def set_position(self, epoch: int, offset: int) -> None:
        """Start the next iteration at sample ``offset`` of epoch ``epoch``."""
        if not 0 <= offset <= self.num_samples:
            raise ValueError(f"sampler offset {offset} out of range [0, {self.num_samples}]")
        self.epoch, self.offset = epoch, offset

    def order(self, epoch: int) -> torch.Tensor:
        """The full index order of ``epoch``  # [num_samples]"""
        if not self.shuffle:
            return torch.arange(self.num_samples)
        g = torch.Generator()
        g.manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=g)

    def __iter__(self) -> Iterator[int]:
        yield from self.order(self.epoch)[self.offset :].tolist()

    def __len__(self) -> int:
        return self.num_samples - self.offset


class StatefulDataLoader:
    """A DataLoader over a ``ResumableSampler`` with ``state_dict`` / ``load_state_dict``.

    Iterating yields the rest of the current epoch, then moves to the next epoch (a
    ``for epoch in range(n): for batch in loader`` loop works as with a DataLoader).
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        drop_last: bool = True,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        n = len(dataset)
        if drop_last and n < batch_size:
            raise ValueError(
                f"dataset has {n} samples, fewer than one batch of {batch_size} (drop_last=True); "
                f"lower the batch size or add data"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.sampler = ResumableSampler(n, shuffle=shuffle, seed=seed)
        self._loader_kwargs = dict(
            batch_size=batch_size,
            drop_last=drop_last,
            num_workers=num_workers,
            collate_fn=collate_fn,
            persistent_workers=False,
        )
        self.epoch = 0
        self.offset = 0  # samples of this epoch already handed to the caller

    def __len__(self) -> int:
        """Batches per full epoch."""
        n = self.sampler.num_samples
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_position(self.epoch, self.offset)
        loader = DataLoader(self.dataset, sampler=self.sampler, **self._loader_kwargs)
        for batch in loader:
            self.offset = min(self.offset + self.batch_size, self.sampler.num_samples)
            yield batch
        self.epoch += 1
        self.offset = 0

    def state_dict(self) -> dict[str, int]:
        """The position to resume from: epoch, samples consumed in it, seed and dataset size."""
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "seed": self.sampler.seed,
            "num_samples": self.sampler.num_samples,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at a saved position; the seed and dataset size must match the saved ones."""
        for key, mine in (("seed", self.sampler.seed), ("num_samples", self.sampler.num_samples)):
            if state.get(key) != mine:
                raise ValueError(
                    f"data loader checkpoint has {key}={state.get(key)} but this loader has {key}={mine}; "
                    f"resume with the same data files and data.seed"
                )
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
        self.sampler.set_position(self.epoch, self.offset)
