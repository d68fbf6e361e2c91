"""DAPO overlong reward shaping and the dynamic-sampling group filter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl.algos import apply_overlong_penalty, filter_groups, overlong_penalty


def _mask(lengths: list[int], T: int) -> torch.Tensor:
    return (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).float()


def test_overlong_penalty_hand_worked():
    # max 10, buffer 4 -> free up to 6 tokens, then -1/4 per token, reaching -1.0 at 10
    mask = _mask([5, 6, 8, 10], T=10)
    actual = overlong_penalty(mask, max_response_length=10, overlong_buffer_len=4, overlong_penalty_factor=1.0)
    expected = torch.tensor([0.0, 0.0, -0.5, -1.0])
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)  # exact in binary: quarters
    half = overlong_penalty(mask, max_response_length=10, overlong_buffer_len=4, overlong_penalty_factor=0.5)
    torch.testing.assert_close(half, expected * 0.5, rtol=0, atol=0)


def test_apply_overlong_penalty_puts_it_on_the_last_valid_token():
    mask = _mask([2, 4, 0], T=4)
    scores = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    out, penalty = apply_overlong_penalty(
        scores, mask, max_response_length=4, overlong_buffer_len=2, overlong_penalty_factor=1.0
    )
    # lengths 2, 4, 0 against free length 2: penalties 0, -1, 0 (the empty row has no token to hold one)
    torch.testing.assert_close(penalty, torch.tensor([0.0, -1.0, 0.0]), rtol=0, atol=0)
    torch.testing.assert_close(out.sum(-1), scores.sum(-1) + penalty, rtol=0, atol=0)
    assert out[1, 3] == 0.0 and torch.equal(out[0], scores[0])


def test_overlong_bad_config():
    mask = _mask([1], T=4)
    with pytest.raises(ValueError, match="overlong_buffer.len must be finite and > 0"):
        overlong_penalty(mask, max_response_length=4, overlong_buffer_len=0, overlong_penalty_factor=1.0)
    with pytest.raises(ValueError, match="must not exceed data.max_response_length"):
        overlong_penalty(mask, max_response_length=4, overlong_buffer_len=5, overlong_penalty_factor=1.0)


def test_filter_groups_hand_worked():
    index = np.array(["a", "a", "b", "b", "c", "d", "d"], dtype=object)
    values = torch.tensor([1.0, 0.0, 1.0, 1.0, 5.0, 0.1, 0.1])
    result = filter_groups(index=index, metric_values=values)
    # a differs (kept), b all equal (dropped), c singleton (kept), d all equal 0.1 (dropped)
    assert result.kept_indices.tolist() == [0, 1, 4]
    assert (result.num_groups, result.num_kept_groups, result.num_dropped_groups) == (4, 2, 2)
    assert result.kept_indices.dtype == np.int64


def test_filter_groups_keeps_everything_with_spread_and_accepts_lists():
    result = filter_groups(index=[0, 1, 0, 1], metric_values=[0.0, 1.0, 1.0, 0.0])
    assert result.kept_indices.tolist() == [0, 1, 2, 3] and result.num_dropped_groups == 0


def test_filter_groups_bad_inputs():
    with pytest.raises(ValueError, match="metric_values\\[1\\] = nan is not finite"):
        filter_groups(index=["a", "a"], metric_values=[1.0, float("nan")])
    with pytest.raises(ValueError, match="index has 3 entries but the batch has B = 2"):
        filter_groups(index=["a", "a", "b"], metric_values=[1.0, 2.0])
    with pytest.raises(ValueError, match="empty batch"):
        filter_groups(index=[], metric_values=[])
    with pytest.raises(ValueError, match="numeric"):
        filter_groups(index=["a"], metric_values=["high"])


def test_one_token_response_at_position_zero_gets_its_penalty():
    # Free length 0 (buffer = max = 4): a single token at position 0 is the last valid token.
    mask = _mask([1, 0], T=4)
    scores = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    out, penalty = apply_overlong_penalty(
        scores, mask, max_response_length=4, overlong_buffer_len=4, overlong_penalty_factor=1.0
    )
    torch.testing.assert_close(penalty, torch.tensor([-0.25, 0.0]), rtol=0, atol=0)
    expected = torch.tensor([[0.75, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
