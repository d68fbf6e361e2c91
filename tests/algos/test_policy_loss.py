"""Policy losses, value loss and entropy: hand-worked values, gradients, invariances, bad inputs.

Tolerance 1e-6 absolute unless stated: float32 logs/exps of numbers near 1 round at ~1e-7.
"""

from __future__ import annotations

import math

import pytest
import torch

from verl.algos import (
    compute_entropy_loss,
    compute_policy_loss,
    compute_value_loss,
    entropy_from_logits,
    get_policy_loss,
    list_policy_losses,
)

TOL = dict(rtol=0, atol=1e-6)


def test_registry_lists_every_policy_loss():
    assert set(list_policy_losses()) == {
        "vanilla", "gspo", "cispo", "gpg", "sapo", "geo_mean", "clip_cov", "kl_cov", "dppo_tv", "dppo_kl", "dro",
        "bypass_mode",
    }
    with pytest.raises(ValueError, match="actor.policy_loss.loss_mode.*registered: \\['bypass_mode', 'cispo'"):
        get_policy_loss("ppo")


def test_vanilla_hand_worked():
    # clip_ratio_low 0.2, clip_ratio_high 0.28 (clip-higher), dual clip c = 3.
    # token  ratio  A    L1=-A r  L2=-A clip(r)    max     dual (A<0)       loss  clipped  lower
    #   0     1.5  +1    -1.5     -1.28           -1.28    -                -1.28   yes
    #   1     0.5  +1    -0.5     -0.8            -0.5     -                -0.5    no
    #   2     0.5  -1     0.5      0.8             0.8     min(3, 0.8)       0.8    yes
    #   3     4.0  -1     4.0      1.28            4.0     min(3, 4) = 3     3.0    no      yes
    old = torch.full((1, 4), -2.0)
    ratio = torch.tensor([[1.5, 0.5, 0.5, 4.0]])
    log_prob = (old + ratio.log()).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, metrics = compute_policy_loss(
        "vanilla",
        old_log_prob=old,
        log_prob=log_prob,
        advantages=adv,
        response_mask=torch.ones(1, 4),
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
    )
    expected_loss = (-1.28 - 0.5 + 0.8 + 3.0) / 4
    torch.testing.assert_close(loss, torch.tensor(expected_loss), **TOL)
    torch.testing.assert_close(metrics["pg_clipfrac"], torch.tensor(0.5), **TOL)
    torch.testing.assert_close(metrics["pg_clipfrac_lower"], torch.tensor(0.25), **TOL)
    torch.testing.assert_close(metrics["ppo_kl"], torch.tensor(-math.log(1.5 * 0.5 * 0.5 * 4.0) / 4), **TOL)
    loss.backward()
    # only token 1 is unclipped: d(-A r)/d log_prob = -A r = -0.5, averaged over 4 tokens
    torch.testing.assert_close(log_prob.grad, torch.tensor([[0.0, -0.125, 0.0, 0.0]]), **TOL)


def test_vanilla_clip_ratio_defaults_to_clip_ratio():
    old = torch.zeros(1, 2)
    log_prob = torch.tensor([[math.log(1.5), math.log(0.5)]])
    adv = torch.tensor([[1.0, -1.0]])
    loss, _ = compute_policy_loss(
        "vanilla", old_log_prob=old, log_prob=log_prob, advantages=adv, response_mask=torch.ones(1, 2), clip_ratio=0.1
    )
    # token 0: max(-1.5, -1.1) = -1.1; token 1: max(0.5, 0.9) = 0.9
    torch.testing.assert_close(loss, torch.tensor((-1.1 + 0.9) / 2), **TOL)


