"""``python -m verl.trainer.main_sft`` refuses bad configs before building anything (exit 2, named field)."""

from __future__ import annotations

import os

import pytest

from verl.trainer.main_sft import main


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
    assert f"trainer.hf_export_dir={tiny_model_dir} is model.path={tiny_model_dir}" in err
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
    assert f"{key}={bad} cannot be written" in err
