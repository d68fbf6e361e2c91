"""``python -m verl.trainer.main_ppo`` refuses bad input before it builds any model (exit 2, named fields).

Each case runs ``main`` in this process; starting the distributed world (the step before any
engine is built) is replaced by a failure, so a check that came too late fails the test.
WORLD_SIZE stands for the world torchrun would launch: only the config checks read it.
"""

from __future__ import annotations

import os

import pytest

from verl.data.io import write_parquet
from verl.data.tasks import arithmetic
from verl.trainer.main_ppo import main


@pytest.fixture
def run(capsys, monkeypatch, tmp_path):
    import verl.parallel.bootstrap

    def never(**_):
        raise AssertionError("main_ppo started building the run: a check came too late")

    monkeypatch.setattr(verl.parallel.bootstrap, "init_distributed", never)

    def run(argv: list[str], *, world_size: int = 1) -> str:
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
        with pytest.raises(SystemExit) as exc:
            main(
                [
                    "--config",
                    "grpo_tiny_cpu",
                    f"trainer.n_gpus_per_node={world_size}",
                    f"trainer.default_local_dir={tmp_path}/ckpt",
                    f"trainer.log_dir={tmp_path}/logs",
                    *argv,
                ]
            )
        assert exc.value.code == 2
        return capsys.readouterr().err

    return run


@pytest.fixture
def inputs(tiny_model_dir, arithmetic_files) -> list[str]:
    return [
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        f"data.train_files={arithmetic_files['train']}",
        f"data.val_files={arithmetic_files['val']}",
    ]


