"""A start validates its config once (issue #52): the command line, ``verl.RLTrainer`` and
``verl.DataStream`` (with a monitor, whose settings used to rebuild the config) each check the
config once against the launched world, however many of the loader, the pre-flight and the trainer
ask; a config changed after it was checked is checked again."""

from __future__ import annotations

import pytest

FAST = [
    "trainer.device=cpu", "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=hf",
    "data.max_prompt_length=24", "data.max_response_length=8", "data.train_batch_size=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.logger=[jsonl]", "data.val_files=null",
]


class _Built(Exception):
    """Raised where the trainer would build its world: everything before it has run."""


@pytest.fixture
def counted(monkeypatch):
    from verl.config import validation
    from verl.trainer import ppo_trainer

    calls: list[int | None] = []
    check = validation.validate_ppo

    def counting(cfg, world_size):
        calls.append(world_size)
        return check(cfg, world_size)

    def stop(*args, **kwargs):
        raise _Built

    monkeypatch.setattr(validation, "validate_ppo", counting)
    monkeypatch.setattr(ppo_trainer, "build_rl_world", stop)
    return calls


def test_the_command_line_validates_once(counted, tiny_model_dir, arithmetic_files, tmp_path):
    from verl.trainer import main_ppo

    with pytest.raises(_Built):
        main_ppo.main([f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={arithmetic_files['train']}",
                       *FAST, f"trainer.default_local_dir={tmp_path}/ck", f"trainer.log_dir={tmp_path}/logs"])
    assert counted == [1]


def test_the_facade_validates_once(counted, tiny_model_dir, arithmetic_files, tmp_path):
    import verl

    trainer = verl.RLTrainer(tiny_model_dir, use_vllm=False, device="cpu")
    with pytest.raises(_Built):
        trainer.fit(dataset_path=arithmetic_files["train"], max_steps=1, output_dir=str(tmp_path / "out"))
    assert counted == [1]


def test_a_stream_with_a_monitor_validates_once(counted, tiny_model_dir, arithmetic_files, tmp_path):
    from verl import DataStream, PPOUpdateOperator, RewardOperator, RolloutOperator, VerlMonitor

    stream = (
        DataStream(model=tiny_model_dir, train_files=arithmetic_files["train"],
                   overrides=[*FAST, f"trainer.default_local_dir={tmp_path}/ck"])
        .add_operator(RolloutOperator(n=4))
        .add_operator(RewardOperator("verl/arithmetic"))
        .add_operator(PPOUpdateOperator(estimator="grpo"))
        .with_monitor(VerlMonitor(log_dir=str(tmp_path / "logs")))
    )
    with pytest.raises(_Built):
        stream.step()
    assert counted == [1]
    assert stream.config().trainer.log_dir == str(tmp_path / "logs")  # the monitor's setting reached it


def test_a_config_changed_after_its_check_is_checked_again(counted, tiny_model_dir, arithmetic_files):
    from verl.config import PPOConfig, load_config

    cfg = load_config(PPOConfig, config_file="ppo_trainer", world_size=1,
                      overrides=[f"actor_rollout_ref.model.path={tiny_model_dir}",
                                 f"data.train_files={arithmetic_files['train']}", *FAST])
    cfg.validate(1)
    assert counted == [1]
    cfg.validate(1)  # same world, unchanged: not again
    assert counted == [1]
    cfg.data.train_batch_size = 8
    cfg.validate(1)
    assert counted == [1, 1]
    cfg.validate(None)  # another world size
    assert counted == [1, 1, None]
