"""Property tests (hypothesis) over random shapes, masks and values.

Every function must return finite numbers for any mask, including all-masked rows and fully
masked batches, with padding that holds -inf log-probs; estimators must be exactly 0 on masked
tokens; GRPO must sum to zero per group; aggregation must be invariant to how a batch is split;
every policy loss's gradient must be the same whether a mini-batch runs as one micro-batch on
one rank or cut into micro-batches over two data-parallel ranks (except the two losses that
choose tokens by the statistics of each micro-batch, as the reference does); and at the first
step (old = new log-probs) every loss's ratio is 1: nothing is clipped, the KL metrics are 0 and
the gradient is the plain policy gradient.
"""

from __future__ import annotations

import inspect
import itertools

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from verl.algos import (
    GlobalBatchInfo,
    agg_loss,
    compute_advantage,
    compute_kl_loss,
    compute_policy_loss,
    compute_value_loss,
    get_policy_loss,
    kl_penalty,
    list_adv_estimators,
    list_kl_estimators,
    list_loss_agg_modes,
    list_policy_losses,
)

SETTINGS = settings(max_examples=40, deadline=None)  # deadline off: the CPU is shared by many jobs

# Hyper-parameters for the losses that need some (each loss takes only the ones it names): dro has no
# default beta; bypass_mode with its IS weights and a rejection test on, so they are exercised too.
HYPER = dict(dro_beta=0.1, rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0")


@st.composite
def batches(draw, min_group: int = 1):
    """(B, T, mask [B, T] float 0/1, uids [B] object array, generator seed)."""
    groups = draw(st.integers(1, 3))
    sizes = [draw(st.integers(min_group, 3)) for _ in range(groups)]
    B = sum(sizes)
    T = draw(st.integers(1, 6))
    bits = draw(st.lists(st.booleans(), min_size=B * T, max_size=B * T))
    mask = torch.tensor(bits, dtype=torch.float32).reshape(B, T)
    uids = np.array([f"g{g}" for g, n in enumerate(sizes) for _ in range(n)], dtype=object)
    order = draw(st.permutations(list(range(B))))
    seed = draw(st.integers(0, 2**16))
    return B, T, mask, uids[np.array(order)], seed


def _finite(*tensors: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


@SETTINGS
@given(batches(min_group=2), st.sampled_from(list_adv_estimators()))
def test_estimators_finite_and_zero_on_masked_tokens(batch, name):
    B, T, mask, uids, seed = batch
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, T, generator=g) * 3
    adv, ret = compute_advantage(
        name,
        token_level_rewards=rewards,
        values=torch.randn(B, T, generator=g),
        response_mask=mask,
        index=uids,
        reward_baselines=torch.randn(B, generator=g),
        old_log_probs=-torch.rand(B, T, generator=g) * 5,  # the optimal-token-baseline estimators
        sum_pi_squared=torch.rand(B, T, generator=g),
        gamma=float(torch.rand((), generator=g)),
        lam=float(torch.rand((), generator=g)),
        norm_adv_by_std_in_grpo=bool(seed % 2),
    )
    assert adv.shape == (B, T) and ret.shape == (B, T)
    assert _finite(adv, ret)
    assert torch.all(adv[mask == 0] == 0) and torch.all(ret[mask == 0] == 0)


@SETTINGS
@given(batches(), st.booleans())
def test_grpo_sums_to_zero_in_every_group(batch, norm):
    B, T, _, uids, seed = batch
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T)
    rewards = torch.randint(0, 3, (B, T), generator=g).float()
    adv, _ = compute_advantage(
        "grpo", token_level_rewards=rewards, response_mask=mask, index=uids, norm_adv_by_std_in_grpo=norm
    )
    for uid in set(uids.tolist()):
        members = torch.from_numpy(uids == uid)
        if int(members.sum()) > 1:  # a singleton keeps its raw score
            # <= 3 values of magnitude <= 2/eps-scaled std: float32 rounding well below 1e-5
            assert abs(float(adv[members, 0].sum())) < 1e-5


