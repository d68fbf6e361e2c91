"""DPO (sigmoid) and IPO preference losses."""

from __future__ import annotations

import math

import pytest
import torch

from verl.algos import compute_preference_loss, get_preference_loss, list_preference_losses, sequence_log_prob

TOL = dict(rtol=0, atol=1e-6)  # float32 log-sigmoid of O(1) numbers

# one pair: policy (chosen -1, rejected -2), reference (-1.5, -1.5) -> margin h = 1
PAIR = dict(
    policy_chosen_logps=torch.tensor([-1.0]),
    policy_rejected_logps=torch.tensor([-2.0]),
    reference_chosen_logps=torch.tensor([-1.5]),
    reference_rejected_logps=torch.tensor([-1.5]),
)


def test_names():
    assert list_preference_losses() == ["dpo", "ipo", "sigmoid"]
    with pytest.raises(ValueError, match="unknown preference loss 'kto'.*registered"):
        get_preference_loss("kto")


def test_dpo_hand_worked():
    loss, metrics = compute_preference_loss("sigmoid", **PAIR, beta=0.1)
    # -log sigmoid(0.1 * 1) = log(1 + e^-0.1)
    torch.testing.assert_close(loss, torch.tensor(math.log(1 + math.exp(-0.1))), **TOL)
    torch.testing.assert_close(metrics["rewards/chosen"], torch.tensor(0.05), **TOL)  # 0.1 * (-1 + 1.5)
    torch.testing.assert_close(metrics["rewards/rejected"], torch.tensor(-0.05), **TOL)
    torch.testing.assert_close(metrics["rewards/margin"], torch.tensor(0.1), **TOL)
    assert metrics["rewards/accuracy"] == 1.0


def test_dpo_label_smoothing_hand_worked():
    loss, _ = compute_preference_loss("dpo", **PAIR, beta=0.1, label_smoothing=0.2)
    expected = 0.8 * math.log(1 + math.exp(-0.1)) + 0.2 * math.log(1 + math.exp(0.1))
    torch.testing.assert_close(loss, torch.tensor(expected), **TOL)


def test_ipo_hand_worked():
    loss, _ = compute_preference_loss("ipo", **PAIR, beta=0.1)
    torch.testing.assert_close(loss, torch.tensor((1.0 - 1.0 / 0.2) ** 2), **TOL)  # (h - 1/(2 beta))^2


def test_policy_equal_to_reference_gives_log_two_and_gradients_flow():
    pc = torch.tensor([-3.0, -1.0], requires_grad=True)
    pr = torch.tensor([-2.0, -4.0], requires_grad=True)
    loss, _ = compute_preference_loss(
        "sigmoid", policy_chosen_logps=pc, policy_rejected_logps=pr,
        reference_chosen_logps=pc.detach(), reference_rejected_logps=pr.detach(), beta=0.5,
    )
    torch.testing.assert_close(loss, torch.tensor(math.log(2.0)), **TOL)
    loss.backward()
    # d/dpc of mean(-log sigmoid(beta h)) at h=0 is -beta * 0.5 / B
    torch.testing.assert_close(pc.grad, torch.tensor([-0.125, -0.125]), **TOL)
    torch.testing.assert_close(pr.grad, torch.tensor([0.125, 0.125]), **TOL)


def test_micro_batches_with_global_pair_count_sum_to_the_mean():
    g = torch.Generator().manual_seed(0)
    logps = {k: -torch.rand(6, generator=g) * 5 for k in PAIR}
    expected, _ = compute_preference_loss("sigmoid", **logps, beta=0.2)
    parts = [
        compute_preference_loss("sigmoid", **{k: v[s] for k, v in logps.items()}, beta=0.2, global_num_pairs=6)[0]
        for s in (slice(0, 2), slice(2, 6))
    ]
    torch.testing.assert_close(parts[0] + parts[1], expected, **TOL)