def test_layout_that_does_not_divide_the_world(run, inputs):
    err = run([*inputs, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3"], world_size=4)
    assert "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3" in err and "world size 4" in err


def test_rollout_tp_that_does_not_divide_the_actor_ranks(run, inputs):
    err = run([*inputs, "actor_rollout_ref.rollout.tensor_model_parallel_size=3"], world_size=4)
    assert "actor_rollout_ref.rollout.tensor_model_parallel_size=3" in err and "world size 4" in err


def test_rollout_tp_that_does_not_divide_the_heads(run, inputs):
    # The tiny model has 2 attention heads: TP'=4 divides the 4 ranks but not the heads.
    err = run([*inputs, "actor_rollout_ref.rollout.tensor_model_parallel_size=4"], world_size=4)
    assert "actor_rollout_ref.rollout.tensor_model_parallel_size=4" in err and "num_attention_heads=2" in err


def test_layout_that_cannot_split_the_model(run, inputs):
    # TP=4 divides the 4 ranks but not the tiny model's 2 attention and 2 key/value heads.
    err = run([*inputs, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4"], world_size=4)
    assert "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4" in err
    assert "num_key_value_heads=2 is not divisible by tensor parallel 4" in err


def test_batch_sizes_that_do_not_divide(run, inputs):
    # 16 prompts x n=4 = 64 sequences; mini-batches of 6 prompts do not divide 16, and 6 x 4 = 24
    # sequences do not split into micro-batches of 8 on 2 data-parallel ranks.
    err = run(
        [
            *inputs,
            "data.train_batch_size=16",
            "actor_rollout_ref.actor.ppo_mini_batch_size=6",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        ],
        world_size=2,
    )
    assert (
        "data.train_batch_size=16 is not a multiple of actor_rollout_ref.actor.ppo_mini_batch_size=6" in err
    )
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8" in err


def test_data_source_without_a_scorer(run, tiny_model_dir, tmp_path):
    records, _ = arithmetic.generate_splits(train=32, val=0, digits=1, seed=0)
    for r in records[::2]:
        r["data_source"] = "my/unknown_task"
    write_parquet(records, str(tmp_path / "train.parquet"))
    err = run(
        [
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            f"data.train_files={tmp_path}/train.parquet",
            "data.val_files=null",
        ]
    )
    assert "data.train_files" in err and "'my/unknown_task'" in err and "no rule-based scorer" in err
    assert "verl/arithmetic" in err  # the known ones are listed


def test_critic_estimator_without_a_critic(run, inputs):
    err = run([*inputs, "algorithm.adv_estimator=gae", "critic.enable=false"])
    assert "algorithm.adv_estimator=gae reads critic values, but critic.enable=false" in err


def test_every_problem_at_once(run, tmp_path):
    err = run(
        [
            f"actor_rollout_ref.model.path={tmp_path}",
            f"data.train_files={tmp_path}/nope.parquet",
            "data.val_files=null",
            "algorithm.adv_estimator=gae",
            "critic.enable=false",
        ]
    )
    assert "3 problems" in err
    assert (
        "has no config.json" in err and "nope.parquet does not exist" in err and "critic.enable=false" in err
    )


def test_tutorial_command_line(tiny_model_dir, arithmetic_files, caplog, monkeypatch):
    """The tutorials' keys: --config-path FILE and the documented aliases, each logged once."""
    import logging

    from verl.config import CONFIG_DIR, PPOConfig, loader, parse_cli

    monkeypatch.setattr(loader, "_ALIASES_LOGGED", set())  # as in a fresh process
    argv = [
        f"--config-path={CONFIG_DIR / 'grpo_tiny_cpu.yaml'}",
        f"model.pretrained_model_name_or_path={tiny_model_dir}",
        f"data.train_files={arithmetic_files['train']}",
        f"data.val_files={arithmetic_files['val']}",
        "trainer.num_epochs=1",
        "trainer.batch_size_per_device=8",
        "actor_micro_batch_size=8",
        "trainer.n_gpus_per_node=1",
    ]
    with caplog.at_level(logging.INFO, logger="verl.config"):
        cfg = parse_cli(PPOConfig, argv, prog="main_ppo", default_config_file=None, world_size=1)
        parse_cli(PPOConfig, argv, prog="main_ppo", default_config_file=None, world_size=1)
    assert cfg.actor_rollout_ref.model.path == tiny_model_dir
    assert cfg.trainer.total_epochs == 1
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 8
    assert cfg.data.train_batch_size == 64  # from the file
    alias_lines = [r.getMessage() for r in caplog.records if "is an alias of" in r.getMessage()]
    for alias in (
        "model.pretrained_model_name_or_path",
        "trainer.num_epochs",
        "trainer.batch_size_per_device",
        "actor_micro_batch_size",
    ):
        assert sum(line.startswith(f"config: {alias} ") for line in alias_lines) == 1, alias_lines


@pytest.mark.parametrize(
    ("key", "where", "relation", "input_key"),
    [
        ("trainer.log_dir", "model", "is the input", "actor_rollout_ref.model.path"),
        ("trainer.default_local_dir", "model", "is the input", "actor_rollout_ref.model.path"),
        # A checkpoint root replaces only its global_step_N/ (and staging copies, the tracker, the
        # default huggingface/ export): an input beside them is safe (tests/utils/test_outputs.py).
        ("trainer.log_dir", "model/logs", "is inside the input", "actor_rollout_ref.model.path"),
    ],
)
def test_checkpoints_or_logs_in_an_input_are_refused(run, inputs, tiny_model_dir, arithmetic_files, key, where,
                                                     relation, input_key):
    """The RL trainer shares the SFT trainer's output rule (verl.trainer.run_checks)."""
    folders = {"model": tiny_model_dir, "data": os.path.dirname(arithmetic_files["train"])}
    top, _, sub = where.partition("/")
    target = os.path.join(folders[top], sub) if sub else folders[top]
    before = sorted(os.listdir(folders[top]))
    err = run([*inputs, "trainer.save_freq=5", "trainer.logger=[jsonl]", f"{key}={target}"])
    assert f"{key}={target} {relation} {input_key}=" in err, err
    assert sorted(os.listdir(folders[top])) == before


def test_a_fresh_run_into_an_earlier_runs_checkpoints_is_refused(run, inputs, tmp_path):
    for step in (1, 2):
        (tmp_path / "ckpt" / f"global_step_{step}").mkdir(parents=True)
    err = run([*inputs, "trainer.save_freq=1", "trainer.resume_mode=disable"])
    assert (
        f"trainer.default_local_dir={tmp_path}/ckpt holds the checkpoints of an earlier run (global_step_1, "
        "global_step_2); trainer.resume_mode=disable starts at step 0"
    ) in err
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["global_step_1", "global_step_2"]
