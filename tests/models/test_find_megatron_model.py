"""megatron2hf's --megatron-dir: the model inside a training checkpoint is found, or the exact folder named."""

from __future__ import annotations

import pytest

from verl.models.convert import find_megatron_model


def _model(path) -> str:
    """A folder that holds a Megatron model checkpoint (for the finder, its verl_model.json)."""
    path.mkdir(parents=True)
    (path / "verl_model.json").write_text("{}")
    return str(path)


def test_a_model_folder_is_itself(tmp_path):
    model = _model(tmp_path / "converted")
    assert find_megatron_model(model) == model


@pytest.mark.parametrize("given", ["global_step_4", "global_step_4/actor", "global_step_4/actor/model"])
def test_a_training_checkpoint_gives_its_actor_model(tmp_path, given):
    actor = _model(tmp_path / "global_step_4" / "actor" / "model")
    _model(tmp_path / "global_step_4" / "critic" / "model")
    (tmp_path / "global_step_4" / "checkpoint_complete.json").write_text("{}")
    assert find_megatron_model(str(tmp_path / given)) == actor


def test_the_critic_is_reached_through_its_own_folder(tmp_path):
    _model(tmp_path / "global_step_4" / "actor" / "model")
    critic = _model(tmp_path / "global_step_4" / "critic" / "model")
    assert find_megatron_model(str(tmp_path / "global_step_4" / "critic")) == critic


def test_a_step_with_one_role_gives_that_role(tmp_path):
    only = _model(tmp_path / "global_step_1" / "critic" / "model")
    assert find_megatron_model(str(tmp_path / "global_step_1")) == only


def test_a_step_with_several_roles_and_no_actor_names_each(tmp_path):
    step = tmp_path / "global_step_1"
    for role in ("critic", "reward"):
        _model(step / role / "model")
    with pytest.raises(ValueError) as info:
        find_megatron_model(str(step))
    assert str(info.value) == (f"{step} holds the models of critic, reward; pass one of them: "
                               f"{step}/critic/model or {step}/reward/model")


def test_a_checkpoint_root_names_its_newest_step(tmp_path):
    for step in (2, 10, 9):
        _model(tmp_path / f"global_step_{step}" / "actor" / "model")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10")
    with pytest.raises(ValueError) as info:
        find_megatron_model(str(tmp_path))
    newest = tmp_path / "global_step_10"
    assert str(info.value) == (f"{tmp_path} holds the checkpoints of 3 training step(s); pass one step, e.g. the "
                               f"newest: --megatron-dir {newest} (its actor model, {newest}/actor/model)")


def test_anything_else_is_left_to_the_checkpoint_reader(tmp_path):
    (tmp_path / "hf").mkdir()
    assert find_megatron_model(str(tmp_path / "hf")) == str(tmp_path / "hf")
    assert find_megatron_model(str(tmp_path / "nope")) == str(tmp_path / "nope")