@SETTINGS
@given(batches(), st.sampled_from(list_policy_losses()), st.sampled_from(list_loss_agg_modes()))
def test_policy_losses_finite_with_inf_padding(batch, name, mode):
    B, T, mask, _, seed = batch
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 20
    new = old + torch.randn(B, T, generator=g) * 5  # ratios far outside the clip range too
    pad = torch.tensor(float("-inf"))
    old = torch.where(mask.bool(), old, pad)
    log_prob = torch.where(mask.bool(), new, pad).requires_grad_()
    adv = torch.randn(B, T, generator=g) * 10
    loss, metrics = compute_policy_loss(
        name, old_log_prob=old, log_prob=log_prob, advantages=adv, response_mask=mask, loss_agg_mode=mode, **HYPER
    )
    (grad,) = torch.autograd.grad(loss, log_prob)
    assert _finite(loss, grad, *metrics.values())
    assert torch.all(grad[mask == 0] == 0)
    for key in ("pg_clipfrac", "pg_clipfrac_lower"):
        assert 0.0 <= float(metrics[key]) <= 1.0


@SETTINGS
@given(batches(), st.sampled_from([k for k in list_kl_estimators() if not k.startswith("full")]))
def test_kl_estimators_finite_and_kl_loss_finite(batch, kind):
    B, T, mask, _, seed = batch
    g = torch.Generator().manual_seed(seed)
    log_prob = (-torch.rand(B, T, generator=g) * 40).requires_grad_()
    ref = -torch.rand(B, T, generator=g) * 40
    kld = kl_penalty(log_prob, ref, kind)
    assert _finite(kld)
    if kind not in ("kl", "k1", "kl+", "k1+"):
        assert bool((kld >= 0).all())  # abs, k2, k3 are nonnegative
    loss = compute_kl_loss(log_prob=log_prob, ref_log_prob=ref, response_mask=mask, kl_loss_type=kind)
    (grad,) = torch.autograd.grad(loss, log_prob)
    assert _finite(loss, grad)


@SETTINGS
@given(batches(), st.sampled_from(list_loss_agg_modes()))
def test_value_loss_finite(batch, mode):
    B, T, mask, _, seed = batch
    g = torch.Generator().manual_seed(seed)
    vpreds = torch.randn(B, T, generator=g).requires_grad_()
    loss, clipfrac = compute_value_loss(
        vpreds=vpreds, returns=torch.randn(B, T, generator=g), values=torch.randn(B, T, generator=g),
        response_mask=mask, cliprange_value=0.2, loss_agg_mode=mode,
    )
    (grad,) = torch.autograd.grad(loss, vpreds)
    assert _finite(loss, clipfrac, grad) and 0.0 <= float(clipfrac) <= 1.0


