"""A recipe run twice: the second run starts afresh and the first run's outputs are kept.

Recipes start at step 0 (``trainer.resume_mode=disable``); the trainer refuses to start over an
earlier run's checkpoints and logs (it would replace them step by step), so the launcher moves them
aside first (``verl.trainer.launcher.set_aside_earlier_run``), as the launchers' headers promise
("a rerun ... trains GRPO afresh").
"""

from __future__ import annotations

import os

import pytest

from verl.config import PPOConfig, load_config
from verl.trainer.launcher import set_aside_earlier_run
from verl.trainer.run_checks import check_run_outputs, release_run_outputs
from verl.utils.outputs import OutputPathError, commit_output, staging_dir


def _recipe_args(out) -> list[str]:
    return [
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={out}/checkpoints",
        f"trainer.log_dir={out}/logs",
        f"trainer.hf_export_dir={out}/grpo_model",
    ]


def _earlier_run(out) -> None:
    (out / "checkpoints" / "global_step_60").mkdir(parents=True)
    (out / "checkpoints" / "global_step_60" / "state.pt").write_bytes(b"weights")
    (out / "logs").mkdir()
    (out / "logs" / "metrics.jsonl").write_text('{"step": 1}\n')
    export = staging_dir(str(out / "grpo_model"))
    with open(os.path.join(export, "config.json"), "w") as f:
        f.write("{}")
    commit_output(export, str(out / "grpo_model"), what="test export")
    (out / "data").mkdir()  # an input of the recipe: stays
    (out / "data" / "train.parquet").write_bytes(b"rows")


def _trainer(args):
    return load_config(PPOConfig, overrides=[*args, "trainer.save_freq=10", "trainer.logger=[console,jsonl]",
                                             "trainer.n_gpus_per_node=1"], world_size=1).trainer


def test_a_rerun_moves_the_earlier_runs_outputs_aside_and_starts(tmp_path):
    out = tmp_path / "out"
    _earlier_run(out)
    args = _recipe_args(out)
    with pytest.raises(OutputPathError, match="holds the checkpoints of an earlier run"):
        check_run_outputs(_trainer(args), inputs={})  # what a rerun met before
    where = set_aside_earlier_run(["trainer.resume_mode=auto", *args, "trainer.total_training_steps=80"])
    assert where is not None and os.path.dirname(where) == str(out / "earlier_runs")
    assert sorted(os.listdir(where)) == ["checkpoints", "grpo_model", "logs"]
    assert (out / "earlier_runs" / os.path.basename(where) / "checkpoints" / "global_step_60" / "state.pt").read_bytes() == b"weights"
    assert not (out / "checkpoints").exists() and not (out / "logs").exists() and not (out / "grpo_model").exists()
    assert (out / "data" / "train.parquet").read_bytes() == b"rows"
    check_run_outputs(_trainer(args), inputs={})  # the rerun starts
    release_run_outputs(_trainer(args))  # and ends (its trainer's close): a live run's folders would stay
    # A third run moves the second's aside beside the first's, never over it.
    _earlier_run_again = out / "checkpoints" / "global_step_80"
    _earlier_run_again.mkdir(parents=True)
    second = set_aside_earlier_run(args)
    assert second is not None and second != where and sorted(os.listdir(out / "earlier_runs")) == sorted(
        [os.path.basename(where), os.path.basename(second)]
    )
    assert os.listdir(os.path.join(second, "checkpoints")) == ["global_step_80"]


def test_a_resumed_run_or_a_first_run_moves_nothing(tmp_path):
    out = tmp_path / "out"
    _earlier_run(out)
    # The user asks to resume (last value wins over the recipe's disable): the checkpoints stay.
    assert set_aside_earlier_run([*_recipe_args(out), "trainer.resume_mode=auto"]) is None
    assert (out / "checkpoints" / "global_step_60" / "state.pt").exists()
    # Nothing there yet (or empty folders): nothing to move.
    fresh = tmp_path / "fresh"
    (fresh / "logs").mkdir(parents=True)
    assert set_aside_earlier_run(_recipe_args(fresh)) is None
    assert not (fresh / "earlier_runs").exists()


def test_a_rerun_moves_only_the_folders_verl_wrote(tmp_path, capsys):
    """#58: a recipe moved a user's folder given as ``trainer.log_dir`` (a model folder) into
    ``OUT/earlier_runs/`` as "an earlier run's logs"."""
    out = tmp_path / "out"
    _earlier_run(out)
    mine = tmp_path / "my_model"
    mine.mkdir()
    (mine / "config.json").write_text('{"model_type": "llama"}')
    (mine / "model.safetensors").write_bytes(b"weights")
    args = [*_recipe_args(out), f"trainer.log_dir={mine}"]
    where = set_aside_earlier_run(args)
    assert sorted(os.listdir(where)) == ["checkpoints", "grpo_model"]  # verl's folders moved
    assert sorted(os.listdir(mine)) == ["config.json", "model.safetensors"]  # the user's stays
    assert f"== {mine} stays where it is, not moved to earlier_runs/: trainer.log_dir holds config.json, " in capsys.readouterr().out
    with pytest.raises(OutputPathError, match=r"holds config.json, which verl did not write"):
        check_run_outputs(_trainer(args), inputs={})  # and the run refuses to replace its config.json
    # An export folder the user wrote is not moved either.
    (out / "grpo_model").mkdir()
    (out / "grpo_model" / "weights.bin").write_bytes(b"mine")
    assert set_aside_earlier_run(args) is None
    assert (out / "grpo_model" / "weights.bin").read_bytes() == b"mine"
