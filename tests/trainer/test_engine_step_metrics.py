"""``verl.engine.step.reduce_step_metrics`` on one rank: the step loss is the sum of the micro-batch
shares, metrics their mean, ``max:`` metrics their maximum, and a metric missing from some
micro-batches is refused with their indices."""

from __future__ import annotations

import types

import pytest
import torch


def _one_rank() -> types.SimpleNamespace:
    group = types.SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    return types.SimpleNamespace(pp=group, dp=group, tp=group)


def test_sum_mean_and_max_over_micro_batches():
    from verl.engine.step import reduce_step_metrics

    losses = [torch.tensor(0.25), torch.tensor(0.5), torch.tensor(0.125)]
    per_micro = [
        {"entropy": torch.tensor(1.0), "max:ratio": torch.tensor(1.5)},
        {"entropy": torch.tensor(2.0), "max:ratio": torch.tensor(3.0)},
        {"entropy": torch.tensor(4.5), "max:ratio": torch.tensor(-1.0)},
    ]
    loss, metrics = reduce_step_metrics(losses, per_micro, _one_rank(), torch.device("cpu"))
    assert loss == 0.875  # exact in binary: the shares add up, no mean over micro-batches
    assert metrics == {"entropy": 2.5, "max:ratio": 3.0}


def test_a_metric_missing_from_some_micro_batches_is_refused():
    from verl.engine.step import reduce_step_metrics

    per_micro = [{"kl": torch.tensor(0.1)}, {}, {"kl": torch.tensor(0.3)}, {}]
    with pytest.raises(ValueError, match=r"metric 'kl' for some micro-batches but not for \[1, 3\]"):
        reduce_step_metrics([torch.tensor(0.0)] * 4, per_micro, _one_rank(), torch.device("cpu"))
