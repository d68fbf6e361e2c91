"""Metric loggers: JSONL and TensorBoard files, console lines, rank-0 only, missing packages."""

from __future__ import annotations

import importlib.util
import json
import logging
import os

import pytest
import torch

from verl.trainer.tracking import LOGGERS, Tracking, format_metrics, progress_bar


def test_jsonl_and_tensorboard_files(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="verl.metrics"):
        with Tracking(
            backends=["console", "jsonl", "tensorboard"],
            project_name="p",
            experiment_name="e",
            log_dir=str(tmp_path),
            rank=0,
        ) as tracking:
            tracking.log(
                {"train/loss": torch.tensor(1.5), "train/lr": 1e-5, "note": "text is skipped"}, step=1
            )
            tracking.log({"train/loss": 0.75, "val/loss": 0.5}, step=2)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [
        {"step": 1, "train/loss": 1.5, "train/lr": 1e-5},
        {"step": 2, "train/loss": 0.75, "val/loss": 0.5},
    ]
    assert "step 2 | train/loss 0.7500 | val/loss 0.5000" in caplog.text

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb_dir = tmp_path / "tensorboard"
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tb_dir))
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert loss == [(1, 1.5), (2, 0.75)]


def test_jsonl_appends_on_resume(tmp_path):
    for step in (1, 2):
        with Tracking(
            backends=["jsonl"], project_name="p", experiment_name="e", log_dir=str(tmp_path), rank=0
        ) as t:
            t.log({"x": float(step)}, step=step)
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
    ]


def test_rewind_drops_the_steps_a_resumed_run_redoes(tmp_path, caplog):
    """A run killed after logging step 4 resumes from its step-2 checkpoint: metrics.jsonl and
    TensorBoard keep steps 1-2 and show the re-done 3-4 once (a line cut short by the kill goes)."""
    kw = dict(backends=["jsonl", "tensorboard"], project_name="p", experiment_name="e", log_dir=str(tmp_path), rank=0)
    with Tracking(**kw) as t:
        for step in (1, 2, 3, 4):
            t.log({"x": float(step)}, step=step)
    with open(tmp_path / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write('{"step": 5, "x": 5')  # killed mid-write
    with caplog.at_level(logging.WARNING, logger="verl.trainer.tracking"), Tracking(**kw) as t:
        t.rewind(2)
        for step in (3, 4):
            t.log({"x": 10.0 * step}, step=step)
    assert "dropped 3 records after step 2" in caplog.text
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["x"]) for r in lines] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("x")] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    with Tracking(**kw) as t:  # nothing after the step: the file is left as it is
        before = (tmp_path / "metrics.jsonl").read_bytes()
        t.rewind(4)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before


def test_only_rank0_writes(tmp_path):
    with Tracking(
        backends=["jsonl"], project_name="p", experiment_name="e", log_dir=str(tmp_path), rank=1
    ) as t:
        t.log({"x": 1.0}, step=1)
    assert not (tmp_path / "metrics.jsonl").exists()
    bar = progress_bar(total=3, rank=1)
    bar.update(1)
    bar.close()


def test_unknown_and_missing_loggers(tmp_path):
    with pytest.raises(ValueError, match=r"unknown logger\(s\) \['wandbb'\]"):
        Tracking(backends=["wandbb"], project_name="p", experiment_name="e", log_dir=str(tmp_path), rank=0)
    for name in ("wandb", "mlflow"):
        if importlib.util.find_spec(name) is None:
            with pytest.raises(ValueError, match=rf"'{name}' package is not installed; `pip install {name}`"):
                Tracking(
                    backends=[name], project_name="p", experiment_name="e", log_dir=str(tmp_path), rank=0
                )
    assert {"console", "jsonl", "tensorboard", "wandb", "mlflow"} <= set(LOGGERS)


def test_format_metrics_is_readable():
    assert format_metrics({"b": 2.0, "a": 1.23456, "lr": 1e-6, "big": 123456.0}, 7) == (
        "step 7 | a 1.2346 | b 2 | big 1.235e+05 | lr 1.000e-06"
    )


# ----------------------------------------------------------------------------------------------
# progress: a bar only on a terminal with a width, a periodic log line everywhere else


def _pty_stream(columns: int):
    """(a text stream on a pseudo-terminal of ``columns`` x 24, the master fd to read what it got)."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    return os.fdopen(slave, "w", buffering=1), master


def _drain(master: int) -> str:
    import select

    out = b""
    while select.select([master], [], [], 0.2)[0]:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    return out.decode("utf-8", "replace")


def _steps(bar, n: int) -> None:
    for i in range(n):
        bar.set_postfix(loss=f"{1.0 / (i + 1):.2f}")
        bar.update(1)
    bar.close()


def test_a_bar_is_drawn_on_a_terminal_with_a_width(monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    stream, master = _pty_stream(100)
    try:
        bar = progress_bar(total=3, desc="sft", rank=0, stream=stream)
        _steps(bar, 3)
        drawn = _drain(master)
    finally:
        stream.close()
        os.close(master)
    assert "\r" in drawn and "sft: 100%" in drawn and "3/3" in drawn and "loss=0.33" in drawn


@pytest.mark.parametrize("where", ["log file", "zero-width terminal", "TQDM_DISABLE", "turned off"])
def test_elsewhere_progress_is_a_log_line_without_carriage_returns(where, tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    master = None
    if where == "log file":
        stream = open(tmp_path / "log", "w")  # noqa: SIM115
    else:
        stream, master = _pty_stream(0 if where == "zero-width terminal" else 100)
    if where == "TQDM_DISABLE":
        monkeypatch.setenv("TQDM_DISABLE", "1")
    try:
        with caplog.at_level(logging.INFO, logger="verl.progress"):
            # log_every_s=0: a line per step here (30 s apart in a run), the last one always.
            bar = progress_bar(total=3, initial=1, desc="sft", rank=0, stream=stream,
                               enabled=where != "turned off", log_every_s=0.0)
            _steps(bar, 2)
        stream.flush()
        written = _drain(master) if master is not None else (tmp_path / "log").read_text()
    finally:
        stream.close()
        if master is not None:
            os.close(master)
    assert written == ""  # nothing but the log records: no bar frames
    lines = [r.getMessage() for r in caplog.records if r.name == "verl.progress"]
    assert len(lines) == 2 and lines[0].startswith("sft: step 2/3 (67%), 0:00:00 elapsed, ")
    assert " left, " in lines[0] and lines[0].endswith("loss=1.00")
    assert lines[1].startswith("sft: step 3/3 (100%)") and " left" not in lines[1] and lines[1].endswith("loss=0.50")
