"""``python -m verl.trainer.main_sft`` refuses bad configs before building anything (exit 2, named field)."""

from __future__ import annotations

import os

import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl.trainer.main_sft import PROG, main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_wrong_key_suggests_the_right_one(capsys):
    err = _run(capsys, ["model.pth=/tmp/x"])
    assert "model.pth" in err and "did you mean" in err and "model.path" in err


def test_missing_model_path(capsys, arithmetic_files):
    err = _run(capsys, [f"data.train_files={arithmetic_files['train']}", "data.val_files=null"])
    assert "model.path is not set" in err


def test_model_dir_without_config(capsys, tmp_path, arithmetic_files):
    err = _run(
        capsys,
        [f"model.path={tmp_path}", f"data.train_files={arithmetic_files['train']}", "data.val_files=null"],
    )
    assert f"model.path={str(tmp_path)!r} has no config.json" in err


def test_missing_data_file(capsys, tiny_model_dir, tmp_path):
    err = _run(
        capsys,
        [f"model.path={tiny_model_dir}", f"data.train_files={tmp_path}/nope.parquet", "data.val_files=null"],
    )
    assert f"data.train_files: {tmp_path}/nope.parquet does not exist" in err


def test_layout_does_not_fit_the_world(capsys, tiny_model_dir, arithmetic_files):
    # Started without torchrun the world is one process; TP=2 cannot fit.
    err = _run(
        capsys,
        [
            f"model.path={tiny_model_dir}",
            f"data.train_files={arithmetic_files['train']}",
            "megatron.tensor_model_parallel_size=2",
        ],
    )
    assert "tensor_model_parallel_size=2" in err and "world size 1" in err


