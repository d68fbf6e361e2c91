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