@SETTINGS
@given(batches(), st.sampled_from(list_loss_agg_modes()), st.data())
def test_aggregation_is_invariant_to_any_split(batch, mode, data):
    B, T, mask, _, seed = batch
    g = torch.Generator().manual_seed(seed)
    loss_mat = torch.randn(B, T, generator=g)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(B - 1, 1)), max_size=3)))) if B > 1 else []
    bounds = [0, *cuts, B]
    pieces = [slice(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
    info = GlobalBatchInfo.from_masks([mask[s] for s in pieces])
    expected = agg_loss(loss_mat, mask, mode)
    actual = sum(agg_loss(loss_mat[s], mask[s], mode, global_batch_info=info) for s in pieces)
    # different float32 summation order over <= 36 N(0,1) terms
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


# clip_cov and kl_cov pick tokens by the covariance and token count of each micro-batch (as the
# reference does): their gradient depends on the cut by design (their docstrings say so).
PER_MICRO_BATCH = {"clip_cov", "kl_cov"}
# losses that aggregate per sequence whatever loss_agg_mode says
SEQUENCE_MEAN = {"gspo", "sapo", "geo_mean"}


def _cuts(data, lo: int, hi: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous non-empty row ranges covering [lo, hi), cut at drawn points."""
    points = sorted(data.draw(st.sets(st.integers(lo + 1, hi - 1), min_size=parts - 1, max_size=parts - 1))) if parts > 1 else []
    return list(itertools.pairwise([lo, *points, hi]))


# every (loss, mode) pair each run: a few drawn batches per pair
PAIR_SETTINGS = settings(max_examples=8, deadline=None)


@pytest.mark.parametrize("mode", list_loss_agg_modes())
@pytest.mark.parametrize("name", sorted(set(list_policy_losses()) - PER_MICRO_BATCH))
@PAIR_SETTINGS
@given(batch=batches(), dp=st.integers(1, 2), data=st.data())
def test_policy_loss_gradient_is_invariant_to_micro_batches_and_data_parallel(name, mode, batch, dp, data):
    B, T, mask, _, seed = batch
    assume(B >= dp)
    g = torch.Generator().manual_seed(seed)
    mask = mask.double()
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    new = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)

    whole = new.clone().requires_grad_()
    expected, _ = compute_policy_loss(
        name, old_log_prob=old, log_prob=whole, advantages=adv, response_mask=mask, loss_agg_mode=mode, **HYPER
    )
    (expected_grad,) = torch.autograd.grad(expected, whole)

    # rows dealt to dp ranks, each rank's rows cut into micro-batches; the engine's denominators are the
    # whole mini-batch's (GlobalBatchInfo over every rank), and DDP averages the ranks' gradients
    pieces = []
    for lo, hi in _cuts(data, 0, B, dp):
        pieces += _cuts(data, lo, hi, data.draw(st.integers(1, hi - lo)))
    counts = GlobalBatchInfo.from_masks([mask[a:b] for a, b in pieces])
    info = GlobalBatchInfo(batch_num_tokens=counts.batch_num_tokens, global_batch_size=counts.global_batch_size, dp_size=dp)
    split = new.clone().requires_grad_()
    total = sum(
        compute_policy_loss(
            name, old_log_prob=old[a:b], log_prob=split[a:b], advantages=adv[a:b], response_mask=mask[a:b],
            loss_agg_mode=mode, global_batch_info=info, **HYPER,
        )[0]
        for a, b in pieces
    )
    (actual_grad,) = torch.autograd.grad(total / dp, split)  # DDP: the mean over ranks
    # float64; only the summation order differs
    torch.testing.assert_close(actual_grad, expected_grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(total / dp, expected.detach(), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("mode", list_loss_agg_modes())
@pytest.mark.parametrize("name", list_policy_losses())
@PAIR_SETTINGS
@given(batch=batches())
def test_first_step_ratio_is_one_for_every_loss(name, mode, batch):
    B, T, mask, _, seed = batch
    g = torch.Generator().manual_seed(seed)
    log_prob = (-torch.rand(B, T, generator=g) * 5).requires_grad_()
    old = log_prob.detach().clone()  # the first update: the same weights gave both
    adv = (torch.randn(B, 1, generator=g) * 2).expand(B, T)  # one advantage per sequence (GRPO's case)
    loss, metrics = compute_policy_loss(
        name, old_log_prob=old, log_prob=log_prob, advantages=adv, response_mask=mask, loss_agg_mode=mode, **HYPER
    )
    (grad,) = torch.autograd.grad(loss, log_prob)
    assert _finite(loss, grad)
    assert float(metrics["ppo_kl"]) == 0.0
    if name != "clip_cov":  # clip_cov's pg_clipfrac is its share of covariance-chosen tokens, not a ratio clip
        assert float(metrics["pg_clipfrac"]) == 0.0
    assert float(metrics["pg_clipfrac_lower"]) == 0.0
    if name == "bypass_mode":
        assert float(metrics["rollout_corr/kl"]) == 0.0 and float(metrics["rollout_corr/k3_kl"]) == 0.0
        assert float(metrics["rollout_corr/rollout_rs_masked_fraction"]) == 0.0
        assert float(metrics["rollout_corr/rollout_is_mean"]) == (1.0 if mask.any() else 0.0)
    if name == "clip_cov":
        return  # it drops the gradient of its chosen tokens at any ratio
    # ratio 1: each loss's gradient is the plain policy gradient -A grad log pi, aggregated its way
    pg_mode = "seq-mean-token-mean" if name in SEQUENCE_MEAN else mode
    log_prob_pg = log_prob.detach().clone().requires_grad_()
    (expected,) = torch.autograd.grad(agg_loss(-adv * log_prob_pg, mask, pg_mode), log_prob_pg)
    # float32: the ratio's exp/log round trips and the per-sequence sums round at ~1e-7 of values <= ~10
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6)
    assert "sample_weight" in inspect.signature(get_policy_loss(name)).parameters  # the actor's weighted filter
