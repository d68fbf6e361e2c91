"""KL estimators, straight-through gradients, KL controllers, KL in the reward and as a loss."""

from __future__ import annotations

import math

import pytest
import torch

from verl.algos import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    compute_kl_loss,
    get_kl_estimator,
    kl_penalty,
    list_kl_estimators,
    make_kl_controller,
)

TOL = dict(rtol=0, atol=1e-6)  # float32 exp/log of O(1) numbers

POINTWISE = [k for k in list_kl_estimators() if not k.startswith("full")]


def test_registry_names():
    assert set(list_kl_estimators()) == {
        "kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full",
        "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+",
    }
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'.*registered: .*low_var_kl"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")
    with pytest.raises(ValueError, match="unknown KL estimator 'full\\+'"):
        get_kl_estimator("full+")


def test_estimators_hand_worked():
    # x = log_prob - ref_log_prob = [0.5, -0.5]
    log_prob = torch.tensor([[-1.0, -1.0]])
    ref = torch.tensor([[-1.5, -0.5]])
    expected = {
        "kl": [0.5, -0.5],
        "abs": [0.5, 0.5],
        "mse": [0.125, 0.125],
        # k3: r = exp(ref - logp); r - log r - 1: exp(-0.5) + 0.5 - 1, exp(0.5) - 0.5 - 1
        "low_var_kl": [math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5],
    }
    aliases = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}
    for kind in POINTWISE:
        base = aliases.get(kind.rstrip("+"), kind.rstrip("+"))
        actual = kl_penalty(log_prob, ref, kind)
        torch.testing.assert_close(actual, torch.tensor([expected[base]]), **TOL, msg=kind)


def test_k3_is_clamped():
    # log r = -30 is clamped to -20: exp(-20) + 20 - 1 = 19.000000002, then clamped to 10
    actual = kl_penalty(torch.tensor([[0.0]]), torch.tensor([[-30.0]]), "low_var_kl")
    assert actual.item() == 10.0


@pytest.mark.parametrize("kind", POINTWISE)
def test_every_estimator_is_zero_at_the_reference(kind):
    torch.manual_seed(0)
    lp = (-torch.rand(3, 5) * 5).requires_grad_()
    actual = kl_penalty(lp, lp.detach().clone(), kind)
    assert torch.equal(actual, torch.zeros(3, 5))
    actual.sum().backward()
    # k1's gradient is 1 everywhere (why it is a poor loss); the others are minimal at equality
    # (abs has a kink there and torch's sign(0) = 0), and the straight-through ones use k2's
    expected_grad = torch.ones(3, 5) if kind in ("kl", "k1") else torch.zeros(3, 5)
    assert torch.equal(lp.grad, expected_grad)


def test_full_kl_is_zero_at_the_reference_and_hand_worked():
    logits = torch.randn(2, 3, 11)
    assert torch.allclose(kl_penalty(logits, logits.clone(), "full"), torch.zeros(2, 3), atol=1e-6)
    # p = [.5, .5], q = [.25, .75]: .5 ln 2 + .5 ln(2/3)
    p = torch.tensor([[[0.0, 0.0]]])
    q = torch.tensor([[[math.log(0.25), math.log(0.75)]]])
    expected = torch.tensor([[0.5 * math.log(2.0) + 0.5 * math.log(0.5 / 0.75)]])
    torch.testing.assert_close(kl_penalty(p, q, "full"), expected, **TOL)
    # the reference assigning probability 0 to a policy token gives a large finite penalty, not inf
    q_zero = torch.tensor([[[0.0, float("-inf")]]])
    assert torch.isfinite(kl_penalty(p, q_zero, "full")).all()


@pytest.mark.parametrize("kind", ["k1+", "k3+", "low_var_kl+", "abs+", "kl+"])
def test_straight_through_value_of_one_gradient_of_k2(kind):
    torch.manual_seed(1)
    lp = (-torch.rand(4, 3) * 3).requires_grad_()
    ref = -torch.rand(4, 3) * 3
    st = kl_penalty(lp, ref, kind)
    base = kind.rstrip("+")
    torch.testing.assert_close(st, kl_penalty(lp, ref, base), rtol=0, atol=0)
    (grad,) = torch.autograd.grad(st.sum(), lp)
    # gradient of k2 = 0.5 (lp - ref)^2 is (lp - ref)
    torch.testing.assert_close(grad, (lp - ref).detach(), **TOL)


