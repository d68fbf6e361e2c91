"""Whole-config validation: layouts against the world size, batch divisibility, registry names."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from verl.config import ConfigError, PPOConfig, SFTConfig, all_paths, load_config, register_choices
from verl.config import validation

REPO = Path(__file__).resolve().parents[2]


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
    # One problem: checking the layout against a world the user did not mean adds only noise.
    assert msg == ("the launched world size 6 differs from trainer.nnodes=1 x trainer.n_gpus_per_node=4 = 4; "
                   "launch 4 processes (torchrun --nnodes=1 --nproc_per_node=4) or set trainer.n_gpus_per_node=6 "
                   "to match the launcher")
    with pytest.raises(ConfigError, match="set trainer.nnodes and trainer.n_gpus_per_node so that their product is 3"):
        _load("trainer.nnodes=2", world_size=3)
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
        (["actor_rollout_ref.actor.old_log_prob=current"],
         r"old_log_prob=current needs each batch to be one optimizer step \(ppo_epochs=1, ppo_mini_batch_size=256 "
         r"of data\.train_batch_size=1024\)"),
        (["actor_rollout_ref.actor.old_log_prob=current", "actor_rollout_ref.actor.ppo_mini_batch_size=1024",
          "algorithm.use_kl_in_reward=true"],
         r"old_log_prob=current leaves no old log-probabilities before the update, and algorithm\.use_kl_in_reward"),
        (["actor_rollout_ref.actor.old_log_prob=rollout", "actor_rollout_ref.rollout.top_p=0.9",
          "actor_rollout_ref.actor.replay_sampling_mask=false"],
         r"old_log_prob=rollout takes the engine's log-probabilities, which with top_p=0\.9 .* set replay_sampling_mask=true"),
        (["trainer.async_training.partial_rollout=true"],
         r"^[^\n]*trainer\.async_training\.partial_rollout=true applies to the async rollout: set trainer\.rollout_mode=async \(it is sync\)$"),
        (["trainer.rollout_mode=one_step_off", "trainer.async_training.stale_samples=drop"],
         r"trainer\.async_training\.stale_samples=drop applies to the async rollout: set trainer\.rollout_mode=async \(it is one_step_off\)"),
        (["trainer.rollout_mode=async", "trainer.async_training.partial_rollout=true", "actor_rollout_ref.rollout.stop=[END]"],
         r"partial_rollout=true generates in segments, which does not fit actor_rollout_ref\.rollout\.stop \(stop strings"),
        (["trainer.rollout_mode=async", "trainer.async_training.partial_rollout=true", "algorithm.adv_estimator=remax"],
         r"which does not fit algorithm\.adv_estimator=remax .*: set partial_rollout=false"),
    ],
)
def test_batch_and_layout_rules(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        _load(*overrides)


def test_rollout_log_probs_with_top_k_top_p_pass_when_the_mask_is_replayed():
    # bypass mode takes the engine's (truncated) log-probabilities as the old ones: allowed once the
    # trainer's passes replay the same truncation (actor.replay_sampling_mask, on by default).
    cfg = _load("algorithm.rollout_correction.bypass_mode=true", "actor_rollout_ref.rollout.top_p=0.9",
                "actor_rollout_ref.rollout.top_k=20")
    assert cfg.old_log_prob_source == "rollout" and cfg.actor_rollout_ref.actor.replay_sampling_mask


FILL = ["trainer.rollout_mode=async", "trainer.async_training.partial_rollout=true", "trainer.async_training.fill_update_window=true"]


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        (FILL, r"the rollout on ranks of its own \(trainer\.placement\.rollout; colocated there is no update to overlap\)"),
        ([*FILL[::2], "trainer.placement.rollout=[1]"], r"partial_rollout=true"),
        ([*FILL, "trainer.rollout_mode=one_step_off", "trainer.placement.rollout=[1]"], r"trainer\.rollout_mode=async \(it is one_step_off\)"),
    ],
)
def test_fill_update_window_needs_partial_rollout_on_ranks_apart(overrides, why):
    with pytest.raises(ConfigError, match=r"(?m)trainer\.async_training\.fill_update_window=true needs " + why + r"[^\n]*: set fill_update_window=false$"):
        _load("trainer.n_gpus_per_node=2", *overrides)


@pytest.mark.parametrize("placement", [["trainer.n_gpus_per_node=2", "trainer.placement.rollout=[1]"],
                                       ["trainer.n_gpus_per_node=4", "trainer.placement.rollout=[2, 3]"]])
def test_fill_update_window_passes_with_the_rollout_on_ranks_apart(placement):
    cfg = _load(*placement, *FILL)  # several rollout ranks agree on when the update ends (test_fill_update_window.py)
    assert cfg.trainer.async_training.fill_update_window is True


FREE = ["trainer.rollout_mode=async", "trainer.async_training.partial_rollout=true", "trainer.async_training.free_running=true"]


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        (["trainer.n_gpus_per_node=2", *FREE], r"needs the rollout on ranks of its own \(trainer\.placement\.rollout\): set free_running=false"),
        (["trainer.n_gpus_per_node=2", *FREE[2:], "trainer.placement.rollout=[1]"], r"needs trainer\.rollout_mode=async \(it is sync\): set free_running=false"),
        (["trainer.n_gpus_per_node=2", *FREE, "trainer.placement.rollout=[1]", "trainer.async_training.fill_update_window=true"],
         r"already generates through the update window: set fill_update_window=false"),
        (["trainer.n_gpus_per_node=3", *FREE, "trainer.placement.rollout=[1, 2]", "trainer.placement.critic=[1, 2]",
          "algorithm.adv_estimator=gae"],
         r"needs ranks that only generate, but the rollout's ranks \[1, 2\] also hold the critic \(trainer\.placement\); place it"),
    ],
)
def test_free_running_needs_partial_rollout_on_ranks_that_only_generate(overrides, why):
    with pytest.raises(ConfigError, match=r"trainer\.async_training\.(free_running|fill_update_window)=true " + why):
        _load(*overrides)


@pytest.mark.parametrize("placement", [["trainer.n_gpus_per_node=2", "trainer.placement.rollout=[1]"],
                                       ["trainer.n_gpus_per_node=3", "trainer.placement.rollout=[1, 2]",
                                        "trainer.placement.ref=[1, 2]", "actor_rollout_ref.actor.use_kl_loss=true"]])
@pytest.mark.parametrize("partial", [True, False])
def test_free_running_passes_on_ranks_that_only_generate(placement, partial):
    cfg = _load(*placement, *(FREE if partial else FREE[::2]))  # the reference may share all of its ranks with the rollout (RLWorld.ref_ahead)
    assert cfg.trainer.async_training.free_running is True


def test_partial_rollout_and_drop_pass_in_async():
    cfg = _load("trainer.rollout_mode=async", "trainer.async_training.partial_rollout=true",
                "trainer.async_training.partial_rollout_tokens=8", "trainer.async_training.stale_samples=drop")
    at = cfg.trainer.async_training
    assert (at.partial_rollout, at.partial_rollout_tokens, at.stale_samples) == (True, 8, "drop")
    with pytest.raises(ConfigError, match=r"stale_samples"):
        _load("trainer.rollout_mode=async", "trainer.async_training.stale_samples=never")


def test_auto_old_log_prob_skips_the_pass_only_where_it_gives_the_same_numbers():
    one_step = ["actor_rollout_ref.actor.ppo_mini_batch_size=1024"]
    assert _load(*one_step).old_log_prob_source == "current"
    assert _load().old_log_prob_source == "recompute"  # 4 mini-batches per batch
    assert _load(*one_step, "actor_rollout_ref.actor.ppo_epochs=2").old_log_prob_source == "recompute"
    assert _load(*one_step, "algorithm.use_kl_in_reward=true").old_log_prob_source == "recompute"
    assert _load("actor_rollout_ref.actor.old_log_prob=rollout").old_log_prob_source == "rollout"


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


def test_names_are_checked_without_importing_the_registries():
    # A fresh interpreter, where nothing has imported verl.algos, verl.rollout or verl.rewards.
    code = (
        "import sys\n"
        "from verl.config import PPOConfig, ConfigError, load_config\n"
        "cfg = load_config(PPOConfig)\n"
        "assert 'torch' not in sys.modules, 'a default config imports no registry'\n"
        "try:\n"
        "    load_config(PPOConfig, overrides=['algorithm.adv_estimator=grpoo'])\n"
        "except ConfigError as exc:\n"
        "    print(exc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("algorithm.adv_estimator='grpoo' is not a registered advantage estimator; "
                                  "did you mean 'grpo'"), proc.stdout


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ("algorithm.adv_estimator=grpoo", r"algorithm\.adv_estimator='grpoo' is not a registered advantage estimator; "
                                          r"did you mean 'grpo'"),
        ("actor_rollout_ref.actor.policy_loss.loss_mode=vanila",
         r"policy_loss\.loss_mode='vanila' is not a registered policy loss; did you mean 'vanilla'"),
        ("actor_rollout_ref.actor.kl_loss_type=mes", r"kl_loss_type='mes' is not a registered KL estimator; "
                                                     r"did you mean 'mse'"),
        ("algorithm.kl_penalty=low_var", r"kl_penalty='low_var' is not a registered KL estimator"),
        ("actor_rollout_ref.rollout.name=vlm", r"rollout\.name='vlm' is not a registered rollout engine; "
                                               r"did you mean 'vllm'\? \(registered: hf, vllm\)"),
        ("reward_model.reward_manager=naiv", r"reward_manager='naiv' is not a registered reward manager; "
                                             r"did you mean 'naive'"),
    ],
)
def test_every_registry_backed_name_is_checked(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        _load(override)


def test_name_registry_table_matches_the_schema_and_the_registries():
    paths = set(all_paths(PPOConfig))
    for path, (source, _) in validation.NAME_REGISTRIES.items():
        assert path in paths, path
        names = validation._registry_names(source)
        assert names, source
        default = validation._default(PPOConfig, path)
        assert default in names, (path, default, names)  # defaults skip the (torch) import
    # loss_agg_mode is a fixed set, typed as a Literal: it must match the aggregation's list
    from verl.algos import list_loss_agg_modes
    from verl.config.schema import LossAggMode

    assert sorted(typing.get_args(LossAggMode)) == sorted(list_loss_agg_modes())


def test_a_plugin_registration_counts_at_validation_time():
    from verl.algos import advantage

    @advantage.register_adv_estimator("test_plugin_estimator")
    def _plugin(token_level_rewards):  # noqa: ARG001 - only its name matters here
        raise AssertionError("not called")

    try:
        assert _load("algorithm.adv_estimator=test_plugin_estimator").algorithm.adv_estimator == "test_plugin_estimator"
    finally:
        del advantage.ADV_ESTIMATORS._table["test_plugin_estimator"]


@pytest.mark.parametrize("mode", ["auto", "disable"])
def test_resume_from_path_without_resume_mode_is_refused(mode):
    with pytest.raises(ConfigError) as info:
        _load(f"trainer.resume_mode={mode}", "trainer.resume_from_path=ckpt/global_step_5")
    assert str(info.value) == (
        f"trainer.resume_from_path='ckpt/global_step_5' is ignored with trainer.resume_mode={mode}; set "
        "trainer.resume_mode=resume_path to resume from it, or drop trainer.resume_from_path"
    )
    load_config(SFTConfig, overrides=["trainer.resume_mode=resume_path", "trainer.resume_from_path=ckpt/global_step_5"])
    with pytest.raises(ConfigError, match="is ignored with trainer.resume_mode=auto"):
        load_config(SFTConfig, overrides=["trainer.resume_from_path=ckpt/global_step_5"])


def test_launched_world_is_the_only_problem_when_it_differs():
    # SFT tiny config: train_batch_size 64 = micro 64 x dp 1; the declared world 2 would break
    # divisibility, but the launched world (1) is what is wrong.
    with pytest.raises(ConfigError) as info:
        load_config(SFTConfig, config_file="sft_tiny_cpu", overrides=["trainer.n_gpus_per_node=2"], world_size=1)
    assert str(info.value).startswith("the launched world size 1 differs from trainer.nnodes=1 x "
                                      "trainer.n_gpus_per_node=2 = 2; launch 2 processes")
    # without a launched size the declared one is checked, as before
    with pytest.raises(ConfigError, match="data.train_batch_size=64 is not a multiple"):
        load_config(SFTConfig, config_file="sft_tiny_cpu", overrides=["trainer.n_gpus_per_node=2"])


@pytest.mark.parametrize("root", [PPOConfig, SFTConfig])
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.train_files=[]", "data.train_files=[] names no file; give parquet, arrow or jsonl file(s) to train on"),
        ("data.train_files=''", "data.train_files='' names no file"),
        ("data.train_files=[a.parquet,' ']", "data.train_files=['a.parquet', ' '] holds an empty file name; drop it"),
        ("data.val_files=[]", "data.val_files=[] names no file; give parquet, arrow or jsonl file(s) or null for no "
                              "validation"),
    ],
)
def test_data_file_lists_that_name_nothing(root, override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        _load(override, root=root)


# trainer.placement: roles on ranks of their own (verl.parallel.placement)
_PLACED = ("trainer.n_gpus_per_node=4",)


def test_a_placement_gives_each_role_its_ranks_and_checks_its_layout_there():
    from verl.parallel.placement import role_ranks

    # PPO (actor + critic) on 4 ranks: the critic on 3, the actor (TP 3, rollout TP' 3) on the rest.
    cfg = _load(*_PLACED, "trainer.placement.critic=[3]", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3",
                "actor_rollout_ref.rollout.tensor_model_parallel_size=3", world_size=4)
    assert role_ranks(cfg.trainer.placement, 4, ["actor", "critic"]) == {
        "actor": (0, 1, 2), "rollout": (0, 1, 2), "critic": (3,)  # the rollout with the actor unless placed
    }
    # The same layout colocated on 4 ranks does not divide the world.
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=3 .* does not divide"):
        _load(*_PLACED, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3", world_size=4)


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (["trainer.placement.critic=[2]", "critic.megatron.tensor_model_parallel_size=2"],
         r"the critic layout does not fit its ranks: critic\.megatron\.tensor_model_parallel_size=2 .* does not divide 1 "
         r"\(the critic's ranks \[2\], trainer\.placement\)"),
        (["trainer.placement.critic=[2, 3]", "critic.ppo_micro_batch_size_per_gpu=48"],
         r"critic\.ppo_micro_batch_size_per_gpu=48 does not divide the 128 sequences of a mini-batch on one rank "
         r"\(.* / data-parallel size 2 \(its 2 ranks / \(tensor 1"),  # the critic's DP is its ranks', not the world's
        (["trainer.placement.critic=[4]"], r"trainer\.placement\.critic names ranks \[4\] outside the world of 4 rank\(s\)"),
        (["trainer.placement.critic=[1, 1]"], r"lists a rank twice"),
        (["trainer.placement.critic=[]"], r"trainer\.placement\.critic is empty"),
        (["trainer.placement.ref=[1]"], r"names 'ref', which this run does not build \(it builds actor, rollout, critic\)"),
        (["trainer.placement.rollout=[0, 1]", "trainer.placement.actor=[1, 2]", "trainer.placement.critic=[3]"],
         r"puts actor on ranks \[1, 2\] and rollout on \[0, 1\]: they share ranks \[1\] but not all"),
        (["trainer.placement.critics=[1]"], r"unknown role 'critics'"),
        (["trainer.placement.critic=[0, 1, 2, 3]"], r"leaving none to the actor"),
        (["trainer.placement.actor=[0, 1]", "trainer.placement.critic=[1, 2]"], r"they share ranks \[1\] but not all"),
        (["trainer.placement.actor=[0]", "trainer.placement.critic=[1]"], r"leaves ranks \[2, 3\] to no role"),
        (["trainer.placement.critic=[3]", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
         r"the rollout layout does not fit its ranks: .*tensor_model_parallel_size=2 does not divide 3 "
         r"\(the rollout's ranks \[0-2\]"),
        (["trainer.placement.rollout=[3]", "trainer.placement.critic=[2]", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
         r"the rollout layout does not fit its ranks: .*tensor_model_parallel_size=2 does not divide 1 \(the rollout's ranks \[3\]"),
    ],
)
def test_a_placement_that_cannot_run_names_the_cause(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        _load(*_PLACED, *overrides, world_size=4)


@pytest.mark.parametrize("root", [PPOConfig, SFTConfig])
@pytest.mark.parametrize("key, says", [("save_freq", "saves no checkpoint, not even at the end"), ("test_freq", "never validates")])
def test_a_frequency_of_zero_is_refused_naming_never(root, key, says):
    with pytest.raises(ConfigError, match=rf"trainer.{key}=0 {says}; use -1 for never, or a number of steps >= 1"):
        _load(f"trainer.{key}=0", root=root)
    assert getattr(_load(f"trainer.{key}=-1", root=root).trainer, key) == -1


def test_lora_keys_are_the_references_and_bad_targets_fail_before_any_model():
    cfg = _load()
    model = cfg.actor_rollout_ref.model
    assert (model.lora_rank, model.lora_alpha, model.lora_dropout, model.target_modules) == (0, 16, 0.0, "all-linear")
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.model\.target_modules=.*unknown: \['qkv_proj'\]"):
        _load("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.target_modules=[q_proj,qkv_proj]")
    with pytest.raises(ConfigError, match=r"critic\.model\.target_modules"):
        _load("critic.model.lora_rank=8", "critic.model.target_modules=lm_head")
    with pytest.raises(ConfigError, match=r"lora_dropout"):
        _load("actor_rollout_ref.model.lora_dropout=1.0")
    with pytest.raises(ConfigError, match=r"lora_rank=8 with actor_rollout_ref\.actor\.strategy=fsdp2.*strategy=megatron"):
        _load("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.actor.strategy=fsdp2")
    assert _load("actor_rollout_ref.model.lora_rank=8").actor_rollout_ref.model.lora_rank == 8
