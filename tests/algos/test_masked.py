"""Masked reductions and the registry mechanism."""

from __future__ import annotations

import pytest
import torch

from verl.algos import masked_mean, masked_sum, masked_var, masked_whiten
from verl.algos.registry import Registry, call_with_accepted

TOL = dict(rtol=0, atol=1e-6)


def test_masked_reductions_hand_worked():
    values = torch.tensor([[1.0, 2.0, float("-inf")], [3.0, float("nan"), 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    torch.testing.assert_close(masked_sum(values, mask), torch.tensor(11.0), **TOL)
    torch.testing.assert_close(masked_mean(values, mask), torch.tensor(11.0 / 4), **TOL)
    torch.testing.assert_close(masked_mean(values, mask, dim=-1), torch.tensor([1.5, 4.0]), **TOL)
    # [1, 2, 3, 5]: mean 2.75, squared deviations 3.0625 + 0.5625 + 0.0625 + 5.0625 = 8.75
    torch.testing.assert_close(masked_var(values, mask), torch.tensor(8.75 / 3), **TOL)
    torch.testing.assert_close(masked_var(values, mask, unbiased=False), torch.tensor(8.75 / 4), **TOL)
    whitened = masked_whiten(values, mask)
    std = (8.75 / 3 + 1e-8) ** 0.5
    torch.testing.assert_close(whitened[mask.bool()], (torch.tensor([1.0, 2.0, 3.0, 5.0]) - 2.75) / std, **TOL)
    shifted = masked_whiten(values, mask, shift_mean=False)
    torch.testing.assert_close(shifted[mask.bool()], whitened[mask.bool()] + 2.75, **TOL)


def test_all_masked_rows_and_tensors_are_zero():
    values = torch.randn(2, 3)
    mask = torch.tensor([[0, 0, 0], [1, 1, 0]])
    per_row = masked_mean(values, mask, dim=-1)
    assert per_row[0] == 0 and torch.isfinite(per_row).all()
    empty = torch.zeros(2, 3)
    assert masked_mean(values, empty) == 0 and masked_var(values, empty) == 0
    assert torch.isfinite(masked_whiten(values, empty)).all()
    one = torch.tensor([[0, 1, 0], [0, 0, 0]])
    assert masked_var(values, one) == 0  # a single entry has no unbiased variance
    assert masked_whiten(values, one)[0, 1] == 0


def test_registry_errors_and_aliases():
    reg: Registry = Registry("widget", "model.widget")

    @reg.register("a", "alias")
    def a():
        return 1

    assert reg.get("alias") is a and reg.names() == ["a", "alias"] and "a" in reg
    with pytest.raises(ValueError, match="unknown widget 'b' \\(config key model.widget\\); registered: \\['a', 'alias'\\]"):
        reg.get("b")
    with pytest.raises(ValueError, match="must be a string"):
        reg.get(3)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(lambda: 2)
    reg.register("a")(a)  # re-registering the same function is harmless


def test_call_with_accepted_passes_only_known_arguments():
    def f(*, x, y=2):
        return x + y

    assert call_with_accepted(f, "f", {"x": 1, "z": 100}) == 3
    with pytest.raises(ValueError, match="f needs \\['x'\\]"):
        call_with_accepted(f, "f", {"y": 1})
