"""CheckpointManager: atomic saves, the tracker, keep-N, corrupt and partial checkpoints, resume modes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from verl.trainer.checkpoint import (
    MANIFEST_FILE,
    TRACKER_FILE,
    CheckpointError,
    CheckpointManager,
)


def _writer(payload: str):
    def write(tmp: str) -> None:
        os.makedirs(os.path.join(tmp, "actor"))
        with open(os.path.join(tmp, "actor", "weights.bin"), "w") as f:
            f.write(payload)

    return write


def _tracker(root) -> str:
    return (root / TRACKER_FILE).read_text().strip()


def test_save_layout_tracker_and_state(tmp_path):
    mgr = CheckpointManager(str(tmp_path))
    path = mgr.save(3, _writer("a"), {"dataloader": {"epoch": 0, "offset": 12}})
    assert path == str(tmp_path / "global_step_3")
    assert _tracker(tmp_path) == "3"
    assert sorted(os.listdir(tmp_path)) == ["global_step_3", TRACKER_FILE]  # no temp left behind
    assert mgr.validate(path) == 3
    state = mgr.read_trainer_state(path)
    assert state == {"dataloader": {"epoch": 0, "offset": 12}, "global_step": 3}
    found = mgr.latest()
    assert (found.step, found.path) == (3, path)


def test_keep_last_n(tmp_path):
    mgr = CheckpointManager(str(tmp_path), max_to_keep=2)
    for step in (1, 2, 3, 4, 5):
        mgr.save(step, _writer(str(step)), {})
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("global_step")) == [
        "global_step_4",
        "global_step_5",
    ]
    assert _tracker(tmp_path) == "5"
    with pytest.raises(ValueError, match="max_to_keep"):
        CheckpointManager(str(tmp_path), max_to_keep=0)


def test_failed_write_keeps_previous_checkpoint(tmp_path):
    mgr = CheckpointManager(str(tmp_path))
    mgr.save(1, _writer("good"), {})

    def broken(tmp: str) -> None:
        _writer("half")(tmp)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        mgr.save(2, broken, {})
    # Step 2 never became visible; the tracker still names step 1, which is intact.
    assert not (tmp_path / "global_step_2").exists()
    assert _tracker(tmp_path) == "1"
    assert mgr.latest().step == 1
    # The next save clears the debris of the failed one.
    mgr.save(2, _writer("good2"), {})
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp_")]
    assert mgr.latest().step == 2


def test_killed_process_loses_nothing(tmp_path):
    """SIGKILL in the middle of writing step 2: step 1 and the tracker survive untouched."""
    root = tmp_path / "ckpt"
    script = textwrap.dedent(
        f"""
        import os, sys, time
        from verl.trainer.checkpoint import CheckpointManager
        mgr = CheckpointManager({str(root)!r})
        def write(payload, hang):
            def fn(tmp):
                os.makedirs(os.path.join(tmp, "actor"))
                with open(os.path.join(tmp, "actor", "weights.bin"), "w") as f:
                    f.write(payload)
                if hang:
                    print("WRITING", flush=True)
                    time.sleep(60)
            return fn
        mgr.save(1, write("one", False), {{}})
        mgr.save(2, write("two", True), {{}})
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        line = ""
        while "WRITING" not in line and time.time() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
        assert "WRITING" in line, "the child never reached the write of step 2"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    mgr = CheckpointManager(str(root))
    assert (root / TRACKER_FILE).read_text().strip() == "1"
    found = mgr.resolve_resume("auto", None)
    assert found.step == 1
    assert (root / "global_step_1" / "actor" / "weights.bin").read_text() == "one"
    assert not (root / "global_step_2").exists()
    assert not [p for p in os.listdir(root) if p.startswith(".tmp_")]  # resolve_resume cleared the debris


def test_corrupt_checkpoint_is_named_never_used(tmp_path):
    mgr = CheckpointManager(str(tmp_path))
    mgr.save(1, _writer("one"), {})
    mgr.save(2, _writer("two"), {})
    weights = tmp_path / "global_step_2" / "actor" / "weights.bin"
    weights.write_text("tw")  # truncated
    with pytest.raises(
        CheckpointError, match=r"global_step_2 is corrupt: actor/weights.bin has 2 bytes, the manifest says 3"
    ):
        mgr.latest()
    weights.unlink()
    with pytest.raises(CheckpointError, match=r"actor/weights.bin is missing"):
        mgr.resolve_resume("auto", None)
    # An explicit older checkpoint still works.
    assert mgr.resolve_resume("resume_path", str(tmp_path / "global_step_1")).step == 1


def test_partial_checkpoint_without_manifest(tmp_path):
    mgr = CheckpointManager(str(tmp_path))
    mgr.save(4, _writer("x"), {})
    (tmp_path / "global_step_4" / MANIFEST_FILE).unlink()
    with pytest.raises(
        CheckpointError, match=r"global_step_4 is incomplete: checkpoint_complete.json is missing"
    ):
        mgr.latest()
    with pytest.raises(CheckpointError, match="does not exist"):
        mgr.resolve_resume("resume_path", str(tmp_path / "global_step_9"))


def test_no_tracker_uses_newest_complete(tmp_path):
    mgr = CheckpointManager(str(tmp_path))
    mgr.save(1, _writer("1"), {})
    mgr.save(2, _writer("2"), {})
    mgr.save(3, _writer("3"), {})
    (tmp_path / TRACKER_FILE).unlink()
    (tmp_path / "global_step_3" / MANIFEST_FILE).unlink()  # newest is incomplete: skipped with a warning
    assert mgr.latest().step == 2


def test_resume_modes(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "run"))
    assert mgr.resolve_resume("auto", None) is None  # nothing saved yet: a fresh start
    mgr.save(5, _writer("5"), {"k": 1})
    assert mgr.resolve_resume("disable", None) is None
    assert mgr.resolve_resume("auto", None).step == 5
    with pytest.raises(CheckpointError, match="resume_from_path"):
        mgr.resolve_resume("resume_path", None)
    with pytest.raises(ValueError, match="resume_mode"):
        mgr.resolve_resume("sometimes", None)


def test_resave_same_step_replaces_atomically(tmp_path):
    mgr = CheckpointManager(str(tmp_path))
    mgr.save(2, _writer("old"), {})
    mgr.save(2, _writer("new"), {})
    assert (tmp_path / "global_step_2" / "actor" / "weights.bin").read_text() == "new"
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp_")]
    # A kill between moving the old copy aside and renaming the new one in: the old copy comes back.
    os.replace(tmp_path / "global_step_2", tmp_path / ".tmp_old_global_step_2")
    assert mgr.resolve_resume("auto", None).step == 2
    manifest = json.loads((tmp_path / "global_step_2" / MANIFEST_FILE).read_text())
    assert manifest["global_step"] == 2
