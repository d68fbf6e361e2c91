"""First contact with the Python API (issue "First contact"): the tutorials' arguments work or fail
with one line naming the fix, before anything is built."""

from __future__ import annotations

import json
import os

import pytest

CPU = ["trainer.device=cpu", "trainer.n_gpus_per_node=1"]


def test_the_facade_takes_a_reward_model_directory(tiny_model_dir, reward_model_dir, arithmetic_files, tmp_path):
    import verl

    trainer = verl.RLTrainer(
        tiny_model_dir, reward_model=reward_model_dir, algorithm="ppo", use_vllm=False,
        rollout_batch_size=32, train_batch_size=16, device="cpu",
    )
    cfg = trainer.build_config(dataset_path=arithmetic_files["train"], max_steps=1, output_dir=str(tmp_path))
    assert cfg.reward_model.enable and cfg.reward_model.model.path == os.path.abspath(reward_model_dir)
    assert cfg.algorithm.adv_estimator == "gae" and cfg.use_critic
    assert "reward_model" in (verl.RLTrainer.__init__.__doc__ or "")


def test_a_reward_model_that_is_not_one_fails_naming_the_argument(tmp_path):
    import verl

    with pytest.raises(ValueError, match=r"RLTrainer\(reward_model=...\): .* is not a Hugging Face checkpoint directory"):
        verl.RLTrainer("model", reward_model=str(tmp_path))
    with pytest.raises(TypeError, match=r"RLTrainer\(reward_model=...\) takes a Hugging Face reward model directory"):
        verl.RLTrainer("model", reward_model=3)


def test_preference_pairs_with_grpo_point_to_dpo_and_train_with_dpo(tiny_model_dir, tmp_path):
    import verl

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "2+2?", "chosen": "4", "rejected": "5"}) + "\n")
    with pytest.raises(ValueError, match=r"algorithm='grpo' learns from a reward.*algorithm=\"dpo\""):
        verl.RLTrainer(tiny_model_dir, algorithm="grpo", preference_dataset_path=str(pairs), beta=0.1)
    trainer = verl.RLTrainer(tiny_model_dir, algorithm="dpo", preference_dataset_path=str(pairs), beta=0.2, device="cpu")
    cfg = trainer.build_config(dataset_path=trainer.preference_dataset_path, max_steps=1, output_dir=str(tmp_path / "o"))
    assert cfg.data.pairs and cfg.algorithm.dpo.beta == 0.2 and cfg.data.train_files == [str(pairs)]
    assert "preference_dataset_path" in (verl.RLTrainer.__init__.__doc__ or "")


def test_a_bare_stream_says_how_to_give_it_prompts(tiny_model_dir):
    from verl import DataStream, RolloutOperator

    stream = DataStream(overrides=CPU).add_operator(RolloutOperator(model=tiny_model_dir))
    with pytest.raises(ValueError, match=r"^DataStream has no prompts: give DataStream\(train_files=...\)") as exc:
        stream.config()
    assert "gsm8k" not in str(exc.value)  # no default path of someone else's machine


def test_a_stream_given_training_files_only_does_not_validate(tiny_model_dir, arithmetic_files):
    from verl import DataStream

    stream = DataStream(model=tiny_model_dir, train_files=arithmetic_files["train"], overrides=CPU)
    assert stream.config().data.val_files is None
    given = DataStream(model=tiny_model_dir, train_files=arithmetic_files["train"], val_files=arithmetic_files["val"],
                       overrides=CPU)
    assert given.config().data.val_files == arithmetic_files["val"]


def test_a_monitor_adds_the_logger_its_report_reads(tiny_model_dir, arithmetic_files, tmp_path):
    from verl import DataStream, VerlMonitor

    stream = DataStream(model=tiny_model_dir, train_files=arithmetic_files["train"], overrides=[*CPU, "trainer.logger=[console]"])
    stream.with_monitor(VerlMonitor(log_dir=str(tmp_path / "logs"), report_interval=10))
    cfg = stream.config()
    assert cfg.trainer.logger == ["console", "jsonl"] and cfg.trainer.report_freq == 10
    assert cfg.trainer.log_dir == str(tmp_path / "logs")


def test_the_conditional_stream_needs_several_samples_per_prompt():
    from verl import ConditionalUpdateOperator, DPOUpdateOperator, PPOUpdateOperator

    op = ConditionalUpdateOperator(condition=lambda s: s["reward"] > 0, true_branch=PPOUpdateOperator(),
                                   false_branch=DPOUpdateOperator())

    class OneSample:  # the trainer's attribute the check reads
        n = 1

    with pytest.raises(ValueError, match=r"actor_rollout_ref.rollout.n=1 response per prompt.*RolloutOperator\(n=4\)"):
        op.bind(OneSample())


def test_reward_delta_compares_the_last_quarter_with_the_first():
    from verl.api.facade import reward_change

    # 8 steps: first quarter (2 steps) mean 0.1, last quarter mean 0.6.
    assert reward_change([0.0, 0.2, 0.9, 0.0, 0.5, 0.1, 0.5, 0.7]) == pytest.approx(0.6 - 0.1)
    assert reward_change([0.3]) == 0.0
    assert reward_change([0.2, 0.4, 0.6]) == pytest.approx(0.6 - 0.2)


def test_the_conditional_stream_says_so_when_its_config_is_built(tiny_model_dir, arithmetic_files):
    """With the config's default one sample per prompt the stream fails as it builds its config,
    before any model: one line naming the fix."""
    from verl import (
        ConditionalUpdateOperator, DataStream, DPOUpdateOperator, PPOUpdateOperator, RewardOperator, RolloutOperator,
    )

    stream = DataStream(model=tiny_model_dir, train_files=arithmetic_files["train"], overrides=CPU)
    stream.add_operator(RolloutOperator()).add_operator(RewardOperator())
    stream.add_operator(ConditionalUpdateOperator(condition=lambda s: s["reward"] > 0, true_branch=PPOUpdateOperator(),
                                                  false_branch=DPOUpdateOperator()))
    with pytest.raises(ValueError, match=r"^ConditionalUpdateOperator: .*rollout.n=1 .*RolloutOperator\(n=4\)") as exc:
        stream.config()
    assert "\n" not in str(exc.value)