@pytest.mark.parametrize("name", ["vanilla", "gspo", "cispo"])
def test_ratio_one_loss_is_minus_mean_advantage(name):
    """First PPO step: log_prob == old_log_prob, so the ratio is exactly 1 and nothing is clipped."""
    torch.manual_seed(0)
    old = -torch.rand(4, 6) * 3
    mask = torch.ones(4, 6)
    mask[1, 3:] = 0
    mask[3, 1:] = 0
    adv = torch.randn(4, 6)
    loss, metrics = compute_policy_loss(
        name,
        old_log_prob=old,
        log_prob=old.clone(),
        advantages=adv,
        response_mask=mask,
        loss_agg_mode="seq-mean-token-mean" if name == "gspo" else "token-mean",
    )
    if name == "gspo":
        expected = -((adv * mask).sum(-1) / mask.sum(-1)).mean()
    elif name == "cispo":
        expected = -(adv * old * mask).sum() / mask.sum()  # weight 1 times A log pi
    else:
        expected = -(adv * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, expected, **TOL)
    assert metrics["pg_clipfrac"] == 0 and metrics["pg_clipfrac_lower"] == 0 and metrics["ppo_kl"] == 0


def test_gspo_hand_worked():
    # row 0: log ratios [0.1, 0.3] -> s = exp(0.2) = 1.22140276, A=+1, clip 1.1: loss -1.1 per token (clipped)
    # row 1: valid log ratio -0.05 -> s = 0.95122942, unclipped: loss -0.95122942; its masked 9.0 is ignored
    old = torch.full((2, 2), -1.0)
    log_prob = (old + torch.tensor([[0.1, 0.3], [-0.05, 9.0]])).requires_grad_()
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, metrics = compute_policy_loss(
        "gspo",
        old_log_prob=old,
        log_prob=log_prob,
        advantages=torch.ones(2, 2),
        response_mask=mask,
        clip_ratio_low=0.1,
        clip_ratio_high=0.1,
    )
    torch.testing.assert_close(loss, torch.tensor((-1.1 - 0.951229424500714) / 2), **TOL)
    torch.testing.assert_close(metrics["pg_clipfrac"], torch.tensor(2 / 3), **TOL)
    torch.testing.assert_close(metrics["ppo_kl"], torch.tensor(-(0.1 + 0.3 - 0.05) / 3), **TOL)
    loss.backward()
    # per-token gradient of -A * s_i,t is -s (value of the sequence ratio), weighted 1/(2 seqs * 1 token)
    torch.testing.assert_close(log_prob.grad, torch.tensor([[0.0, 0.0], [-0.951229424500714 / 2, 0.0]]), **TOL)


def test_cispo_hand_worked_keeps_gradient_of_clipped_tokens():
    # ratios [1.5, 1.0, 0.5] clipped to [1.28, 1.0, 0.8]; loss_t = -w A log_prob
    old = torch.full((1, 3), -1.0)
    log_prob = (old + torch.tensor([[1.5, 1.0, 0.5]]).log()).requires_grad_()
    adv = torch.tensor([[1.0, 2.0, -1.0]])
    loss, metrics = compute_policy_loss(
        "cispo",
        old_log_prob=old,
        log_prob=log_prob,
        advantages=adv,
        response_mask=torch.ones(1, 3),
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
    )
    # -1.28*1*(-1+ln 1.5) = 0.76100466, -1*2*(-1) = 2, -0.8*(-1)*(-1+ln 0.5) = -1.35451774
    torch.testing.assert_close(loss, torch.tensor(0.46882897239119764), **TOL)
    torch.testing.assert_close(metrics["pg_clipfrac"], torch.tensor(2 / 3), **TOL)
    loss.backward()
    # gradient -w A / 3 on every token, clipped ones included (PPO would give 0 on tokens 0 and 2)
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-1.28 / 3, -2.0 / 3, 0.8 / 3]]), **TOL)


def test_gpg_hand_worked():
    log_prob = torch.tensor([[-0.5, -1.0, -7.0]])
    loss, metrics = compute_policy_loss(
        "gpg",
        old_log_prob=log_prob.clone(),
        log_prob=log_prob,
        advantages=torch.tensor([[1.0, -2.0, 5.0]]),
        response_mask=torch.tensor([[1.0, 1.0, 0.0]]),
    )
    torch.testing.assert_close(loss, torch.tensor((0.5 - 2.0) / 2), **TOL)  # mean of -A log_prob
    assert metrics["pg_clipfrac"] == 0


