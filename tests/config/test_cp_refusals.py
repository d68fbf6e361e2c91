"""Context parallelism in the config check: a token budget counts per CP rank (the budget times CP must
hold the longest sequence), and a sequence budget that is not a multiple of 2 x CP is accepted (the split
pads each row or packed sequence up to it, ``verl.models.forward``). The Mixture-of-Experts refusal,
which needs the model's config.json, is asserted in tests/trainer/test_context_parallel_rl.py."""

from __future__ import annotations

import pytest

from verl.config import ConfigError, PPOConfig, load_config

A = "actor_rollout_ref.actor"
CP2 = ["trainer.n_gpus_per_node=2", f"{A}.megatron.context_parallel_size=2",
       "actor_rollout_ref.ref.megatron.context_parallel_size=2", f"{A}.use_kl_loss=true",
       "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2"]  # no critic: its budgets follow the actor's
# 1000 + 501 = 1501 tokens: odd, so not a multiple of 2 x CP = 4.
LENGTHS = ["data.max_prompt_length=1000", "data.max_response_length=501", "actor_rollout_ref.rollout.prompt_length=1000",
           "actor_rollout_ref.rollout.response_length=501"]


def _load(*overrides: str) -> PPOConfig:
    return load_config(PPOConfig, overrides=[*CP2, *LENGTHS, *overrides], world_size=None)


def test_a_budget_holds_the_longest_sequence_over_the_cp_ranks():
    # 751 tokens per CP rank x 2 = 1502 >= 1501: accepted, as the engine packs up to CP x the budget.
    cfg = _load(f"{A}.use_dynamic_bsz=true", f"{A}.ppo_max_token_len_per_gpu=751")
    assert cfg.actor_rollout_ref.actor.megatron.context_parallel_size == 2
    with pytest.raises(ConfigError) as info:  # the log-prob budgets (which follow the actor's) set apart
        _load(f"{A}.use_dynamic_bsz=true", f"{A}.ppo_max_token_len_per_gpu=750",
              "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=751",
              "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=751")
    assert str(info.value) == (
        f"{A}.ppo_max_token_len_per_gpu=750 x {A}.megatron.context_parallel_size=2 = 1500 tokens per micro-batch "
        "(each context-parallel rank holds 1/2 of it) is smaller than the longest sequence (data.max_prompt_length=1000 "
        "+ actor_rollout_ref.rollout.response_length=501 = 1501 tokens); a micro-batch must hold one whole sequence: "
        f"raise {A}.ppo_max_token_len_per_gpu to at least 751"
    )


def test_each_budget_counts_its_own_roles_cp():
    # The reference at CP 1 (the actor at 2): its budget must hold the sequence alone.
    ref = "actor_rollout_ref.ref"
    with pytest.raises(ConfigError) as info:
        _load(f"{ref}.megatron.context_parallel_size=1", f"{ref}.log_prob_use_dynamic_bsz=true",
              f"{ref}.log_prob_max_token_len_per_gpu=751")
    assert str(info.value).startswith(f"{ref}.log_prob_max_token_len_per_gpu=751 is smaller than the longest sequence")
    assert "\n" not in str(info.value)
    # The old log-probabilities run on the actor: the rollout's budget counts the actor's CP.
    _load("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
          "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=751")


def test_a_sequence_budget_off_the_multiple_of_2cp_is_accepted():
    cfg = _load()
    assert (cfg.data.max_prompt_length + cfg.data.max_response_length) % 4 == 1
