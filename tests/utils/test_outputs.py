"""``verl.utils.outputs``: an output location never destroys an input, another output or a user's files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from verl.utils.outputs import (
    MARKER_FILE,
    OutputPathError,
    check_output_dir,
    commit_output,
    probe_writable,
    staging_dir,
)


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "tokenizer.json").write_text("{}")
    return path


@pytest.mark.parametrize(
    ("target", "relation"),
    [("model", "is"), ("model/export", "is inside"), (".", "contains")],
    ids=["equal", "inside", "contains"],
)
def test_an_output_may_not_overlap_an_input(tmp_path, model, target, relation):
    path = str(tmp_path / target)
    with pytest.raises(OutputPathError, match=rf"--out-dir={path} {relation} the input --hf-dir={model}; writing there"):
        check_output_dir(path, key="--out-dir", inputs={"--hf-dir": str(model)}, overwrite=True)
    assert sorted(os.listdir(model)) == ["config.json", "tokenizer.json"]


def test_overlap_is_found_through_symlinks_and_user_paths(tmp_path, model):
    link = tmp_path / "link"
    link.symlink_to(model)
    with pytest.raises(OutputPathError, match="is the input model.path"):
        check_output_dir(str(link), key="x", inputs={"model.path": str(model)})
    with pytest.raises(OutputPathError, match="is inside the input data files"):
        check_output_dir(str(model / "a"), key="x", inputs={"data files": [str(tmp_path / "nope"), str(model)]})


def test_an_output_may_lie_inside_but_not_hold_another_output(tmp_path):
    ckpt = tmp_path / "ckpt"
    check_output_dir(str(ckpt / "huggingface"), key="x", protected={"trainer.default_local_dir": str(ckpt)})
    for target, relation in ((ckpt, "is"), (tmp_path, "contains")):
        with pytest.raises(OutputPathError, match=rf"{relation} trainer.default_local_dir={ckpt}: replacing it"):
            check_output_dir(str(target), key="x", protected={"trainer.default_local_dir": str(ckpt)})


def test_a_users_non_empty_directory_is_refused_even_with_overwrite(tmp_path):
    """--overwrite onto a folder verl did not write deleted the user's files in it: it is refused too."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    for replace in (False, True):
        with pytest.raises(OutputPathError, match=r"already exists, is not empty and was not written by verl \(it holds notes.txt\)"):
            check_output_dir(str(mine), key="trainer.hf_export_dir", replace_verl_outputs=replace)
    with pytest.raises(OutputPathError, match=r"was not written by verl \(it holds notes.txt\); --overwrite replaces only a folder verl wrote"):
        check_output_dir(str(mine), key="--out-dir", overwrite=True)
    (tmp_path / "empty").mkdir()
    check_output_dir(str(tmp_path / "empty"), key="x")
    assert check_output_dir(str(tmp_path / "empty"), key="x", overwrite=True) == str(tmp_path / "empty")
    (tmp_path / "file").write_text("")
    with pytest.raises(OutputPathError, match="exists and is not a directory"):
        check_output_dir(str(tmp_path / "file"), key="x", overwrite=True)
    assert (mine / "notes.txt").read_text() == "keep me"


def test_a_verl_output_is_named_as_such_and_replaced_when_asked(tmp_path):
    """Without --overwrite the tools said a folder verl wrote was "not written by verl"."""
    out = tmp_path / "out"
    tmp = staging_dir(str(out))
    (Path(tmp) / "model.safetensors").write_text("weights")
    commit_output(tmp, str(out), what="Hugging Face checkpoint (tools/megatron2hf.py)")
    with pytest.raises(OutputPathError) as exc:
        check_output_dir(str(out), key="--out-dir")
    assert str(exc.value) == (
        f"--out-dir={out} holds an earlier Hugging Face checkpoint (tools/megatron2hf.py) written by verl; pass "
        "--overwrite to replace it (once the new one is complete) or choose another --out-dir (nothing was changed)"
    )
    assert check_output_dir(str(out), key="--out-dir", overwrite=True) == str(out)
    assert check_output_dir(str(out), key="trainer.hf_export_dir", replace_verl_outputs=True) == str(out)


def test_staging_and_commit_replace_a_verl_output_only_once_the_new_one_is_complete(tmp_path):
    out = tmp_path / "export"
    first = staging_dir(str(out))
    assert os.path.dirname(first) == str(tmp_path) and os.path.basename(first).startswith(".export.partial-")
    (tmp_path / first / "model.safetensors").write_text("one")
    commit_output(first, str(out), what="test")
    assert (out / MARKER_FILE).is_file() and not os.path.exists(first)
    # A second export may replace it without --overwrite (verl wrote it) ...
    check_output_dir(str(out), key="x", replace_verl_outputs=True)
    second = staging_dir(str(out))
    assert (out / "model.safetensors").read_text() == "one"  # still the old one while the new is written
    (tmp_path / second / "model.safetensors").write_text("two")
    commit_output(second, str(out), what="test")
    assert (out / "model.safetensors").read_text() == "two"
    assert sorted(os.listdir(tmp_path)) == ["export"]  # no staging or old copies left
    # ... but a converter, which replaces only with --overwrite, still refuses.
    with pytest.raises(OutputPathError, match="holds an earlier test written by verl; pass --overwrite"):
        check_output_dir(str(out), key="--out-dir")


def test_probe_finds_unwritable_locations_at_start_up(tmp_path):
    probe_writable(str(tmp_path / "new" / "deep"), key="trainer.default_local_dir")
    assert not (tmp_path / "new").exists()  # created, written, and removed again: nothing is left
    (tmp_path / "kept").mkdir()
    probe_writable(str(tmp_path / "kept"), key="trainer.log_dir")
    assert (tmp_path / "kept").is_dir() and os.listdir(tmp_path / "kept") == []  # what existed stays
    (tmp_path / "file").write_text("")
    with pytest.raises(OutputPathError, match=rf"trainer.log_dir={tmp_path}/file/logs cannot be written"):
        probe_writable(str(tmp_path / "file" / "logs"), key="trainer.log_dir")


