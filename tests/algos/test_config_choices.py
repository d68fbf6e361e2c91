"""Algorithm names in a config are checked against the registries when the config loads."""

import pytest

import verl.algos  # noqa: F401  (registers the name checks)
from verl.config import ConfigError, PPOConfig, load_config


@pytest.mark.parametrize(
    "override, suggestion",
    [
        ("algorithm.adv_estimator=grop", "grpo"),
        ("actor_rollout_ref.actor.policy_loss.loss_mode=gpso", "gspo"),
        ("actor_rollout_ref.actor.kl_loss_type=low_var_kll", "low_var_kl"),
        ("algorithm.kl_penalty=kll", "kl"),
    ],
)
def test_unknown_algorithm_name_fails_at_load(override, suggestion):
    with pytest.raises(ConfigError, match=f"did you mean '{suggestion}'"):
        load_config(PPOConfig, overrides=[override])


def test_registered_names_load():
    cfg = load_config(
        PPOConfig,
        overrides=["algorithm.adv_estimator=rloo", "actor_rollout_ref.actor.policy_loss.loss_mode=cispo"],
    )
    assert cfg.algorithm.adv_estimator == "rloo"


def test_new_choices_and_their_hyperparameters_load():
    cfg = load_config(
        PPOConfig,
        overrides=[
            "algorithm.adv_estimator=gdpo",
            "actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode",
            "actor_rollout_ref.actor.loss_agg_mode=token-sum",
            "actor_rollout_ref.actor.tau_neg=2.0",
            "actor_rollout_ref.actor.policy_loss.rollout_correction.loss_type=reinforce",
            "actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_is=sequence",
            "actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_is_threshold=0.5_2.0",
            "actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_rs=token_k1,seq_max_k2",
            "actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_rs_threshold=2.0,0.5",
        ],
    )
    actor = cfg.actor_rollout_ref.actor
    assert actor.loss_agg_mode == "token-sum" and actor.tau_neg == 2.0
    rc = actor.policy_loss.rollout_correction
    assert (rc.loss_type, rc.rollout_is, rc.rollout_is_threshold) == ("reinforce", "sequence", "0.5_2.0")
    assert rc.rollout_rs_threshold == "2.0,0.5"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["actor_rollout_ref.actor.policy_loss.loss_mode=dro"], "loss_mode=dro needs actor_rollout_ref.actor.policy_loss.dro_beta"),
        (["actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov", "actor_rollout_ref.actor.policy_loss.clip_cov_lb=6"],
         "clip_cov_lb=6.0 must be below actor_rollout_ref.actor.policy_loss.clip_cov_ub=5.0"),
        (["actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode",
          "actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_rs=token_k2"], "needs rollout_rs_threshold"),
        (["actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode",
          "actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_is=token",
          "actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_is_threshold=3_1"], "0 < lower <= upper"),
        (["actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_is=tok"], "rollout_is"),
        (["actor_rollout_ref.actor.tau_pos=0"], "tau_pos"),
    ],
)
def test_bad_loss_hyperparameters_fail_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(PPOConfig, overrides=overrides)


def test_the_actor_hands_every_registered_loss_its_hyperparameters():
    import inspect

    from verl.algos import get_policy_loss, list_policy_losses
    from verl.roles.actor import loss_hyperparameters

    # what Actor's loss_fn passes itself, and what no actor path supplies (a direct call's extras)
    passed = {"old_log_prob", "log_prob", "advantages", "response_mask", "loss_agg_mode", "clip_ratio",
              "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "global_batch_info", "sample_weight"}
    direct_only = {"loss_scale_factor", "rollout_is_weights"}
    hyper = loss_hyperparameters(PPOConfig().actor_rollout_ref.actor)
    for name in list_policy_losses():
        params = set(inspect.signature(get_policy_loss(name)).parameters)
        assert params - passed - direct_only <= set(hyper), (name, params - passed - direct_only - set(hyper))
    # and every hyper-parameter the actor hands over is some loss's
    takes = set().union(*(inspect.signature(get_policy_loss(n)).parameters for n in list_policy_losses()))
    assert set(hyper) <= takes


def test_preflight_names_the_inputs_an_estimator_lacks():
    from verl.trainer.ppo_checks import missing_advantage_inputs

    assert missing_advantage_inputs("optimal_token_baseline") == ["old_log_probs", "sum_pi_squared"]
    assert missing_advantage_inputs("tir_optimal_token_baseline") == ["old_log_probs", "sum_pi_squared"]
    assert missing_advantage_inputs("gdpo") == [] and missing_advantage_inputs("gae") == []


@pytest.mark.parametrize("agg", ["token-mean", "token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("loss_mode", ["sapo", "geo_mean", "dppo_tv", "dppo_kl", "dro", "bypass_mode"])
def test_actor_loss_is_the_same_on_one_or_four_micro_batches(loss_mode, agg):
    """The actor's own loss_fn (config -> hyper-parameters -> registered loss -> aggregation), fed as
    the engine feeds it: one micro-batch of 8 rows, or 4 of 2 rows, over the same GlobalBatchInfo."""
    import torch

    from verl.algos import GlobalBatchInfo, compute_policy_loss
    from verl.config.schema import ActorConfig, PolicyLossConfig, RolloutCorrectionConfig
    from verl.roles.actor import Actor

    rc = RolloutCorrectionConfig(loss_type="reinforce", rollout_is="token", rollout_is_threshold="1.2",
                                 rollout_rs="token_k2", rollout_rs_threshold="0.02")
    cfg = ActorConfig(loss_agg_mode=agg, clip_ratio_c=1.3, tau_pos=1.5,
                      policy_loss=PolicyLossConfig(loss_mode=loss_mode, dro_beta=0.2, rollout_correction=rc))
    actor = Actor.__new__(Actor)  # the loss function reads only the config and the old-log-prob source
    actor.cfg, actor.old_log_prob = cfg, "recompute"
    g = torch.Generator().manual_seed(5)
    mask = (torch.rand(8, 5, generator=g) < 0.8).double()
    old = -torch.rand(8, 5, generator=g, dtype=torch.float64) * 2
    new = (old + 0.3 * torch.randn(8, 5, generator=g, dtype=torch.float64)).requires_grad_()
    micro = {"response_mask": mask, "old_log_probs": old, "advantages": torch.randn(8, 5, generator=g, dtype=torch.float64)}
    info = GlobalBatchInfo.from_masks(list(mask.split(2)))

    whole = actor._loss_builder(5)(info, 1)({"logprobs": new}, micro).loss
    (expected,) = torch.autograd.grad(whole, new)
    loss_fn = actor._loss_builder(5)(info, 4)
    parts = [loss_fn({"logprobs": new[i : i + 2]}, {k: v[i : i + 2] for k, v in micro.items()}).loss for i in range(0, 8, 2)]
    (actual,) = torch.autograd.grad(sum(parts), new)
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-12)  # float64: summation order only
    # and it is the registered loss with the config's hyper-parameters
    direct, _ = compute_policy_loss(
        loss_mode, old_log_prob=old, log_prob=new, advantages=micro["advantages"], response_mask=mask,
        loss_agg_mode=agg, clip_ratio_c=1.3, tau_pos=1.5, dro_beta=0.2, loss_type="reinforce", rollout_is="token",
        rollout_is_threshold="1.2", rollout_rs="token_k2", rollout_rs_threshold="0.02", global_batch_info=info,
    )
    torch.testing.assert_close(whole, direct, rtol=0, atol=0)
    assert float(whole.detach()) != 0.0
