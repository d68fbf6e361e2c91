"""The token-budget keys (``use_dynamic_bsz``, ``*_max_token_len_per_gpu``): links, validation, help."""

from __future__ import annotations

import pytest

from verl.config import ConfigError, PPOConfig, load_config, parse_cli

ACTOR = "actor_rollout_ref.actor"
SHORT = ("data.max_prompt_length=64", "data.max_response_length=64")  # longest sequence: 128 tokens


def _load(*overrides: str):
    return load_config(PPOConfig, overrides=[*SHORT, *overrides])


def test_the_actors_budget_is_followed_by_every_role_unless_set():
    cfg = _load(f"{ACTOR}.use_dynamic_bsz=true", f"{ACTOR}.ppo_max_token_len_per_gpu=512",
                "critic.forward_max_token_len_per_gpu=1024")
    arr = cfg.actor_rollout_ref
    assert (arr.rollout.log_prob_use_dynamic_bsz, arr.rollout.log_prob_max_token_len_per_gpu) == (True, 512)
    assert (arr.ref.log_prob_use_dynamic_bsz, arr.ref.log_prob_max_token_len_per_gpu) == (True, 512)
    assert (cfg.critic.use_dynamic_bsz, cfg.critic.ppo_max_token_len_per_gpu) == (True, 512)
    assert cfg.critic.forward_max_token_len_per_gpu == 1024  # set: not followed
    # the critic's forward follows the critic's update budget
    cfg = _load(f"{ACTOR}.use_dynamic_bsz=true", f"{ACTOR}.ppo_max_token_len_per_gpu=512",
                "critic.ppo_max_token_len_per_gpu=2048")
    assert cfg.critic.forward_max_token_len_per_gpu == 2048
    # off by default, with no budget
    cfg = _load()
    assert not cfg.actor_rollout_ref.actor.use_dynamic_bsz and cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu is None


def test_dynamic_bsz_without_a_budget_is_refused_naming_the_key():
    with pytest.raises(ConfigError) as info:
        _load(f"{ACTOR}.use_dynamic_bsz=true", "algorithm.adv_estimator=grpo")
    msg = str(info.value)
    assert f"{ACTOR}.use_dynamic_bsz=true needs {ACTOR}.ppo_max_token_len_per_gpu" in msg
    # the rollout's log-prob pass follows the flag, so it lacks a budget too
    assert ("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true needs "
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu") in msg
    assert "= 128 tokens" in msg


def test_a_budget_below_the_longest_sequence_is_refused_naming_the_key_and_the_fix():
    with pytest.raises(ConfigError, match=(
        r"critic.forward_max_token_len_per_gpu=100 is smaller than the longest sequence \(data.max_prompt_length=64 "
        r"\+ actor_rollout_ref.rollout.response_length=64 = 128 tokens\).*raise critic.forward_max_token_len_per_gpu "
        r"to at least 128"
    )):
        _load(f"{ACTOR}.use_dynamic_bsz=true", f"{ACTOR}.ppo_max_token_len_per_gpu=128",
              "critic.forward_max_token_len_per_gpu=100", "algorithm.adv_estimator=gae")
    # the critic's keys are not checked when no critic is trained, nor a budget that is off
    _load(f"{ACTOR}.use_dynamic_bsz=true", f"{ACTOR}.ppo_max_token_len_per_gpu=128",
          "critic.forward_max_token_len_per_gpu=100", "algorithm.adv_estimator=grpo")
    _load(f"{ACTOR}.ppo_max_token_len_per_gpu=10")


def test_a_token_budget_lifts_the_micro_batch_divisibility_rule():
    rows = ("data.train_batch_size=8", f"{ACTOR}.ppo_mini_batch_size=8", f"{ACTOR}.ppo_micro_batch_size_per_gpu=3",
            "algorithm.adv_estimator=grpo")
    with pytest.raises(ConfigError, match=f"{ACTOR}.ppo_micro_batch_size_per_gpu=3 does not divide"):
        _load(*rows)
    _load(*rows, f"{ACTOR}.use_dynamic_bsz=true", f"{ACTOR}.ppo_max_token_len_per_gpu=256")


def test_help_lists_each_key_with_its_link(capsys):
    with pytest.raises(SystemExit):
        parse_cli(PPOConfig, ["-h"], prog="p", default_config_file=None)
    out = capsys.readouterr().out
    for line in (
        f"  {ACTOR}.use_dynamic_bsz: bool = false",
        f"  {ACTOR}.ppo_max_token_len_per_gpu: int | None = null  [>= 1]",
        "  actor_rollout_ref.rollout.log_prob_use_dynamic_bsz: bool = false  [follows actor_rollout_ref.actor.use_dynamic_bsz]",
        "  actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu: int | None = null  [>= 1; follows "
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu]",
        "  actor_rollout_ref.ref.log_prob_use_dynamic_bsz: bool = false  [follows actor_rollout_ref.actor.use_dynamic_bsz]",
        "  actor_rollout_ref.ref.log_prob_max_token_len_per_gpu: int | None = null  [>= 1; follows "
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu]",
        "  critic.use_dynamic_bsz: bool = false  [follows actor_rollout_ref.actor.use_dynamic_bsz]",
        "  critic.ppo_max_token_len_per_gpu: int | None = null  [>= 1; follows actor_rollout_ref.actor.ppo_max_token_len_per_gpu]",
        "  critic.forward_max_token_len_per_gpu: int | None = null  [>= 1; follows critic.ppo_max_token_len_per_gpu]",
    ):
        assert line in out.splitlines(), line
