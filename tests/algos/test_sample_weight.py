"""Per-sample weights (``sample_weight`` [B], set by ``verl.WeightedFilterOperator``) in the loss
aggregation and in the actor's loss function, against hand-worked values."""

from __future__ import annotations

import pytest
import torch

from verl.algos import GlobalBatchInfo, agg_loss, compute_policy_loss, list_policy_losses

L = torch.tensor([[1.0, 2.0], [3.0, 4.0]])  # [B=2, T=2]
M = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
W = torch.tensor([2.0, 0.5])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (2 * (1 + 2) + 0.5 * 3) / 3),  # weighted token sum / 3 valid tokens
        ("seq-mean-token-sum", (2 * (1 + 2) + 0.5 * 3) / 2),  # / 2 sequences
        ("seq-mean-token-mean", (2 * (1 + 2) / 2 + 0.5 * 3 / 1) / 2),
        ("seq-mean-token-sum-norm", (2 * (1 + 2) + 0.5 * 3) / 2 / 2),  # / T = 2
    ],
)
def test_agg_loss_scales_each_sequence_by_its_weight(mode, expected):
    actual = agg_loss(L, M, mode, sample_weight=W)
    assert float(actual) == pytest.approx(expected, rel=1e-6)  # float32 sums of a few terms
    assert float(agg_loss(L, M, mode, sample_weight=torch.ones(2))) == pytest.approx(float(agg_loss(L, M, mode)))


def test_agg_loss_refuses_bad_weights():
    with pytest.raises(ValueError, match=r"sample_weight must be a \[B\] tensor with B=2"):
        agg_loss(L, M, sample_weight=torch.ones(3))
    with pytest.raises(ValueError, match="finite and >= 0"):
        agg_loss(L, M, sample_weight=torch.tensor([1.0, -1.0]))


@pytest.mark.parametrize("name", list_policy_losses())
def test_every_policy_loss_takes_the_weights(name):
    torch.manual_seed(0)
    logp = torch.randn(2, 3) * 0.1 - 1.0
    inputs = dict(old_log_prob=logp - 0.05, log_prob=logp, advantages=torch.tensor([[1.0] * 3, [-2.0] * 3]),
                  response_mask=torch.ones(2, 3))
    hyper = dict(dro_beta=0.1)  # dro's has no default; the other losses do not take it
    one, _ = compute_policy_loss(name, **inputs, **hyper, sample_weight=torch.tensor([1.0, 0.0]))
    only_first, _ = compute_policy_loss(name, **{k: v[:1] for k, v in inputs.items()}, **hyper,
                                        global_batch_info=GlobalBatchInfo(batch_num_tokens=6, global_batch_size=2))
    # Weight 0 removes the second sample's share; the denominators still count it (6 tokens, 2 sequences).
    assert float(one) == pytest.approx(float(only_first), rel=1e-5)


def test_actor_loss_weights_the_policy_and_kl_terms():
    from verl.config.schema import ActorConfig
    from verl.roles.actor import Actor

    cfg = ActorConfig(use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k1")
    # The loss function reads only the actor's config and old-log-prob source: no engine needed.
    actor = Actor.__new__(Actor)
    actor.cfg, actor.old_log_prob = cfg, "recompute"
    make_loss = actor._loss_builder(2)
    logp = torch.full((2, 2), -1.0)
    micro = {
        "response_mask": torch.ones(2, 2),
        "old_log_probs": logp,  # ratio 1: the per-token policy loss is -A
        "advantages": torch.tensor([[1.0, 1.0], [2.0, 2.0]]),
        "ref_log_prob": logp - 0.1,  # k1 KL = 0.1 per token
        "sample_weight": torch.tensor([1.0, 0.5]),
    }
    info = GlobalBatchInfo(batch_num_tokens=4, global_batch_size=2)
    share = make_loss(info, 1)({"logprobs": logp.clone().requires_grad_()}, micro)
    pg = -(1 * (1 + 1) + 0.5 * (2 + 2)) / 4  # -1.0
    kl = (1 * 0.1 * 2 + 0.5 * 0.1 * 2) / 4  # 0.075
    expected = pg + 0.5 * kl
    assert float(share.loss.detach()) == pytest.approx(expected, rel=1e-6)
    assert float(share.metrics["pg_loss"]) == pytest.approx(pg, rel=1e-6)
    assert float(share.metrics["kl_loss"]) == pytest.approx(kl, rel=1e-5)
