"""Settings that used to be accepted and then did nothing (#58): each is refused when the config is
built, before any model, in one line naming the key and the fix."""

from __future__ import annotations

import pytest

from verl.config import ConfigError, PPOConfig, SFTConfig, load_config


def _refused(*overrides: str, root=PPOConfig) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(root, overrides=["trainer.n_gpus_per_node=1", *overrides], world_size=1)
    assert "\n" not in str(info.value)  # one problem, one line
    return str(info.value)


@pytest.mark.parametrize("key", ["actor_rollout_ref.model", "critic.model"])
def test_lora_settings_without_a_rank_are_refused(key):
    """LoRA keys without lora_rank trained every weight in silence."""
    assert _refused(f"{key}.target_modules=[q_proj,v_proj]", f"{key}.lora_alpha=32") == (
        f"{key}.lora_alpha=32 and {key}.target_modules=['q_proj', 'v_proj'] set, but {key}.lora_rank=0 builds no "
        f"adapters and trains every weight: set {key}.lora_rank (e.g. {key}.lora_rank=16) to train LoRA adapters, or "
        "drop the LoRA settings"
    )


def test_lora_settings_without_a_rank_are_refused_in_sft():
    assert _refused("model.lora_alpha=8", root=SFTConfig).startswith("model.lora_alpha=8 set, but model.lora_rank=0")


def test_lora_settings_with_a_rank_pass():
    load_config(PPOConfig, overrides=["trainer.n_gpus_per_node=1", "actor_rollout_ref.model.lora_rank=8",
                                      "actor_rollout_ref.model.lora_alpha=32"], world_size=1)


@pytest.mark.parametrize(
    "setting, key",
    [
        ("+actor_rollout_ref.actor.megatron.override_transformer_config.moe_aux_loss_coeff=-0.01",
         "actor_rollout_ref.actor.megatron.override_transformer_config.moe_aux_loss_coeff"),
        ("+actor_rollout_ref.model.override_config.router_aux_loss_coef=-0.5",
         "actor_rollout_ref.model.override_config.router_aux_loss_coef"),
    ],
)
def test_a_negative_moe_load_balancing_weight_is_refused(setting, key):
    """A negative load-balancing weight turned the loss off in silence."""
    message = _refused(setting)
    assert message.startswith(f"{key}=-0.") and f"must be a number >= 0 (0 turns the loss off" in message
    assert f"set {key}=0.001" in message


def test_a_teacher_without_distillation_enabled_is_refused():
    assert _refused("distillation.teacher_model.model_path=/models/teacher") == (
        "distillation.teacher_model.model_path=/models/teacher is set, but distillation.enabled=false builds no "
        "teacher and distils nothing: set distillation.enabled=true, or distillation.teacher_model.model_path=null "
        "to train without a teacher"
    )


@pytest.mark.parametrize("key", ["algorithm.rollout_correction", "actor_rollout_ref.actor.policy_loss.rollout_correction"])
def test_a_rejection_threshold_without_a_rejection_test_is_refused(key):
    assert _refused(f"{key}.rollout_rs_threshold=0.5") == (
        f"{key}.rollout_rs_threshold=0.5 is set, but {key}.rollout_rs=null runs no rejection test, so nothing is "
        f"rejected: set {key}.rollout_rs (e.g. token_k1 or seq_max_k2), or drop the threshold"
    )


def test_an_output_folder_that_is_a_file_is_refused(tmp_path):
    """#58: the Python API's ``output_dir`` that is a file ended in a raw FileExistsError."""
    (tmp_path / "afile").write_text("x")
    assert _refused(f"trainer.default_local_dir={tmp_path}/afile", f"trainer.log_dir={tmp_path}/afile/logs") == (
        f"trainer.default_local_dir={tmp_path}/afile is a file, not a folder (the Python API's output_dir is "
        "trainer.default_local_dir): the run writes its checkpoints and logs into a folder; choose a folder path, "
        "new or existing"
    )
    assert _refused(f"trainer.log_dir={tmp_path}/afile/logs").startswith(
        f"trainer.log_dir={tmp_path}/afile/logs lies inside {tmp_path}/afile, which is a file, not a folder"
    )


def test_the_python_apis_output_dir_that_is_a_file_is_refused_in_one_line(tmp_path):
    import verl

    (tmp_path / "afile").write_text("x")
    trainer = verl.RLTrainer(actor_model=str(tmp_path / "model"), algorithm="grpo")  # not read before the check
    with pytest.raises(ValueError) as info:
        trainer.fit(dataset=str(tmp_path / "train.parquet"), max_steps=1, output_dir=str(tmp_path / "afile"))
    assert str(info.value) == (
        f"RLTrainer.fit: output_dir={tmp_path}/afile is a file, not a folder: the run writes its checkpoints and logs "
        "into a folder; give output_dir= a folder path, new or existing"
    )
    with pytest.raises(ValueError, match=rf"^RLTrainer.build_config: output_dir={tmp_path}/afile/run lies inside "
                                         rf"{tmp_path}/afile, a file, not a folder"):
        trainer.build_config(dataset_path=str(tmp_path / "train.parquet"), output_dir=str(tmp_path / "afile" / "run"))