def test_probes_of_one_path_by_many_ranks_at_once_all_succeed(tmp_path):
    """Every rank of a torchrun job probes the same log directory at start-up; one rank's clean-up
    (removing the directory it created) must not fail another rank's probe."""
    import threading

    target = str(tmp_path / "run" / "logs")
    errors = []

    def probe_many():
        for _ in range(300):
            try:
                probe_writable(target, key="trainer.log_dir")
            except OutputPathError as exc:
                errors.append(exc)
                return

    threads = [threading.Thread(target=probe_many) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert not os.path.exists(tmp_path / "run")


def test_a_checkpoint_root_may_hold_an_input_beside_the_entries_it_writes(tmp_path):
    """The Python API keeps ``output_dir/model_init/`` (the model object it wrote) beside the
    checkpoints in ``output_dir``: the checkpoints replace only ``global_step_N/`` (and their staging
    copies, the tracker, the default ``huggingface/`` export), so an input elsewhere in the root is safe."""
    from verl.config import PPOConfig, load_config
    from verl.trainer.run_checks import check_run_outputs

    root = tmp_path / "out"
    (root / "model_init").mkdir(parents=True)
    cfg = load_config(PPOConfig, overrides=[f"trainer.default_local_dir={root}", f"trainer.log_dir={root}/logs",
                                            "trainer.save_freq=1", "trainer.n_gpus_per_node=1"], world_size=1)
    check_run_outputs(cfg.trainer, inputs={"actor_rollout_ref.model.path": str(root / "model_init")})
    for entry in ("global_step_3", ".tmp_global_step_3", "huggingface"):
        with pytest.raises(OutputPathError, match=r"trainer.default_local_dir=.* contains the input"):
            check_run_outputs(cfg.trainer, inputs={"actor_rollout_ref.model.path": str(root / entry / "model")})


def test_a_file_the_user_put_in_a_verl_output_is_never_deleted_by_a_replace(tmp_path):
    """#58: ``tools/megatron2hf.py --overwrite`` onto a folder verl exported, into which the user had
    since put a file of their own, deleted that file without a word."""
    out = tmp_path / "hf"
    tmp = staging_dir(str(out))
    (Path(tmp) / "model.safetensors").write_text("weights")
    commit_output(tmp, str(out), what="Hugging Face checkpoint (tools/megatron2hf.py)")
    (out / "notes.md").write_text("mine")
    for kwargs in ({"overwrite": True}, {"replace_verl_outputs": True}):
        with pytest.raises(OutputPathError) as exc:
            check_output_dir(str(out), key="--out-dir", **kwargs)
        assert str(exc.value) == (
            f"--out-dir={out} holds notes.md, which verl did not write (added after its Hugging Face checkpoint "
            "(tools/megatron2hf.py) written by verl); replacing the folder would delete it: move it out, or choose "
            "another --out-dir (nothing was changed)"
        )
    assert (out / "notes.md").read_text() == "mine"
    # Put there after the start-up check (a trainer's export at the end of a long run): kept, not deleted.
    new = staging_dir(str(out))
    (Path(new) / "model.safetensors").write_text("new weights")
    commit_output(new, str(out), what="test")
    assert (out / "notes.md").read_text() == "mine" and (out / "model.safetensors").read_text() == "new weights"
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def _run_trainer(tmp_path, log_dir):
    from verl.config import PPOConfig, load_config

    return load_config(PPOConfig, overrides=[f"trainer.default_local_dir={tmp_path}/ckpt", f"trainer.log_dir={log_dir}",
                                             "trainer.logger=[console,jsonl]", "trainer.n_gpus_per_node=1"],
                       world_size=1).trainer


def test_a_log_dir_holding_a_file_verl_did_not_write_is_refused(tmp_path, model):
    """#58: ``trainer.log_dir`` at a model folder (not an input of the run) exited 0 and replaced its
    ``config.json`` with the run's config."""
    from verl.trainer.run_checks import check_run_outputs

    with pytest.raises(OutputPathError) as exc:
        check_run_outputs(_run_trainer(tmp_path, model), inputs={})
    assert str(exc.value) == (
        f"trainer.log_dir={model} holds config.json, which verl did not write (a model's or another tool's?); this "
        "run would replace it: choose a trainer.log_dir of its own, e.g. an empty folder (nothing was changed)"
    )
    assert (model / "config.json").read_text() == "{}"
    # Files verl never writes may sit beside its logs; a run's own config.json and report are replaced.
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "train.log").write_text("stdout of the launcher")
    (logs / "config.json").write_text('{"trainer": {"project_name": "p"}}')
    check_run_outputs(_run_trainer(tmp_path, logs), inputs={})
    (logs / "report.html").write_text("<html>my page</html>")
    with pytest.raises(OutputPathError, match=r"holds report.html, which verl did not write"):
        check_run_outputs(_run_trainer(tmp_path, logs), inputs={})


def test_a_checkpoint_folder_holding_a_tracker_verl_did_not_write_is_refused(tmp_path):
    from verl.trainer.run_checks import check_run_outputs

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("my notes")
    trainer = _run_trainer(tmp_path, tmp_path / "logs")
    trainer.save_freq = 5
    with pytest.raises(OutputPathError, match=r"trainer.default_local_dir=.*/ckpt holds latest_checkpointed_iteration.txt, which verl did not write"):
        check_run_outputs(trainer, inputs={})