def test_help_lists_the_sft_options(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for key in (
        "data.micro_batch_size_per_gpu",
        "trainer.max_ckpt_to_keep",
        "trainer.save_hf",
        "optim.lr_warmup_steps",
    ):
        assert key in out


def _outputs_run(capsys, tiny_model_dir, arithmetic_files, *extra: str) -> str:
    return _run(capsys, [f"model.path={tiny_model_dir}", f"data.train_files={arithmetic_files['train']}",
                         "data.val_files=null", *extra])


def _listing(path) -> dict[str, bytes]:
    return {name: open(os.path.join(path, name), "rb").read() for name in sorted(os.listdir(path))}


def test_exporting_onto_the_model_is_refused_before_anything_is_built(capsys, tiny_model_dir, arithmetic_files):
    before = _listing(tiny_model_dir)
    err = _outputs_run(capsys, tiny_model_dir, arithmetic_files, f"trainer.hf_export_dir={tiny_model_dir}")
    assert f"trainer.hf_export_dir={tiny_model_dir} is the input model.path={tiny_model_dir}" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert _listing(tiny_model_dir) == before


def test_exporting_onto_a_users_directory_or_the_checkpoints_is_refused(
    capsys, tiny_model_dir, arithmetic_files, tmp_path
):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    err = _outputs_run(capsys, tiny_model_dir, arithmetic_files, f"trainer.hf_export_dir={mine}",
                       f"trainer.default_local_dir={tmp_path}/ckpt")
    assert f"trainer.hf_export_dir={mine} already exists, is not empty and was not written by verl" in err
    assert (mine / "notes.txt").read_text() == "keep me"
    err = _outputs_run(capsys, tiny_model_dir, arithmetic_files, f"trainer.hf_export_dir={tmp_path}",
                       f"trainer.default_local_dir={tmp_path}/ckpt", f"trainer.log_dir={tmp_path}/logs")
    assert f"trainer.hf_export_dir={tmp_path} contains trainer.default_local_dir={tmp_path}/ckpt" in err


@pytest.mark.parametrize("key", ["trainer.default_local_dir", "trainer.log_dir"])
def test_an_unwritable_output_location_fails_at_start_up(capsys, tiny_model_dir, arithmetic_files, tmp_path, key):
    (tmp_path / "file").write_text("")
    bad = f"{tmp_path}/file/sub"
    settings = {"trainer.default_local_dir": f"{tmp_path}/ckpt", "trainer.log_dir": f"{tmp_path}/logs", key: bad}
    err = _outputs_run(capsys, tiny_model_dir, arithmetic_files, "trainer.save_freq=10", "trainer.logger=[jsonl]",
                       *(f"{k}={v}" for k, v in settings.items()))
    # A folder below a file is refused when the config is built (one line naming the key, the file and the fix).
    assert f"{key}={bad} lies inside {tmp_path}/file, which is a file, not a folder" in err
    assert "choose a folder path, new or existing" in err and err.count("\n") == 2  # the error line and the --help hint


def test_model_dir_that_does_not_exist(capsys, tmp_path, arithmetic_files):
    err = _run(capsys, [f"model.path={tmp_path}/nope", f"data.train_files={arithmetic_files['train']}",
                        "data.val_files=null"])
    assert err == (f"{PROG}: error: model.path='{tmp_path}/nope' does not exist; give a Hugging Face model "
                   "directory (config.json + weights)\n")


def test_model_path_that_is_a_file(capsys, tiny_model_dir, arithmetic_files):
    err = _run(capsys, [f"model.path={tiny_model_dir}/config.json", f"data.train_files={arithmetic_files['train']}"])
    assert f"model.path='{tiny_model_dir}/config.json' is not a directory" in err


def test_model_dir_one_level_up_suggests_the_model(capsys, tmp_path, arithmetic_files):
    (tmp_path / "huggingface").mkdir()
    (tmp_path / "huggingface" / "config.json").write_text("{}")
    err = _run(capsys, [f"model.path={tmp_path}", f"data.train_files={arithmetic_files['train']}"])
    assert f"model.path='{tmp_path}' has no config.json; give a Hugging Face model directory; did you mean " \
           f"'{tmp_path}/huggingface'?" in err


def test_broken_config_json_names_the_file(capsys, tmp_path, arithmetic_files):
    (tmp_path / "config.json").write_text('{"model_type": "qwen2",')
    err = _run(capsys, [f"model.path={tmp_path}", f"data.train_files={arithmetic_files['train']}"])
    assert f"{tmp_path}/config.json is not valid JSON (line 1, column 24" in err


def test_resume_from_path_without_resume_mode(capsys):
    err = _run(capsys, ["trainer.resume_from_path=ckpt/global_step_3"])
    assert "trainer.resume_from_path='ckpt/global_step_3' is ignored with trainer.resume_mode=auto; set " \
           "trainer.resume_mode=resume_path" in err


def _subprocess(args: list[str], cwd: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "verl.trainer.main_sft", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300)


def test_two_ranks_declared_without_torchrun_reports_the_world_size(tmp_path, tiny_model_dir, arithmetic_files):
    # The tiny config's batch (64 = micro 64 x dp 1) would not divide over the declared dp 2;
    # the real mistake is the launch, and that is the one line shown.
    proc = _subprocess(["--config", "sft_tiny_cpu", "trainer.n_gpus_per_node=2", f"model.path={tiny_model_dir}",
                        f"data.train_files={arithmetic_files['train']}"], str(tmp_path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[0] == (
        f"{PROG}: error: the launched world size 1 differs from trainer.nnodes=1 x trainer.n_gpus_per_node=2 = 2; "
        "launch 2 processes (torchrun --nnodes=1 --nproc_per_node=2) or set trainer.n_gpus_per_node=1 to match "
        "the launcher"
    )


def test_a_bad_row_is_found_when_the_data_is_loaded(tmp_path, tiny_model_dir, arithmetic_files):
    # sft_tiny_cpu reads the response from extra_info.answer; one row without it fails at load,
    # before the first step, with one line naming file, row and field, and nothing is written.
    rows = pq.read_table(arithmetic_files["val"]).to_pylist()
    rows[17]["extra_info"] = None
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), bad)
    run = tmp_path / "run"
    run.mkdir()
    proc = _subprocess(["--config", "sft_tiny_cpu", f"model.path={tiny_model_dir}", f"data.train_files={bad}",
                        "data.val_files=null", "trainer.save_hf=false", "trainer.logger=[console]"], str(run))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"{PROG}: error: {bad}: row 17: field 'extra_info' is null (needed for 'extra_info.answer'); fix the file or "
        "point the config's key at the right field"
    )
    assert os.listdir(run) == []