def test_sequence_log_prob():
    lp = torch.tensor([[-1.0, -2.0, float("-inf")]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    torch.testing.assert_close(sequence_log_prob(lp, mask), torch.tensor([-3.0]), **TOL)
    torch.testing.assert_close(sequence_log_prob(lp, mask, average=True), torch.tensor([-1.5]), **TOL)


def test_bad_inputs():
    with pytest.raises(ValueError, match="policy_rejected_logps must be sequence-level \\[B\\] = \\[1\\]"):
        compute_preference_loss("sigmoid", **{**PAIR, "policy_rejected_logps": torch.zeros(2)})
    with pytest.raises(ValueError, match="non-empty sequence-level"):
        compute_preference_loss("ipo", **{k: torch.zeros(0) for k in PAIR})
    with pytest.raises(ValueError, match="beta must be finite and > 0"):
        compute_preference_loss("ipo", **PAIR, beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        compute_preference_loss("sigmoid", **PAIR, label_smoothing=0.5)
    with pytest.raises(ValueError, match="needs \\['reference_rejected_logps'\\]"):
        compute_preference_loss("sigmoid", **{k: v for k, v in PAIR.items() if k != "reference_rejected_logps"})


def test_ipo_steps_on_mean_log_probs_and_its_surrogate_has_the_losss_gradient():
    """``preference_step``: IPO on per-response mean token log-probs (DPO on sums), hand-worked;
    and for both, the surrogate sum_i coef_i * sum_t logp_it(theta) the trainer back-propagates
    has the loss's own gradient with respect to theta."""
    from verl.algos import preference_step, uses_length_average

    assert uses_length_average("ipo") and not uses_length_average("sigmoid") and not uses_length_average("dpo")
    # One pair: chosen has 2 tokens, rejected 4 (of R=4 columns).
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    ref = torch.tensor([[-1.0, -1.0, 0.0, 0.0], [-1.0, -1.0, -1.0, -1.0]])
    pol = torch.tensor([[-0.5, -0.5, -9.0, -9.0], [-1.5, -1.5, -1.5, -1.5]])  # masked columns ignored
    loss, metrics, coef = preference_step("ipo", log_prob=pol, ref_log_prob=ref, response_mask=mask, beta=0.5)
    # means: policy chosen -0.5, rejected -1.5; reference -1, -1: h = 1 - 0 = 1; (1 - 1/(2*0.5))^2 = 0
    assert float(loss) == pytest.approx(0.0, abs=1e-12)
    assert float(metrics["rewards/margin"]) == pytest.approx(0.5 * 1.0)
    # Summed log-probs would give h = (-1 + 6) - (-2 + 4) = 3 and a loss of 4: not what IPO is.
    loss_sum, _ = compute_preference_loss(
        "ipo", policy_chosen_logps=torch.tensor([-1.0]), policy_rejected_logps=torch.tensor([-6.0]),
        reference_chosen_logps=torch.tensor([-2.0]), reference_rejected_logps=torch.tensor([-4.0]), beta=0.5,
    )
    assert float(loss_sum) == pytest.approx(4.0)

    torch.manual_seed(0)
    mask = (torch.rand(6, 5) > 0.3).float()
    mask[:, 0] = 1.0
    ref = -torch.rand(6, 5)
    feats = torch.randn(6, 5, 3, dtype=torch.float64)
    base = -torch.rand(6, 5, dtype=torch.float64)
    for loss_type in ("ipo", "sigmoid"):
        theta = torch.tensor([0.2, -0.1, 0.3], dtype=torch.float64, requires_grad=True)

        def token_logps(t):
            return base + feats @ t  # [6, 5]

        average = uses_length_average(loss_type)
        seq = sequence_log_prob(token_logps(theta), mask.double(), average=average)
        ref_seq = sequence_log_prob(ref.double(), mask.double(), average=average)
        true_loss, _ = compute_preference_loss(
            loss_type, policy_chosen_logps=seq[0::2], policy_rejected_logps=seq[1::2],
            reference_chosen_logps=ref_seq[0::2], reference_rejected_logps=ref_seq[1::2], beta=0.3,
        )
        (expected,) = torch.autograd.grad(true_loss, theta)
        loss, _, coef = preference_step(
            loss_type, log_prob=token_logps(theta.detach()), ref_log_prob=ref.double(), response_mask=mask.double(),
            beta=0.3,
        )
        assert float(loss) == pytest.approx(float(true_loss), rel=1e-12)
        surrogate = (coef * (token_logps(theta) * mask.double()).sum(-1)).sum()
        (actual,) = torch.autograd.grad(surrogate, theta)
        assert actual.tolist() == pytest.approx(expected.tolist(), rel=1e-10), loss_type
