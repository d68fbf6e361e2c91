"""The estimators and losses ported from the reference verl 0.9.1 equal its definitions on fixed inputs.

The expected numbers were computed once with the reference's own functions
(``verl/trainer/ppo/core_algos.py`` of the ``verl==0.9.1`` wheel; the bypass loss through its
``rollout_corr_helper.py``) on exactly these inputs, and are stored here; the reference is not
imported. Losses are compared in float64 on value, gradient with respect to ``log_prob`` and
metrics; estimators in float32 (the reference's own precision).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl.algos import compute_advantage, compute_policy_loss

# float64 inputs. The reference divides by (length + 1e-8) where we divide by the length (clamped
# at 1): relative differences of ~1e-8, hence rtol 1e-7; atol 1e-9 for the exact zeros.
LOSS_TOL = dict(rtol=1e-7, atol=1e-9)
# The reference computes the estimators in float32 and we accumulate in float64 and round once:
# they differ by float32 rounding of numbers of order 1 (seen: 1.2e-7).
ADV_TOL = dict(rtol=0, atol=3e-7)

OLD = torch.tensor(
    [[-1.2, -0.7, -2.0, -0.9], [-0.5, -1.5, -0.9, -3.0], [-0.8, -0.6, -1.1, -0.6]], dtype=torch.float64
)
DELTA = torch.tensor(
    [[0.3, -0.25, 0.05, 0.6], [-0.4, 0.1, 0.35, -0.05], [0.15, -0.5, 0.2, 0.02]], dtype=torch.float64
)
ADV = torch.tensor(
    [[1.0, 1.0, 1.0, 1.0], [-0.5, -0.5, -0.5, -0.5], [2.0, -1.0, 0.5, -1.5]], dtype=torch.float64
)
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float64)

_RC = dict(rollout_is="token", rollout_is_threshold=1.3, rollout_rs="token_k1", rollout_rs_threshold="0.7_1.5")

# name: (loss_mode, loss_agg_mode, hyper-parameters (reference key names), expected loss, grad, metrics)
LOSS_CASES = {
    "sapo": ("sapo", "seq-mean-token-mean", {}, -0.8306705116,
             [[-0.1454867771, -0.08548349206, -0.1167311689, 0.0], [0.02710972354, 0.04590868557, 0.0563556429, 0.03960858646], [-0.3847533723, 0.096894633, 0.0, 0.0]],
             {"pg_clipfrac": 0.0, "ppo_kl": 0.02777777775, "pg_clipfrac_lower": 0.0}),
    "sapo_tau": ("sapo", "seq-mean-token-mean", dict(tau_pos=2.0, tau_neg=3.0), -0.5706093932,
                 [[-0.1330264434, -0.08243379481, -0.1165013806, 0.0], [0.02207649885, 0.04492151785, 0.04077764811, 0.03942319831], [-0.3773096463, 0.07268816447, 0.0, 0.0]],
                 {"pg_clipfrac": 0.0, "ppo_kl": 0.02777777775, "pg_clipfrac_lower": 0.0}),
    "geo_mean": ("geo_mean", "seq-mean-token-mean", {}, -0.3206731345,
                 [[0.0, -0.1111111104, -0.1111111104, 0.0], [0.0, 0.04380296212, 0.04380296212, 0.04380296212], [-0.0812758252, 0.0, 0.0, 0.0]],
                 {"pg_clipfrac": 0.222222222, "ppo_kl": 0.02777777775, "pg_clipfrac_lower": 0.333333333}),
    "geo_mean_asym": ("geo_mean", "seq-mean-token-mean", dict(clip_ratio=0.4, clip_ratio_high=0.1), -0.2991900283,
                      [[0.0, -0.1074684549, -0.1074684549, 0.0], [0.04166666646, 0.04166666646, 0.04166666646, 0.04166666646], [0.0, 0.0, 0.0, 0.0]],
                      {"pg_clipfrac": 0.222222222, "ppo_kl": 0.02777777775, "pg_clipfrac_lower": 0.333333333}),
    # clip_cov_ratio 1: every eligible token is chosen, so the random draw does not matter
    "clip_cov": ("clip_cov", "token-mean", dict(clip_cov_ratio=1.0, clip_cov_lb=0.05, clip_cov_ub=5.0), -0.03797081356,
                 [[0.0, 0.0, -0.1168078996, 0.0], [0.0, 0.0, 0.07883708603, 0.0], [0.0, 0.0, 0.0, 0.0]],
                 {"pg_clipfrac": 0.444444444, "ppo_kl": 0.02777777775}),
    "kl_cov": ("kl_cov", "token-mean", dict(kl_cov_ratio=0.3, ppo_kl_coef=0.5), -0.3026860605,
               [[-0.149984312, -0.08653342034, -0.1168078996, 0.0], [0.03724000256, 0.06139838434, 0.07883708603, -0.002709476417], [-0.2026298317, 0.06739229552, 0.0, 0.0]],
               {"ppo_kl": 0.2388888886}),
    "dppo_tv": ("dppo_tv", "token-mean", dict(clip_ratio_low=0.1, clip_ratio_c=1.2), 0.3139977092,
                [[-0.1333333333, -0.08653342034, -0.1168078996, 0.0], [0.0, 0.06139838434, 0.06666666667, 0.05284607914], [-0.2581853873, 0.0, 0.0, 0.0]],
                {"pg_clipfrac": 0.222222222, "ppo_kl": 0.02777777775, "pg_clipfrac_lower": 0.222222222}),
    "dppo_kl": ("dppo_kl", "token-mean", dict(clip_ratio=0.01, clip_ratio_c=1.2), 0.02617720743,
                [[0.0, -0.08653342034, -0.1168078996, 0.0], [0.0, 0.06139838434, 0.06666666667, 0.05284607914], [0.0, 0.0, 0.0, 0.0]],
                {"pg_clipfrac": 0.444444444, "ppo_kl": 0.02777777775, "pg_clipfrac_lower": 0.111111111}),
    "dro": ("dro", "token-mean", dict(dro_beta=0.3), 0.1287083333,
            [[-0.1011111111, -0.1194444444, -0.1094444444, 0.0], [0.04222222222, 0.05888888889, 0.06722222222, 0.05388888889], [-0.2172222222, 0.09444444444, 0.0, 0.0]],
            {"ppo_kl": 0.02777777775}),
    "dro_token_sum": ("dro", "token-sum", dict(dro_beta=0.3), 1.158375,
                      [[-0.91, -1.075, -0.985, 0.0], [0.38, 0.53, 0.605, 0.485], [-1.955, 0.85, 0.0, 0.0]],
                      {"ppo_kl": 0.02777777775}),
    "bypass_ppo_clip": ("bypass_mode", "token-mean", dict(loss_type="ppo_clip", **_RC), -0.3573340466,
                        [[0.0, -0.08653342034, -0.1168078996, 0.0], [0.0, 0.06139838434, 0.07883708603, 0.05284607914], [-0.2581853873, 0.0, 0.0, 0.0]],
                        {"pg_clipfrac": 0.2499999997, "ppo_kl": -0.03124999996, "pg_clipfrac_lower": 0.0,
                         "rollout_corr/rollout_is_mean": 0.991684129, "rollout_corr/rollout_rs_masked_fraction": 0.111111111,
                         "rollout_corr/kl": 0.02777777775, "rollout_corr/k3_kl": 0.03823150292}),
    "bypass_reinforce": ("bypass_mode", "token-mean", dict(loss_type="reinforce", **_RC), 0.2874261513,
                         [[-0.1444444444, -0.08653342034, -0.1168078996, 0.0], [0.03724000256, 0.06139838434, 0.07222222222, 0.05284607914], [-0.2581853873, 0.0, 0.0, 0.0]],
                         {"ppo_kl": -0.03124999996, "rollout_corr/rollout_is_mean": 0.991684129,
                          "rollout_corr/rollout_rs_masked_fraction": 0.111111111, "rollout_corr/kl": 0.02777777775,
                          "rollout_corr/k3_kl": 0.03823150292}),
    "bypass_reinforce_seq": ("bypass_mode", "seq-mean-token-sum",
                             dict(loss_type="reinforce", rollout_is="sequence", rollout_is_threshold="0.5_2.0",
                                  rollout_rs="seq_mean_k3,seq_max_k2", rollout_rs_threshold="0.045,0.1"),
                             0.4165498296,
                             [[-0.368390306, -0.368390306, -0.368390306, 0.0], [0.1666666667, 0.1666666667, 0.1666666667, 0.1666666667], [0.0, 0.0, 0.0, 0.0]],
                             {"ppo_kl": -0.01428571427, "rollout_corr/rollout_is_mean": 0.9694321027,
                              "rollout_corr/rollout_rs_masked_fraction": 0.222222222, "rollout_corr/kl": 0.02777777775,
                              "rollout_corr/k3_kl": 0.03823150292}),
}


@pytest.mark.parametrize("case", sorted(LOSS_CASES))
def test_policy_loss_equals_reference(case):
    name, mode, hyper, loss_ref, grad_ref, metrics_ref = LOSS_CASES[case]
    log_prob = (OLD + DELTA).requires_grad_()
    actual, metrics = compute_policy_loss(
        name, old_log_prob=OLD, log_prob=log_prob, advantages=ADV, response_mask=MASK, loss_agg_mode=mode, **hyper
    )
    actual.backward()
    torch.testing.assert_close(actual, torch.tensor(loss_ref, dtype=torch.float64), **LOSS_TOL)
    torch.testing.assert_close(log_prob.grad, torch.tensor(grad_ref, dtype=torch.float64), **LOSS_TOL)
    for key, expected in metrics_ref.items():
        torch.testing.assert_close(metrics[key].double(), torch.tensor(expected, dtype=torch.float64), **LOSS_TOL)


# estimators: 3 groups (a: 3 responses, b: 2, c: 1) of 4-token responses
R = torch.tensor([[0, 0, 1, 0], [0, 0.5, 0, 0], [0, 0, 0, 0], [0, 0, 0, 2], [0, 1, 0, 0], [0.3, 0, 0, 0]])
M = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]]).float()
INDEX = np.array(["a", "a", "a", "b", "b", "c"], dtype=object)
OLDP = torch.tensor([[-0.2, -1.0, -0.5, -3.0], [-0.7, -0.1, -2.0, -1.0], [-1.5, -0.3, -0.9, -0.4],
                     [-0.6, -0.6, -1.2, -0.05], [-0.3, -2.2, -1.0, -1.0], [-0.9, -1.0, -1.0, -1.0]])
SPS = torch.tensor([[0.6, 0.3, 0.45, 0.2], [0.5, 0.8, 0.3, 0.3], [0.25, 0.55, 0.4, 0.62],
                    [0.5, 0.45, 0.3, 0.9], [0.7, 0.2, 0.3, 0.3], [0.4, 0.3, 0.3, 0.3]])
ISW = torch.tensor([[1.0, 0.9, 1.1, 1.0], [1.2, 1.0, 1.0, 1.0], [0.8, 1.0, 1.05, 0.95],
                    [1.0, 1.0, 1.0, 1.3], [0.9, 1.1, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
# multi-turn masks (holes where a tool's output sits) and rewards on the last valid token
MT = torch.tensor([[1, 0, 1, 1], [1, 1, 0, 0], [0, 1, 1, 1], [1, 1, 0, 1], [1, 0, 0, 1], [1, 0, 0, 0]]).float()
RT = torch.tensor([[0, 0, 0, 1], [0, 0.5, 0, 0], [0, 0, 0, 0], [0, 0, 0, 2], [0, 0, 0, 1], [0.3, 0, 0, 0]])
OTB = dict(index=INDEX, old_log_probs=OLDP, sum_pi_squared=SPS)

ADV_CASES = {
    "otb": ("optimal_token_baseline", dict(token_level_rewards=R, response_mask=M, **OTB),
            [[0.830373168, 0.5910645723, 0.6563978791, 0.0], [0.330373168, 0.09106454253, 0.0, 0.0],
             [-0.1696268171, -0.4089354575, -0.3436021209, 0.0], [0.3517793417, 0.6132465601, 2.0, 2.0],
             [-0.6482206583, -0.3867534399, 0.0, 0.0], [0.3000000119, 0.0, 0.0, 0.0]],
            [[1.0, 1.0, 1.0, 0.0], [0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0],
             [1.0, 1.0, 0.0, 0.0], [0.3000000119, 0.0, 0.0, 0.0]]),
    "otb_is_no_tail": ("optimal_token_baseline",
                       dict(token_level_rewards=R, response_mask=M, rollout_is_weights=ISW, handle_zero_tail=False, **OTB),
                       [[0.7286503315, 0.5473684072, 0.6351989508, 0.0], [0.2286503017, 0.04736843705, 0.0, 0.0],
                        [-0.2713496983, -0.4526315629, -0.3648010194, 0.0], [0.3053501844, 0.6432243586, 0.0, 0.0],
                        [-0.6946498156, -0.3567756414, 0.0, 0.0], [0.3000000119, 0.0, 0.0, 0.0]], None),
    "tir": ("tir_optimal_token_baseline", dict(token_level_rewards=RT, response_mask=MT, **OTB),
            [[0.5983996391, 0.0, 0.6685634851, 0.4182544351], [0.09839960933, 0.1685635149, 0.0, 0.0],
             [0.0, -0.4016003907, -0.3314364851, -0.5817455649], [0.3517793417, 0.5090581179, 0.0, 2.0],
             [-0.6482206583, 0.0, 0.0, -0.4909418821], [0.3000000119, 0.0, 0.0, 0.0]],
            [[1.0, 0.0, 1.0, 1.0], [0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [2.0, 2.0, 0.0, 2.0],
             [1.0, 0.0, 0.0, 1.0], [0.3000000119, 0.0, 0.0, 0.0]]),
    "tir_is_no_tail": ("tir_optimal_token_baseline",
                       dict(token_level_rewards=RT, response_mask=MT, rollout_is_weights=ISW, handle_zero_tail=False, **OTB),
                       [[0.5695543885, 0.0, 0.6383402348, 0.4175369143], [0.06955438852, 0.138340205, 0.0, 0.0],
                        [0.0, -0.4304456115, -0.361659795, -0.5824630857], [0.3053501844, 0.4954414368, 0.0, 0.0],
                        [-0.6946498156, 0.0, 0.0, -0.5045585632], [0.3000000119, 0.0, 0.0, 0.0]], None),
    "gdpo_one_reward": ("gdpo", dict(token_level_rewards=torch.tensor(
                            [[0, 0, 1, 0], [0, 0, 0, 0], [0, 0, 0.5, 0], [0, 0, 0, 3], [0, 1, 0, 0], [0, 0, 0, 0]]),
                            response_mask=M, index=INDEX),
                        [[1.190104365, 1.190104365, 1.190104365, 0.0], [-1.613071203, -1.613071203, 0.0, 0.0],
                         [-0.2114834189] * 4, [0.7795901299] * 4, [-1.202556968, -1.202556968, 0.0, 0.0],
                         [-0.2114834189, 0.0, 0.0, 0.0]], None),
    # the reference reads the two components from the batch (algorithm.gdpo_reward_keys=[fmt, acc],
    # gdpo_reward_weights=[1.0, 0.5])
    "gdpo_two_rewards": ("gdpo", dict(token_level_rewards=torch.zeros(6, 4), response_mask=M, index=INDEX,
                                      reward_components={"fmt": torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0]),
                                                         "acc": torch.tensor([0.0, 0.0, 1.0, 5.0, 1.0, 0.0])},
                                      gdpo_reward_weights=[1.0, 0.5]),
                         [[-0.06776596606] * 3 + [0.0], [-1.774100304, -1.774100304, 0.0, 0.0], [0.7854012251] * 4,
                          [0.6927578449] * 4, [-1.397067904, -1.397067904, 0.0, 0.0], [0.6329984069, 0.0, 0.0, 0.0]],
                         None),
}


@pytest.mark.parametrize("case", sorted(ADV_CASES))
def test_estimator_equals_reference(case):
    name, inputs, adv_ref, ret_ref = ADV_CASES[case]
    advantages, returns = compute_advantage(name, **inputs)
    torch.testing.assert_close(advantages, torch.tensor(adv_ref), **ADV_TOL)
    if ret_ref is not None:
        torch.testing.assert_close(returns, torch.tensor(ret_ref), **ADV_TOL)