def test_k2_plus_is_k2():
    assert get_kl_estimator("k2+") is get_kl_estimator("k2")


def test_kl_penalty_bad_inputs():
    with pytest.raises(ValueError, match="same shape"):
        kl_penalty(torch.zeros(2, 3), torch.zeros(2, 4), "kl")
    with pytest.raises(ValueError, match="floating-point"):
        kl_penalty(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), "kl")
    with pytest.raises(ValueError, match="empty"):
        kl_penalty(torch.zeros(0, 3), torch.zeros(0, 3), "kl")


# ----------------------------------------------------------------------------------------------
# controllers and KL in the reward


def test_adaptive_controller_hand_worked():
    ctrl = make_kl_controller(type="adaptive", kl_coef=0.1, target_kl=0.5, horizon=100)
    assert isinstance(ctrl, AdaptiveKLController)
    ctrl.update(current_kl=1.0, n_steps=10)  # error clip(1.0/0.5 - 1, +-0.2) = 0.2 -> x(1 + 0.2*10/100)
    assert ctrl.value == pytest.approx(0.1 * 1.02, abs=1e-12)
    ctrl.update(current_kl=0.45, n_steps=10)  # error 0.9 - 1 = -0.1 -> x(1 - 0.01)
    assert ctrl.value == pytest.approx(0.1 * 1.02 * 0.99, abs=1e-12)
    state = ctrl.state_dict()
    fresh = make_kl_controller(type="adaptive", kl_coef=0.1, target_kl=0.5, horizon=100)
    fresh.load_state_dict(state)
    assert fresh.value == ctrl.value


def test_fixed_controller_and_bad_controller_config():
    ctrl = make_kl_controller(type="fixed", kl_coef=0.05)
    assert isinstance(ctrl, FixedKLController)
    ctrl.update(current_kl=100.0, n_steps=1000)
    assert ctrl.value == 0.05
    with pytest.raises(ValueError, match="algorithm.kl_ctrl.type 'pid'"):
        make_kl_controller(type="pid", kl_coef=0.1)
    with pytest.raises(ValueError, match="algorithm.kl_ctrl.horizon must be finite and > 0"):
        make_kl_controller(type="adaptive", kl_coef=0.1, target_kl=0.1, horizon=0)
    with pytest.raises(ValueError, match="target_kl"):
        make_kl_controller(type="adaptive", kl_coef=0.1, target_kl=-1.0, horizon=10)


def test_apply_kl_penalty_hand_worked():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    old = torch.full((2, 3), -1.0)
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -1.0, -9.0]])
    ctrl = FixedKLController(kl_coef=0.1)
    rewards, metrics = apply_kl_penalty(
        token_level_scores=scores, old_log_prob=old, ref_log_prob=ref, response_mask=mask, kl_ctrl=ctrl, kl_penalty="kl"
    )
    # k1 = [[0.5, 0, -0.5], [1, 0, (masked) 0]]; rewards = scores - 0.1 * k1
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.0, 1.05], [-0.1, 2.0, 0.0]]), **TOL)
    # batch KL = mean over sequences of each sequence's token mean: (0/3 + 1/2) / 2
    assert metrics["reward_kl_penalty"] == pytest.approx(0.25, abs=1e-7)
    assert metrics["reward_kl_penalty_coeff"] == 0.1


def test_apply_kl_penalty_updates_adaptive_controller_with_batch_size():
    ctrl = AdaptiveKLController(init_kl_coef=0.2, target_kl=0.1, horizon=10)
    lp = torch.zeros(4, 2)
    apply_kl_penalty(
        token_level_scores=torch.zeros(4, 2), old_log_prob=lp, ref_log_prob=lp - 1.0, response_mask=torch.ones(4, 2),
        kl_ctrl=ctrl, kl_penalty="kl",
    )
    # KL 1.0 vs target 0.1: error clipped to 0.2, n_steps = B = 4: x(1 + 0.2*4/10)
    assert ctrl.value == pytest.approx(0.2 * 1.08, abs=1e-12)


