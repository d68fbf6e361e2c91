"""``python -m verl.trainer.main_sft`` refuses bad configs before building anything (exit 2, named field)."""

from __future__ import annotations

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
