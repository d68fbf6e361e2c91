"""Token-budget micro-batches (``verl.models.micro_batches``) on one rank: the budget holds, every
row is in exactly one micro-batch, the count is the fewest that fits where that is easy to know,
and too-long rows are refused by name."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from verl.models.micro_batches import fixed_split, pack_by_tokens, token_split


def _mask(lengths: list[int], width: int | None = None) -> torch.Tensor:
    width = width or max(lengths)
    return (torch.arange(width).expand(len(lengths), width) < torch.tensor(lengths).unsqueeze(1)).long()


def _fewest_exact(lengths: list[int], budget: int) -> int:
    """The optimal bin-packing count by brute force (small inputs only)."""
    for k in range(1, len(lengths) + 1):
        for labels in itertools.product(range(k), repeat=len(lengths)):
            sums = [0] * k
            for length, label in zip(lengths, labels):
                sums[label] += length
            if max(sums) <= budget:
                return k
    raise AssertionError("unreachable: one row per bin always fits")


@pytest.mark.parametrize("seed", range(6))
def test_budget_holds_and_rows_are_covered_once(seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen).tolist()
    budget = 40 + seed * 7
    split = token_split(_mask(lengths), budget)
    rows = np.concatenate(split.parts)
    assert sorted(rows.tolist()) == list(range(len(lengths)))
    for part in split.parts:
        assert part.tolist() == sorted(part.tolist())  # batch order inside a micro-batch
        assert sum(lengths[i] for i in part) <= budget
    lower = -(-sum(lengths) // budget)
    assert lower <= split.count
    assert split.fill == pytest.approx(sum(lengths) / (split.count * budget))
    assert not split.pad  # one rank, no pipeline: micro-batches keep their own row counts


@pytest.mark.parametrize("seed", range(8))
def test_count_matches_the_optimum_on_small_cases(seed):
    # Greedy longest-first packing is not optimal bin packing in general; on these small random
    # cases (the shapes a rank sees: a few long rows and many short ones) it finds the optimum.
    gen = torch.Generator().manual_seed(100 + seed)
    lengths = torch.randint(2, 20, (7,), generator=gen).tolist()
    split = token_split(_mask(lengths), 24)
    assert split.count == _fewest_exact(lengths, 24)


def test_balances_tokens_across_micro_batches():
    # Fixed rows of 2 would give token sums 40, 40, 4, 4; the budget of 44 fits them in 2.
    lengths = [20, 20, 20, 20, 2, 2, 2, 2]
    split = token_split(_mask(lengths), 44)
    sums = sorted(sum(lengths[i] for i in part) for part in split.parts)
    assert sums == [44, 44]


def test_a_row_over_the_budget_is_refused_naming_the_budget():
    with pytest.raises(ValueError, match=r"a sequence of 30 tokens is longer than critic.ppo_max_token_len_per_gpu=20"):
        token_split(_mask([5, 30, 4]), 20, what="critic.ppo_max_token_len_per_gpu")


def test_a_count_multiple_needs_enough_rows():
    split = token_split(_mask([10, 10, 10]), 100, multiple_of=2)
    assert split.count == 2
    with pytest.raises(ValueError, match="every rank must run 2 micro-batches .* holds only 1 rows"):
        token_split(_mask([10]), 100, multiple_of=2)


def test_pack_by_tokens_reports_failure():
    assert pack_by_tokens([6, 6, 6], 10, 2) is None
    assert [p.tolist() for p in pack_by_tokens([6, 6, 6], 10, 3)] == [[0], [1], [2]]


def test_fixed_split_is_contiguous_and_padded():
    split = fixed_split(5, 2)
    assert [p.tolist() for p in split.parts] == [[0, 1], [2, 3], [4]]
    assert split.pad and split.rows == 2 and split.budget is None and split.fill is None
