"""Whole-config validation: layouts against the world size, batch divisibility, registry names."""

from __future__ import annotations

import re

import pytest

from verl.config import ConfigError, PPOConfig, SFTConfig, load_config, register_choices
from verl.config import validation


def _load(*overrides: str, world_size: int | None = None, root=PPOConfig):
    return load_config(root, overrides=list(overrides), world_size=world_size)


def test_non_dividing_layout_prints_every_degree_and_the_world_size():
    with pytest.raises(ConfigError) as info:
        _load(
            "trainer.n_gpus_per_node=8",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3",
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.context_parallel_size=1",
        )
    msg = str(info.value)
    assert "\n" not in msg  # one problem, one message
    for part in (
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3",
        "pipeline_model_parallel_size=2",
        "context_parallel_size=1",
        "= 6 does not divide the world size 8",
        "trainer.nnodes=1 x trainer.n_gpus_per_node=8",
    ):
        assert part in msg, (part, msg)


def test_launched_world_size_is_checked_against_the_layout_and_the_trainer_shape():
    cfg = _load("trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
                "algorithm.adv_estimator=grpo")  # no critic, whose dp would add a third problem
    cfg.validate(world_size=4)
    with pytest.raises(ConfigError) as info:
        cfg.validate(world_size=6)
    msg = str(info.value)
    assert "2 problems" in msg
    assert "the launched world size 6 differs from trainer.nnodes=1 x trainer.n_gpus_per_node=4 = 4" in msg
    assert "tensor_model_parallel_size=4 x pipeline_model_parallel_size=1 x context_parallel_size=1 = 4 " \
           "does not divide the world size 6 (launched)" in msg
    with pytest.raises(ConfigError, match="world_size must be >= 1"):
        cfg.validate(world_size=0)


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (["actor_rollout_ref.actor.ppo_mini_batch_size=2048"],
         r"actor_rollout_ref\.actor\.ppo_mini_batch_size=2048 is larger than data\.train_batch_size=1024"),
        (["actor_rollout_ref.actor.ppo_mini_batch_size=300"],
         r"data\.train_batch_size=1024 is not a multiple of actor_rollout_ref\.actor\.ppo_mini_batch_size=300"),
        (["trainer.n_gpus_per_node=3", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
          "critic.ppo_mini_batch_size=3", "critic.ppo_micro_batch_size_per_gpu=1"],
         r"actor_rollout_ref\.actor\.ppo_mini_batch_size=4 x actor_rollout_ref\.rollout\.n=1 = 4 sequences per "
         r"mini-batch do not split evenly over the data-parallel size 3 \(world 3 / \(tensor 1 x pipeline 1 x context 1\)\)"),
        (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"],
         r"ppo_micro_batch_size_per_gpu=3 does not divide the 256 sequences of a mini-batch on one rank"),
        (["critic.ppo_micro_batch_size_per_gpu=5"], r"critic\.ppo_micro_batch_size_per_gpu=5 does not divide"),
        (["actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2"],
         r"virtual_pipeline_model_parallel_size=2 needs pipeline_model_parallel_size > 1"),
        (["actor_rollout_ref.actor.megatron.sequence_parallel=true"],
         r"actor_rollout_ref\.actor\.megatron\.sequence_parallel=true needs tensor_model_parallel_size > 1"),
        (["trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.tensor_model_parallel_size=3"],
         r"rollout\.tensor_model_parallel_size=3 does not divide the world size 4"),
        (["actor_rollout_ref.rollout.max_num_batched_tokens=1000"],
         r"max_num_batched_tokens=1000 is smaller than prompt_length=512 \+ response_length=512"),
        (["data.max_prompt_length=600", "actor_rollout_ref.rollout.prompt_length=500"],
         r"rollout\.prompt_length=500 is shorter than data\.max_prompt_length=600"),
        (["actor_rollout_ref.actor.clip_ratio_low=1.0"], r"lower clip range 1\.0"),
        (["reward_model.enable=true"], r"reward_model\.enable=true needs reward_model\.model\.path"),
        (["algorithm.filter_groups.enable=true"], r"filter_groups\.enable=true needs algorithm\.filter_groups\.metric"),
        (["trainer.resume_mode=resume_path"], r"resume_mode=resume_path needs trainer\.resume_from_path"),
    ],
)
def test_batch_and_layout_rules(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        _load(*overrides)


def test_role_checks_only_for_roles_in_use():
    # the critic's layout is ignored unless a critic is trained
    grpo = ["algorithm.adv_estimator=grpo", "critic.megatron.tensor_model_parallel_size=3"]
    _load(*grpo)
    with pytest.raises(ConfigError, match=r"the critic layout does not fit the world: critic\.megatron"):
        _load(*grpo, "critic.enable=true")
    # the reference exists only with a KL term
    ref = ["actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=3"]
    _load(*ref)
    with pytest.raises(ConfigError, match=r"the reference layout .* actor_rollout_ref\.ref\.megatron"):
        _load(*ref, "algorithm.use_kl_in_reward=true")


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        _load("actor_rollout_ref.actor.megatron.sequence_parallel=true", "trainer.resume_mode=resume_path",
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3")
    msg = str(info.value)
    assert msg.startswith("3 problems in the config:")
    assert len(re.findall(r"\n  - ", msg)) == 3


def test_a_valid_multi_rank_layout():
    cfg = _load(
        "trainer.nnodes=2", "trainer.n_gpus_per_node=8",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.sequence_parallel=true",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
        "actor_rollout_ref.rollout.n=5",
        "data.train_batch_size=512",
        "actor_rollout_ref.actor.ppo_mini_batch_size=128",  # 640 sequences / dp 4 = 160 per rank
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "critic.ppo_micro_batch_size_per_gpu=10",  # critic dp 16: 640 / 16 = 40 per rank
        world_size=16,
    )
    assert cfg.actor_rollout_ref.ref.megatron.virtual_pipeline_model_parallel_size == 2


def test_sft_validation():
    load_config(SFTConfig, overrides=["trainer.n_gpus_per_node=2", "megatron.tensor_model_parallel_size=2"],
                world_size=2)
    with pytest.raises(ConfigError, match=r"megatron\.tensor_model_parallel_size=4 x pipeline_model_parallel_size=1 "
                                          r"x context_parallel_size=1 = 4 does not divide the world size 2"):
        load_config(SFTConfig, overrides=["trainer.n_gpus_per_node=2", "megatron.tensor_model_parallel_size=4"])
    with pytest.raises(ConfigError, match=r"data\.train_batch_size=10 is not a multiple of data\.micro_batch_size_per_gpu=4 "
                                          r"x data-parallel size 1"):
        load_config(SFTConfig, overrides=["data.train_batch_size=10"])


@pytest.fixture
def estimators(monkeypatch):
    monkeypatch.setattr(validation, "_CHOICES", {})
    names = ["gae", "grpo", "rloo"]
    register_choices("algorithm.adv_estimator", lambda: names, what="advantage estimator")
    return names


def test_registered_names_are_checked(estimators):
    assert _load("algorithm.adv_estimator=rloo").algorithm.adv_estimator == "rloo"
    with pytest.raises(ConfigError, match=r"algorithm\.adv_estimator='grpoo' is not a registered advantage estimator; "
                                          r"did you mean 'grpo'.*\(registered: gae, grpo, rloo\)"):
        _load("algorithm.adv_estimator=grpoo")
    estimators.append("grpoo")  # names are read at validation time, so later registrations count
    _load("algorithm.adv_estimator=grpoo")
    # a path that a root config does not have is skipped (SFTConfig has no algorithm section)
    load_config(SFTConfig)


def test_unregistered_names_are_free_form(monkeypatch):
    monkeypatch.setattr(validation, "_CHOICES", {})
    assert _load("algorithm.adv_estimator=my_estimator").algorithm.adv_estimator == "my_estimator"
