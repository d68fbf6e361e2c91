"""The loader's position survives a checkpoint: the sequence after restore equals the uninterrupted one."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset

from verl.data import ResumableSampler, StatefulDataLoader


class Numbers(Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def batches(loader: StatefulDataLoader, epochs: int) -> list[list[int]]:
    return [b.tolist() for _ in range(epochs) for b in loader]


@pytest.mark.parametrize("num_workers", [0, 1])
@pytest.mark.parametrize("stop_after", [1, 3, 5, 7])  # mid first epoch, epoch end, mid second epoch
def test_resume_equals_uninterrupted(num_workers, stop_after):
    kw = dict(batch_size=3, shuffle=True, seed=11, num_workers=num_workers)
    expected = batches(
        StatefulDataLoader(Numbers(10), **kw), epochs=3
    )  # 3 batches per epoch, 1 dropped sample

    first = StatefulDataLoader(Numbers(10), **kw)
    actual: list[list[int]] = []
    it = iter(first)
    while len(actual) < stop_after:
        try:
            actual.append(next(it).tolist())
        except StopIteration:
            it = iter(first)
    state = first.state_dict()
    del it, first  # the interrupted run dies here (its prefetched batches are lost)

    resumed = StatefulDataLoader(Numbers(10), **kw)
    resumed.load_state_dict(state)
    while len(actual) < len(expected):
        actual.extend(b.tolist() for b in resumed)
    assert actual == expected


def test_epochs_differ_and_seed_matters():
    a = StatefulDataLoader(Numbers(12), batch_size=4, shuffle=True, seed=0)
    e0, e1 = batches(a, 1), batches(a, 1)
    assert e0 != e1 and sorted(sum(e0, [])) == list(range(12))
    b = StatefulDataLoader(Numbers(12), batch_size=4, shuffle=True, seed=1)
    assert batches(b, 1) != e0
    unshuffled = StatefulDataLoader(Numbers(12), batch_size=4, shuffle=False)
    assert batches(unshuffled, 1) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_mismatched_checkpoint_is_refused():
    state = StatefulDataLoader(Numbers(12), batch_size=4, seed=0).state_dict()
    with pytest.raises(ValueError, match="seed=0 but this loader has seed=5"):
        StatefulDataLoader(Numbers(12), batch_size=4, seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="num_samples=12 but this loader has num_samples=13"):
        StatefulDataLoader(Numbers(13), batch_size=4, seed=0).load_state_dict(state)


def test_sampler_order_depends_only_on_seed_and_epoch():
    s = ResumableSampler(20, shuffle=True, seed=4)
    s.set_position(2, 5)
    expected = ResumableSampler(20, shuffle=True, seed=4).order(2)[5:].tolist()
    assert list(s) == expected and len(s) == 15
    assert not torch.equal(s.order(0), s.order(1))
    with pytest.raises(ValueError, match="fewer than one batch"):
        StatefulDataLoader(Numbers(3), batch_size=4)