def test_kl_loss_aggregates_under_the_mask():
    lp = torch.tensor([[-1.0, -1.0, float("nan")]], requires_grad=True)
    ref = torch.tensor([[-1.5, -0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss = compute_kl_loss(log_prob=lp, ref_log_prob=ref, response_mask=mask, kl_loss_type="mse")
    torch.testing.assert_close(loss, torch.tensor(0.125), **TOL)
    loss.backward()
    # d/dlp mean(0.5 x^2) = x / 2 on the two valid tokens; the NaN padding gets 0, not NaN
    torch.testing.assert_close(lp.grad, torch.tensor([[0.25, -0.25, 0.0]]), **TOL)
    full = compute_kl_loss(
        log_prob=torch.randn(2, 3, 5), ref_log_prob=torch.randn(2, 3, 5), response_mask=torch.ones(2, 3),
        kl_loss_type="full",
    )
    assert torch.isfinite(full) and full > 0
    with pytest.raises(ValueError, match="leading \\[B, T\\] dims"):
        compute_kl_loss(log_prob=torch.zeros(2, 3), ref_log_prob=torch.zeros(2, 3), response_mask=torch.ones(3, 2))


# ----------------------------------------------------------------------------------------------
# edges of the range and both sides of each guard


@pytest.mark.parametrize("kind", ["k3", "k3+"])
def test_k3_at_extreme_log_ratios_is_clamped_with_finite_gradients(kind):
    # log_prob - ref = +-100: exp(100) overflows float32 unless log r is clamped first; the
    # clamped value is 10 on both sides and the gradient finite (0 for k3, the k2 one for k3+).
    log_prob = torch.tensor([[100.0, -100.0, 0.5]], requires_grad=True)
    ref = torch.tensor([[0.0, 0.0, 0.0]])
    value = kl_penalty(log_prob, ref, kind)
    torch.testing.assert_close(value[0, :2], torch.tensor([10.0, 10.0]), rtol=0, atol=0)
    x = 0.5  # inside both clamps: r - log r - 1 with log r = -0.5
    torch.testing.assert_close(value[0, 2], torch.tensor(math.exp(-x) + x - 1.0), **TOL)
    value.sum().backward()
    assert torch.isfinite(log_prob.grad).all(), log_prob.grad
    if kind == "k3":
        assert torch.equal(log_prob.grad[0, :2], torch.zeros(2))
    else:
        torch.testing.assert_close(log_prob.grad, torch.tensor([[100.0, -100.0, 0.5]]), **TOL)


def test_full_kl_with_vocabulary_entries_the_policy_never_picks():
    # The policy masks entry 2 out (-inf logit, p = 0): it contributes exactly 0, not 0 * -inf.
    policy = torch.tensor([[[0.0, math.log(3.0), float("-inf")]]])
    reference = torch.tensor([[[0.0, 0.0, 0.0]]])
    p = torch.tensor([0.25, 0.75])
    expected = float((p * (p.log() - math.log(1 / 3))).sum())
    actual = kl_penalty(policy, reference, "full")
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual, torch.tensor([[expected]]), **TOL)


def test_adaptive_controller_clips_the_error_on_both_sides():
    ctrl = make_kl_controller(type="adaptive", kl_coef=0.1, target_kl=0.5, horizon=100)
    ctrl.update(current_kl=0.0, n_steps=10)  # error 0/0.5 - 1 = -1, clipped to -0.2 -> x(1 - 0.02)
    assert ctrl.value == pytest.approx(0.1 * 0.98, abs=1e-12)
    ctrl.update(current_kl=50.0, n_steps=10)  # error 99, clipped to +0.2 -> x(1 + 0.02)
    assert ctrl.value == pytest.approx(0.1 * 0.98 * 1.02, abs=1e-12)
    ctrl.update(current_kl=0.6, n_steps=10)  # error 0.2 exactly: the bound itself passes
    assert ctrl.value == pytest.approx(0.1 * 0.98 * 1.02 * 1.02, abs=1e-12)