def test_padding_with_minus_inf_log_probs_does_not_poison_the_loss():
    old = torch.tensor([[-1.0, float("-inf")]])
    log_prob = torch.tensor([[-1.0, float("-inf")]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0]])
    for name in list_policy_losses():
        loss, metrics = compute_policy_loss(
            name, old_log_prob=old, log_prob=log_prob, advantages=torch.ones(1, 2), response_mask=mask,
            dro_beta=0.1,  # dro's has no default; the other losses do not take it
        )
        assert torch.isfinite(loss), name
        assert all(torch.isfinite(v) for v in metrics.values()), name
        (grad,) = torch.autograd.grad(loss, log_prob)
        assert torch.isfinite(grad).all() and grad[0, 1] == 0, name


def test_rollout_is_weights_scale_token_losses():
    old = torch.zeros(1, 2)
    adv = torch.tensor([[1.0, 2.0]])
    weights = torch.tensor([[0.5, 2.0]])
    loss, _ = compute_policy_loss(
        "vanilla", old_log_prob=old, log_prob=old.clone(), advantages=adv, response_mask=torch.ones(1, 2),
        rollout_is_weights=weights,
    )
    torch.testing.assert_close(loss, torch.tensor((-0.5 - 4.0) / 2), **TOL)


def test_policy_loss_bad_inputs():
    x = torch.zeros(2, 3)
    kwargs = dict(old_log_prob=x, log_prob=x, advantages=x, response_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="clip_ratio_c.*must be > 1.0"):
        compute_policy_loss("vanilla", **kwargs, clip_ratio_c=0.9)
    with pytest.raises(ValueError, match="actor.clip_ratio_low must be finite and >= 0"):
        compute_policy_loss("vanilla", **kwargs, clip_ratio_low=-0.1)
    with pytest.raises(ValueError, match="advantages has shape \\(2, 2\\)"):
        compute_policy_loss("vanilla", **{**kwargs, "advantages": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match="floating-point"):
        compute_policy_loss("cispo", **{**kwargs, "log_prob": torch.zeros(2, 3, dtype=torch.long)})
    with pytest.raises(ValueError, match="empty batch"):
        compute_policy_loss("gpg", old_log_prob=torch.zeros(0, 3), log_prob=torch.zeros(0, 3),
                            advantages=torch.zeros(0, 3), response_mask=torch.zeros(0, 3))
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'.*token-mean"):
        compute_policy_loss("vanilla", **kwargs, loss_agg_mode="mean")


# ----------------------------------------------------------------------------------------------
# value loss and entropy


def test_value_loss_hand_worked():
    # eps 0.2 around old values 0.5 -> clip to [0.3, 0.7]
    # tok0: pred 1.0, R 2: (1-2)^2 = 1, (0.7-2)^2 = 1.69 -> 1.69 (clipped term larger)
    # tok1: pred 0.0, R 0: 0, (0.3-0)^2 = 0.09 -> 0.09 (clipped term larger)
    # tok2: pred 3.0, R 0: 9, (0.7-0)^2 = 0.49 -> 9
    loss, clipfrac = compute_value_loss(
        vpreds=torch.tensor([[1.0, 0.0, 3.0]]),
        returns=torch.tensor([[2.0, 0.0, 0.0]]),
        values=torch.tensor([[0.5, 0.5, 0.5]]),
        response_mask=torch.ones(1, 3),
        cliprange_value=0.2,
    )
    torch.testing.assert_close(loss, torch.tensor(0.5 * (1.69 + 0.09 + 9.0) / 3), **TOL)
    torch.testing.assert_close(clipfrac, torch.tensor(2 / 3), **TOL)


def test_entropy_from_logits_hand_worked():
    logits = torch.tensor(
        [[[0.0, 0.0], [0.0, float("-inf")], [math.log(1.0), math.log(3.0)]]]
    )  # p = [.5,.5], [1, 0], [.25, .75]
    expected = torch.tensor([[math.log(2.0), 0.0, -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]])
    torch.testing.assert_close(entropy_from_logits(logits), expected, **TOL)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    torch.testing.assert_close(
        compute_entropy_loss(logits=logits, response_mask=mask), torch.tensor(math.log(2.0) / 2), **TOL
    )
    with pytest.raises(ValueError, match="\\[B, T, V\\]"):
        compute_entropy_loss(logits=logits[0], response_mask=mask)


# ----------------------------------------------------------------------------------------------
# edges of the range and both sides of each guard


@pytest.mark.parametrize("name", ["vanilla", "cispo", "gspo", "gpg"])
def test_wild_log_ratios_keep_loss_metrics_and_gradients_finite(name):
    # log_prob - old_log_prob = +-100 (a token the policy moved wildly, or a stale old log-prob):
    # exp() of it overflows float32 unless the log-ratio is bounded first. Row 0 mixes both
    # signs; rows 1 and 2 (+100, -50) are wild throughout, so GSPO's sequence ratio is too.
    old = torch.tensor([[-100.0, 0.0, -1.0, 0.0], [-100.0] * 4, [0.0] * 4])
    new = torch.tensor([[0.0, -100.0, -1.0, -0.5], [0.0] * 4, [-50.0] * 4], requires_grad=True)
    advantages = torch.tensor([[1.0, 1.0, -1.0, 0.5], [1.0, -1.0, 2.0, -0.5], [-1.0, 1.0, -2.0, 0.5]])
    loss, metrics = compute_policy_loss(
        name, old_log_prob=old, log_prob=new, advantages=advantages, response_mask=torch.ones(3, 4)
    )
    loss.backward()
    assert torch.isfinite(loss), loss
    assert all(torch.isfinite(v) for v in metrics.values()), metrics
    assert torch.isfinite(new.grad).all(), new.grad
    if name in ("vanilla", "cispo"):
        # ppo_kl comes from the bounded log-ratio, clamp(new - old, -20, 20), as in the reference.
        bounded = torch.clamp(new.detach() - old, -20.0, 20.0)
        torch.testing.assert_close(metrics["ppo_kl"], -bounded.mean(), **TOL)


def test_dual_clip_bound_must_exceed_one():
    x = torch.zeros(2, 3)
    kwargs = dict(old_log_prob=x, log_prob=x, advantages=-torch.ones(2, 3), response_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="clip_ratio_c.*must be > 1.0, got 1.0"):
        compute_policy_loss("vanilla", **kwargs, clip_ratio_c=1.0)
    loss, _ = compute_policy_loss("vanilla", **kwargs, clip_ratio_c=1.0 + 1e-6)  # just above: accepted
    torch.testing.assert_close(loss, torch.tensor(1.0), **TOL)  # ratio 1, A = -1


def test_value_loss_inside_the_clip_range_is_not_clipped():
    # Every prediction within V_old +- eps: both terms are equal, nothing counts as clipped,
    # and the loss is the plain 0.5 * mean squared error.
    vpreds = torch.tensor([[0.6, 0.4, 0.7]])
    returns = torch.tensor([[1.0, 0.0, 0.5]])
    loss, clipfrac = compute_value_loss(
        vpreds=vpreds, returns=returns, values=torch.full((1, 3), 0.5), response_mask=torch.ones(1, 3),
        cliprange_value=0.25,
    )
    torch.testing.assert_close(loss, torch.tensor(0.5 * (0.16 + 0.16 + 0.04) / 3), **TOL)
    assert clipfrac.item() == 0.0


def test_new_losses_refuse_bad_hyperparameters():
    x = torch.zeros(2, 3)
    kwargs = dict(old_log_prob=x, log_prob=x, advantages=x, response_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="dro needs actor_rollout_ref.actor.policy_loss.dro_beta"):
        compute_policy_loss("dro", **kwargs)
    with pytest.raises(ValueError, match="dro_beta must be finite and > 0"):
        compute_policy_loss("dro", **kwargs, dro_beta=0.0)
    with pytest.raises(ValueError, match="actor.tau_neg must be finite and > 0"):
        compute_policy_loss("sapo", **kwargs, tau_neg=-1.0)
    with pytest.raises(ValueError, match="clip_cov_ratio must be finite and > 0"):
        compute_policy_loss("clip_cov", **kwargs, clip_cov_ratio=0.0)
    with pytest.raises(ValueError, match="loss_type='ppo'; expected ppo_clip or reinforce"):
        compute_policy_loss("bypass_mode", **kwargs, loss_type="ppo")
    with pytest.raises(ValueError, match="rollout_is='seq'"):
        compute_policy_loss("bypass_mode", **kwargs, rollout_is="seq")
    with pytest.raises(ValueError, match="rollout_rs option 'token_k4' is unknown"):
        compute_policy_loss("bypass_mode", **kwargs, rollout_rs="token_k4", rollout_rs_threshold=2.0)
    with pytest.raises(ValueError, match="needs rollout_rs_threshold"):
        compute_policy_loss("bypass_mode", **kwargs, rollout_rs="token_k2")
    with pytest.raises(ValueError, match="gives 2 bounds for 1 rollout_rs options"):
        compute_policy_loss("bypass_mode", **kwargs, rollout_rs="token_k2", rollout_rs_threshold="0.1,0.2")
    with pytest.raises(ValueError, match="0 < lower <= upper"):
        compute_policy_loss("bypass_mode", **kwargs, rollout_is="token", rollout_is_threshold="2.0_0.5")


def test_clip_cov_drops_the_gradient_of_exactly_its_share_of_eligible_tokens():
    # 100 valid tokens, ratio 1 (nothing PPO-clipped); advantages and log-probs both +-1 around 0, so
    # every token's centred product is 1.5 * 1.5 = 2.25, inside (lb 1, ub 5): all are eligible.
    sign = torch.tensor([1.0, -1.0]).repeat(50).view(4, 25)
    log_prob = (sign * 1.5 - 3.0).requires_grad_()
    old = log_prob.detach().clone()
    adv = sign * 1.5
    torch.manual_seed(0)
    loss, metrics = compute_policy_loss(
        "clip_cov", old_log_prob=old, log_prob=log_prob, advantages=adv, response_mask=torch.ones(4, 25),
        clip_cov_ratio=0.05,
    )
    (grad,) = torch.autograd.grad(loss, log_prob)
    assert int((grad == 0).sum()) == 5  # int(0.05 * 100)
    torch.testing.assert_close(metrics["pg_clipfrac"], torch.tensor(0.05), **TOL)
    # the others keep the plain policy gradient -A / N
    torch.testing.assert_close(grad[grad != 0], (-adv / 100)[grad != 0], **TOL)


def test_kl_cov_penalises_the_largest_covariance_tokens():
    # covariance (A - mean A)(lp - mean lp) is largest at token 2; ratio 0.3 of 4 valid tokens -> 1 token
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    log_prob = torch.tensor([[-1.2, -0.9, -0.2, -1.5]], requires_grad=True)
    adv = torch.tensor([[0.0, 0.5, 2.0, -1.0]])
    loss, metrics = compute_policy_loss(
        "kl_cov", old_log_prob=old, log_prob=log_prob, advantages=adv, response_mask=torch.ones(1, 4),
        kl_cov_ratio=0.3, ppo_kl_coef=0.5,
    )
    ratio = torch.exp(log_prob.detach() - old)
    expected = (-adv * ratio).sum() + 0.5 * 0.8  # |log r| of token 2 is 0.8
    torch.testing.assert_close(loss, expected / 4, **TOL)
    torch.testing.assert_close(metrics["ppo_kl"], torch.tensor((0.2 + 0.1 + 0.8 + 0.5) / 4), **TOL)


def test_sapo_gate_has_the_policy_gradient_slope_at_ratio_one():
    # f(r) = sigmoid(tau (r - 1)) 4 / tau: f(1) = 2 / tau, f'(1) = 1 for any tau
    old = torch.full((1, 2), -1.0)
    log_prob = old.clone().requires_grad_()
    adv = torch.tensor([[1.0, -2.0]])
    loss, _ = compute_policy_loss(
        "sapo", old_log_prob=old, log_prob=log_prob, advantages=adv, response_mask=torch.ones(1, 2),
        tau_pos=2.0, tau_neg=5.0,
    )
    torch.testing.assert_close(loss, torch.tensor((-1.0 * 2 / 2.0 + 2.0 * 2 / 5.0) / 2), **TOL)
    (grad,) = torch.autograd.grad(loss, log_prob)
    torch.testing.assert_close(grad, -adv / 2, **TOL)
