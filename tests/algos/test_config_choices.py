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
