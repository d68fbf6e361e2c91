"""The policy losses share one prologue: a bad clip range is refused alike by every loss that takes one."""

from __future__ import annotations

import inspect

import pytest
import torch

from verl.algos import compute_policy_loss, get_policy_loss, list_policy_losses

_CLIPPED = [
    n for n in list_policy_losses() if "clip_ratio" in inspect.signature(get_policy_loss(n)).parameters
]


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    old_log_prob = -torch.rand(2, 3, generator=g)
    return {
        "old_log_prob": old_log_prob,
        "log_prob": old_log_prob + 0.1 * torch.randn(2, 3, generator=g),
        "advantages": torch.randn(2, 3, generator=g),
        "response_mask": torch.ones(2, 3),
    }


def test_the_clipped_losses_are_found():
    # a rename of the clip keys would otherwise empty the parametrisation below and pass
    expected = {"vanilla", "gspo", "cispo", "geo_mean", "clip_cov", "dppo_tv", "dppo_kl", "bypass_mode"}
    assert expected <= set(_CLIPPED)


@pytest.mark.parametrize("name", _CLIPPED)
@pytest.mark.parametrize(
    "clip, match",
    [
        ({"clip_ratio": -0.2}, "actor.clip_ratio_low must be finite and >= 0, got -0.2"),
        ({"clip_ratio_low": -0.1}, "actor.clip_ratio_low must be finite and >= 0, got -0.1"),
        ({"clip_ratio_high": float("inf")}, "actor.clip_ratio_high must be finite and >= 0, got inf"),
    ],
)
def test_a_bad_clip_range_is_refused_by_every_loss_that_takes_one(name, clip, match):
    with pytest.raises(ValueError, match=match):
        compute_policy_loss(name, **_batch(), **clip)