def test_tokenizer_path_that_does_not_exist(capsys, tiny_model_dir, tmp_path, arithmetic_files):
    err = _run(capsys, [f"model.path={tiny_model_dir}", f"model.tokenizer_path={tmp_path}/tok",
                        f"data.train_files={arithmetic_files['train']}"])
    assert err == (f"{PROG}: error: model.tokenizer_path='{tmp_path}/tok' does not exist; give the tokenizer "
                   "directory, or leave it unset to use model.path's\n")


# -- outputs that overlap the inputs, or an earlier run's outputs ---------------------------------


def _tree(path) -> dict[str, bytes]:
    """Every file under ``path`` (relative name -> bytes), to show nothing was changed."""
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            out[os.path.relpath(full, path)] = open(full, "rb").read()
    return out


@pytest.mark.parametrize(
    ("key", "where", "relation", "input_key"),
    [
        ("trainer.log_dir", "model", "is the input", "model.path"),
        ("trainer.log_dir", "data", "contains the input", "data files"),
        ("trainer.default_local_dir", "model", "is the input", "model.path"),
        ("trainer.default_local_dir", "model/ckpt", "is inside the input", "model.path"),
        ("trainer.log_dir", "model/logs", "is inside the input", "model.path"),
    ],
)
def test_checkpoints_or_logs_in_an_input_are_refused_before_anything_is_built(
    capsys, tiny_model_dir, arithmetic_files, tmp_path, key, where, relation, input_key
):
    """The logs in the model's folder replaced its config.json with the run's (the model no longer
    loaded); checkpoints or logs in the data's folder mix the run's files into the user's."""
    folders = {"model": tiny_model_dir, "data": os.path.dirname(arithmetic_files["train"])}
    top, _, sub = where.partition("/")
    target = os.path.join(folders[top], sub) if sub else folders[top]
    before = _tree(folders[top])
    settings = {"trainer.default_local_dir": f"{tmp_path}/ckpt", "trainer.log_dir": f"{tmp_path}/logs", key: target}
    err = _outputs_run(capsys, tiny_model_dir, arithmetic_files, "trainer.save_freq=10", "trainer.logger=[jsonl]",
                       *(f"{k}={v}" for k, v in settings.items()))
    assert f"{key}={target} {relation} {input_key}=" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert _tree(folders[top]) == before


def _earlier_run(root) -> dict[str, bytes]:
    """An earlier run's checkpoints (global_step_1, global_step_2) and logs under ``root``."""
    for step in (1, 2):
        (root / "ckpt" / f"global_step_{step}").mkdir(parents=True)
        (root / "ckpt" / f"global_step_{step}" / "trainer_state.json").write_text(f'{{"global_step": {step}}}')
    (root / "logs").mkdir()
    (root / "logs" / "metrics.jsonl").write_text('{"step": 1, "train/loss": 2.5}\n{"step": 2, "train/loss": 2.1}\n')
    return _tree(root)


@pytest.mark.parametrize(
    ("resume", "kept", "expected"),
    [
        # A fresh start would replace global_step_1 and leave the earlier run's global_step_2 beside it.
        ("disable", "ckpt", "trainer.default_local_dir={root}/ckpt holds the checkpoints of an earlier run "
                            "(global_step_1, global_step_2); trainer.resume_mode=disable starts at step 0"),
        # With the checkpoints kept elsewhere, a fresh start would drop the earlier run's metrics.
        ("disable", "logs", "trainer.log_dir={root}/logs holds the logs of an earlier run (metrics.jsonl); "
                            "this run starts at step 0 and would delete them"),
        ("auto", "logs", "trainer.log_dir={root}/logs holds the logs of an earlier run (metrics.jsonl)"),
    ],
)
def test_a_run_from_step_0_into_an_earlier_runs_outputs_is_refused(
    capsys, tiny_model_dir, arithmetic_files, tmp_path, resume, kept, expected
):
    before = _earlier_run(tmp_path)
    ckpt = f"{tmp_path}/ckpt" if kept == "ckpt" else f"{tmp_path}/new_ckpt"
    err = _outputs_run(capsys, tiny_model_dir, arithmetic_files, "trainer.save_freq=1", "trainer.logger=[jsonl]",
                       f"trainer.resume_mode={resume}", f"trainer.default_local_dir={ckpt}",
                       f"trainer.log_dir={tmp_path}/logs")
    assert expected.format(root=tmp_path) in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert _tree(tmp_path) == before
