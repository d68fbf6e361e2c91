"""verl.utils.paths and verl.utils.cli: what each wrong path or number is called."""

from __future__ import annotations

import argparse
import os

import pytest

from verl.utils.cli import error_message, non_negative_float, non_negative_int, positive_float, positive_int
from verl.utils.outputs import check_output_apart
from verl.utils.paths import check_dir, check_model_dir, load_json_object


def test_model_dir_messages(tmp_path):
    with pytest.raises(ValueError, match=r"^model\.path is not set; give a Hugging Face model directory"):
        check_model_dir(None, "model.path")
    with pytest.raises(ValueError, match=f"^model.path='{tmp_path}/x' does not exist; give a Hugging Face"):
        check_model_dir(str(tmp_path / "x"), "model.path")
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match=f"^'{tmp_path}/f' is not a directory"):
        check_model_dir(str(tmp_path / "f"), None)  # a flag: argparse adds its name
    with pytest.raises(ValueError, match=f"^model.path='{tmp_path}' has no config.json; give a Hugging Face model "
                                         "directory$"):
        check_model_dir(str(tmp_path), "model.path")
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(ValueError, match=r"config\.json: expected a JSON object, got a list"):
        check_model_dir(str(tmp_path), "model.path")
    (tmp_path / "config.json").write_text("{}")
    assert check_model_dir(str(tmp_path), "model.path") == str(tmp_path)


def test_home_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m").mkdir()
    assert check_dir("~/m", "k", fix="fix it") == str(tmp_path / "m")


def test_json_errors_name_file_and_line(tmp_path):
    path = tmp_path / "a.json"
    path.write_text('{\n  "a": 1,\n}')
    with pytest.raises(ValueError, match=f"^{path} is not valid JSON \\(line 3, column 1: Expecting property name"):
        load_json_object(str(path))


@pytest.mark.parametrize(
    ("output", "relation"), [("in", "is"), ("in/sub", "is inside"), (".", "contains")]
)
def test_output_apart_from_inputs(tmp_path, output, relation):
    (tmp_path / "in").mkdir()
    out = os.path.normpath(tmp_path / output)
    with pytest.raises(ValueError, match=f"^--out={out} {relation} the input --in={tmp_path}/in; writing there would replace"):
        check_output_apart(out, "--out", {"--in": str(tmp_path / "in")})
    check_output_apart(str(tmp_path / "in-2"), "--out", {"--in": str(tmp_path / "in")})  # a sibling is fine


def test_symlinked_output_is_its_target(tmp_path):
    (tmp_path / "in").mkdir()
    os.symlink(tmp_path / "in", tmp_path / "link")
    with pytest.raises(ValueError, match="is the input"):
        check_output_apart(str(tmp_path / "link"), "--out", {"--in": str(tmp_path / "in")})


@pytest.mark.parametrize(
    ("kind", "text", "message"),
    [
        (positive_int, "0", "must be >= 1, got 0"),
        (positive_int, "2.5", "expected a whole number, got '2.5'"),
        (non_negative_int, "-1", "must be >= 0, got -1"),
        (positive_float, "0", "must be > 0, got 0"),
        (positive_float, "inf", "expected a finite number, got 'inf'"),
        (non_negative_float, "nan", "expected a finite number, got 'nan'"),
        (non_negative_float, "x", "expected a number, got 'x'"),
    ],
)
def test_number_types(kind, text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=f"^{message}$"):
        kind(text)


def test_error_message_of_an_os_error(tmp_path):
    try:
        open(tmp_path / "nope")
    except OSError as exc:
        assert error_message(exc) == f"{tmp_path}/nope: No such file or directory"
    assert error_message(ValueError("x")) == "x"


@pytest.mark.parametrize("rank", ["0", "1"])
def test_user_errors_print_one_line_on_rank_0_and_exit_2(capsys, monkeypatch, rank):
    from verl.utils.cli import user_errors

    monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as exc, user_errors("prog"):
        raise ValueError("data.x is wrong; fix it")
    assert exc.value.code == 2
    assert capsys.readouterr().err == ("prog: error: data.x is wrong; fix it\n" if rank == "0" else "")
    with pytest.raises(KeyError), user_errors("prog"):  # a bug keeps its traceback
        raise KeyError("x")
