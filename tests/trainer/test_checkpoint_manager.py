"""CheckpointManager: atomic saves, the tracker, keep-N, the manifest (sizes and checksums of every
file), corrupt and partial checkpoints and the fall-back past them, resume modes."""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest
import xxhash

from verl.utils.checkpoint import (
    MANIFEST_FILE,
    TRACKER_FILE,
    TRAINER_STATE_FILE,
    CheckpointDiskFull,
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
        from verl.utils.checkpoint import CheckpointManager
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


def test_corrupt_checkpoint_is_named_and_resume_falls_back(tmp_path, caplog):
    """Changed with content checksums (#11): a tracker naming a corrupt checkpoint no longer
    stops the resume; it falls back to the previous complete one, with a warning naming it."""
    mgr = CheckpointManager(str(tmp_path))
    mgr.save(1, _writer("one"), {})
    mgr.save(2, _writer("two"), {})
    weights = tmp_path / "global_step_2" / "actor" / "weights.bin"
    weights.write_text("tw")  # truncated
    with pytest.raises(
        CheckpointError, match=r"global_step_2 is corrupt: actor/weights.bin has 2 bytes, the manifest says 3"
    ):
        mgr.validate(str(tmp_path / "global_step_2"))
    with caplog.at_level(logging.WARNING, logger="verl.utils.checkpoint"):
        assert mgr.latest().step == 1
    assert re.search(
        r"names step 2, which cannot be used .*global_step_2 is corrupt: actor/weights.bin has 2 bytes.*"
        r"resuming from the previous complete checkpoint .*global_step_1",
        caplog.text,
    )
    weights.unlink()
    with pytest.raises(CheckpointError, match=r"actor/weights.bin is missing"):
        mgr.validate(str(tmp_path / "global_step_2"))
    assert mgr.resolve_resume("auto", None).step == 1
    # Named explicitly, a corrupt checkpoint stays an error; an explicit older one works.
    with pytest.raises(CheckpointError, match=r"actor/weights.bin is missing"):
        mgr.resolve_resume("resume_path", str(tmp_path / "global_step_2"))
    assert mgr.resolve_resume("resume_path", str(tmp_path / "global_step_1")).step == 1
    # Nothing older to fall back to: an error, never a silent fresh start.
    (tmp_path / "global_step_1" / "actor" / "weights.bin").write_text("0ne")
    with pytest.raises(CheckpointError, match=r"global_step_2 is corrupt.*no earlier complete checkpoint"):
        mgr.latest()


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


def test_the_checkpoint_root_given_as_one_checkpoint_is_named_for_what_it_is(tmp_path):
    root = tmp_path / "run"
    mgr = CheckpointManager(str(root))
    mgr.save(2, _writer("2"), {})
    mgr.save(5, _writer("5"), {})
    with pytest.raises(CheckpointError) as info:
        mgr.resolve_resume("resume_path", str(root))
    message = str(info.value)
    assert f"{root} is a checkpoint directory of a run (it holds global_step_5, global_step_2)" in message
    assert f"the newest is {root}/global_step_5" in message and "interrupted" not in message
    (tmp_path / "half").mkdir()  # a step directory without its manifest is still an interrupted save
    with pytest.raises(CheckpointError, match="is incomplete: checkpoint_complete.json is missing"):
        mgr.resolve_resume("resume_path", str(tmp_path / "half"))


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


# -- the manifest: every file, its size and its checksum (#11, #19) ---------------------------


def _rich_writer(tmp: str) -> None:
    """Files of every kind an engine checkpoint holds: nested dirs, binary shards, JSON, a
    dotfile (.metadata), an empty file."""
    gen = random.Random(0)
    files = {
        "actor/model/__0_0.distcp": bytes(gen.randrange(256) for _ in range(4096)),
        "actor/model/.metadata": bytes(gen.randrange(256) for _ in range(300)),
        "actor/model/hf/config.json": b'{"hidden_size": 64}',
        "actor/optim/__0_0.distcp": bytes(gen.randrange(256) for _ in range(2048)),
        "actor/extra/rank_00000.pt": bytes(gen.randrange(256) for _ in range(777)),
        "actor/engine.json": b'{"world_size": 1}',
        "actor/model/common.pt": b"",
    }
    for rel, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(tmp, rel)), exist_ok=True)
        with open(os.path.join(tmp, rel), "wb") as f:
            f.write(data)


def _all_files(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_manifest_lists_every_file_with_its_size_and_checksum(tmp_path):
    mgr = CheckpointManager(str(tmp_path))
    path = tmp_path / "global_step_1"
    mgr.save(1, _rich_writer, {"dataloader": {"offset": 3}})
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    on_disk = [rel for rel in _all_files(path) if rel != MANIFEST_FILE]
    assert TRAINER_STATE_FILE in on_disk
    assert sorted(manifest["files"]) == on_disk
    for rel in on_disk:
        data = (path / rel).read_bytes()
        expected = {"size": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}
        assert manifest["files"][rel] == expected, rel


def flip_one_byte(file) -> None:
    data = bytearray(file.read_bytes())
    if not data:
        file.write_bytes(b"\0")  # an empty file cannot flip; it grows by one byte instead
        return
    data[len(data) // 2] ^= 0x01  # stays ASCII in JSON; same size
    file.write_bytes(bytes(data))


def each_file_flipped(path) -> Iterator[str]:
    """Each file under ``path`` in turn with one byte flipped (restored before the next); yields its path
    relative to ``path``."""
    for rel in _all_files(path):
        original = (path / rel).read_bytes()
        flip_one_byte(path / rel)
        try:
            yield rel
        finally:
            (path / rel).write_bytes(original)


def test_one_flipped_byte_in_any_file_is_refused_and_resume_falls_back(tmp_path, caplog):
    mgr = CheckpointManager(str(tmp_path))
    mgr.save(1, _rich_writer, {"k": 1})
    mgr.save(2, _rich_writer, {"k": 2})
    path = tmp_path / "global_step_2"
    assert len(_all_files(path)) == 9  # the seven written, trainer_state.json and the manifest
    for rel in each_file_flipped(path):
        with pytest.raises(CheckpointError, match=rf"global_step_2.* {re.escape(rel)}"):
            mgr.validate(str(path))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="verl.utils.checkpoint"):
            found = mgr.resolve_resume("auto", None)
        assert found.step == 1, rel
        assert "names step 2, which cannot be used" in caplog.text and rel in caplog.text, caplog.text
        with pytest.raises(CheckpointError, match=re.escape(rel)):
            mgr.resolve_resume("resume_path", str(path))
    assert mgr.validate(str(path)) == 2  # every file restored: valid again


def test_truncated_trainer_state_is_refused(tmp_path):
    mgr = CheckpointManager(str(tmp_path))
    path = mgr.save(1, _rich_writer, {"dataloader": {"epoch": 0, "offset": 12}})
    state = os.path.join(path, TRAINER_STATE_FILE)
    with open(state, "r+") as f:
        f.truncate(os.path.getsize(state) - 3)
    with pytest.raises(CheckpointError, match=r"trainer_state.json has \d+ bytes, the manifest says"):
        mgr.validate(path)


def test_file_added_after_the_save_is_refused(tmp_path):
    mgr = CheckpointManager(str(tmp_path))
    path = mgr.save(1, _rich_writer, {})
    with open(os.path.join(path, "actor", "extra", "rank_00001.pt"), "wb") as f:
        f.write(b"not saved by verl")
    with pytest.raises(CheckpointError, match=r"actor/extra/rank_00001.pt is not in the manifest"):
        mgr.validate(path)


def test_damaged_or_foreign_manifests_are_refused(tmp_path):
    mgr = CheckpointManager(str(tmp_path))
    path = mgr.save(1, _rich_writer, {})
    manifest_path = os.path.join(path, MANIFEST_FILE)
    good = json.loads(open(manifest_path).read())
    # A consistent-looking edit (a checksum replaced) without updating the manifest's own checksum.
    edited = json.loads(json.dumps(good))
    edited["files"]["actor/engine.json"]["xxh3_128"] = "0" * 32
    with open(manifest_path, "w") as f:
        json.dump(edited, f)
    with pytest.raises(CheckpointError, match="checkpoint_complete.json does not match its own checksum"):
        mgr.validate(path)
    with open(manifest_path, "w") as f:
        json.dump({**good, "version": 3}, f)
    with pytest.raises(CheckpointError, match="has version 3; this verl reads versions 1 and 2"):
        mgr.validate(path)
    with open(manifest_path, "w") as f:
        f.write('{"global_step": 1, "files": ')
    with pytest.raises(CheckpointError, match="checkpoint_complete.json is unreadable"):
        mgr.validate(path)


def test_size_only_manifest_of_an_older_verl_is_accepted_with_a_warning(tmp_path, caplog):
    mgr = CheckpointManager(str(tmp_path))
    path = mgr.save(1, _rich_writer, {})
    manifest_path = os.path.join(path, MANIFEST_FILE)
    files = json.loads(open(manifest_path).read())["files"]
    with open(manifest_path, "w") as f:
        json.dump({"global_step": 1, "files": {rel: e["size"] for rel, e in files.items()}}, f)
    with caplog.at_level(logging.WARNING, logger="verl.utils.checkpoint"):
        assert mgr.validate(path) == 1
    assert "without checksums" in caplog.text
    with open(os.path.join(path, "actor", "engine.json"), "a") as f:
        f.write(" ")
    with pytest.raises(CheckpointError, match=r"actor/engine.json has \d+ bytes, the manifest says"):
        mgr.validate(path)


def test_resaving_an_older_step_keeps_it_when_pruning(tmp_path):
    """max_to_keep with newer checkpoints on disk (a run resumed from step 10 that saves 10
    again): the step just saved is never the one pruned, and the tracker names it."""
    mgr = CheckpointManager(str(tmp_path), max_to_keep=2)
    for step in (10, 20, 30):
        mgr.save(step, _writer(str(step)), {})
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("global_step")) == [
        "global_step_20",
        "global_step_30",
    ]
    mgr.save(10, _writer("10 again"), {})
    assert _tracker(tmp_path) == "10"
    assert (tmp_path / "global_step_10" / "actor" / "weights.bin").read_text() == "10 again"
    # The oldest other checkpoint went; the newest stays (never more than max_to_keep).
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("global_step")) == [
        "global_step_10",
        "global_step_30",
    ]
    assert mgr.latest().step == 10
    one = CheckpointManager(str(tmp_path), max_to_keep=1)
    one.save(5, _writer("5"), {})
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("global_step")) == ["global_step_5"]
    assert one.latest().step == 5


def test_unusable_tracker_falls_back(tmp_path, caplog):
    mgr = CheckpointManager(str(tmp_path))
    for step in (1, 2):
        mgr.save(step, _writer(str(step)), {})
    (tmp_path / TRACKER_FILE).write_text("2\x01\n")  # not a number: ignored, newest complete used
    with caplog.at_level(logging.WARNING, logger="verl.utils.checkpoint"):
        assert mgr.latest().step == 2
    assert "not a step number" in caplog.text
    (tmp_path / TRACKER_FILE).write_text("3\n")  # names a step that is not there: the previous one
    assert mgr.latest().step == 2
    (tmp_path / TRACKER_FILE).write_text("1\n")  # a valid tracked step wins over newer ones
    assert mgr.latest().step == 1


def _distributed_body(root: str, corrupt: str | None) -> dict:
    import verl.utils.checksum as checksum
    import torch.distributed as dist

    hashed: list[str] = []
    original = checksum.file_checksum

    def recording(path):
        hashed.append(os.path.relpath(path, root))
        return original(path)

    checksum.file_checksum = recording
    try:
        mgr = CheckpointManager(root)
        if corrupt is None:
            for step in (1, 2):
                mgr.save(step, _rich_writer_per_rank, {"step": step})
            return {"hashed": hashed}
        hashed.clear()
        try:
            mgr.validate(os.path.join(root, "global_step_2"))
            error = None
        except CheckpointError as exc:
            error = str(exc)
        found = mgr.resolve_resume("auto", None)
        return {"rank": dist.get_rank(), "error": error, "found": found.step, "hashed": hashed}
    finally:
        checksum.file_checksum = original


def _rich_writer_per_rank(tmp: str) -> None:
    import torch.distributed as dist

    rank = dist.get_rank()
    if rank == 0:
        _rich_writer(tmp)
    dist.barrier()
    with open(os.path.join(tmp, "actor", "extra", f"rank_{rank:05d}.pt"), "wb") as f:
        f.write(bytes([rank]) * (1000 + rank))


@pytest.mark.distributed
def test_two_ranks_split_the_hashing_and_agree_on_the_error(tmp_path):
    from verl.testing.distributed import run_distributed

    root = str(tmp_path / "ckpt")
    saved = run_distributed(_distributed_body, 2, root, None)
    # The save of step 2 (written in .tmp_global_step_2): each rank hashed its own share of the
    # files, together every file exactly once.
    rels = [r for r in _all_files(tmp_path / "ckpt" / "global_step_2") if r != MANIFEST_FILE]
    assert "actor/extra/rank_00001.pt" in rels
    prefix = ".tmp_global_step_2" + os.sep
    shares = [[h[len(prefix):] for h in r["hashed"] if h.startswith(prefix)] for r in saved]
    assert shares[0] and shares[1] and not set(shares[0]) & set(shares[1])
    assert sorted(shares[0] + shares[1]) == rels
    flip_one_byte(tmp_path / "ckpt" / "global_step_2" / "actor" / "extra" / "rank_00001.pt")
    results = run_distributed(_distributed_body, 2, root, "rank_00001.pt")
    # Every rank raises the same error, whichever rank hashed the bad file, and both fall back.
    assert results[0]["error"] == results[1]["error"]
    expected = "global_step_2 is corrupt: actor/extra/rank_00001.pt does not hold what was saved"
    assert expected in results[0]["error"]
    assert [r["found"] for r in results] == [1, 1]
    assert results[0]["hashed"] and results[1]["hashed"]


def _unshared_body(roots: list[str]) -> dict:
    """Rank r uses ``roots[r]`` as the checkpoint root: a folder on a disk of its own node."""
    import torch.distributed as dist

    from verl.utils.checkpoint import CheckpointNotShared

    mgr = CheckpointManager(roots[dist.get_rank()])
    out = {}
    for name, call in (
        ("auto", lambda: mgr.resolve_resume("auto", None)),
        ("resume_path", lambda: mgr.resolve_resume("resume_path", mgr.step_path(2))),
        ("save", lambda: mgr.save(3, _writer("three"), {"step": 3})),
    ):
        try:
            call()
            out[name] = "no error"
        except CheckpointNotShared as exc:
            out[name] = str(exc)
    return out


@pytest.mark.distributed
def test_a_checkpoint_folder_a_rank_cannot_see_is_one_clear_error_on_every_rank(tmp_path):
    """Rank 1's checkpoint root is another (empty) folder, as a node-local disk or a relative path
    on another node would be: resuming (auto or a named path) and saving raise one message on
    every rank naming the rank that does not see the folder (before: a raw KeyError from the
    checksum split on both ranks), and the save leaves nothing behind."""
    from verl.testing.distributed import run_distributed

    shared, local = tmp_path / "shared", tmp_path / "node1-local"
    CheckpointManager(str(shared)).save(2, _writer("two"), {"step": 2})
    local.mkdir()
    results = run_distributed(_unshared_body, 2, [str(shared), str(local)])
    for name in ("auto", "resume_path"):
        for rank, result in enumerate(results):
            assert re.search(
                r"checkpoint folder \S+global_step_2 is not the same on every rank: rank 0 \(\S+\) sees it with a "
                r"manifest of \d+ bytes, but rank 1 \(\S+\) does not see it\. .*a file system all nodes share",
                result[name],
            ), (rank, name, result[name])
    assert "rank 1 (" in results[0]["save"] and "does not see it" in results[0]["save"], results[0]["save"]
    assert sorted(os.listdir(shared)) == sorted(["global_step_2", TRACKER_FILE])  # no .tmp_ left
    assert os.listdir(local) == []


# --------------------------------------------------------------------------- a full disk (#58)


def _fills_the_disk(code: int = errno.ENOSPC):
    """A write that gets some bytes out, then fails as a full disk (or quota) makes it."""

    def write(tmp: str) -> None:
        _writer("x" * 5000)(tmp)
        raise OSError(code, os.strerror(code), os.path.join(tmp, "actor", "model.bin"))

    return write


def _disk_full_line(tmp_path, step: int, reason: str = "No space left on device", written: str = r"5,000 bytes \(4.9 KiB\)") -> str:
    return (
        rf"^checkpoint of step {step} into {re.escape(str(tmp_path))}: {reason}; [\d,]+ bytes( \([\d.]+ [KMG]iB\))? "
        rf"free there now \(the unfinished checkpoint \({written} written\) was removed and the earlier checkpoints "
        r"are kept\): free space on that disk, or point trainer.default_local_dir at a folder on a disk with room$"
    )


def _only_step_1_left(tmp_path, mgr) -> None:
    assert sorted(os.listdir(tmp_path)) == ["global_step_1", TRACKER_FILE]  # the staging folder is gone
    assert _tracker(tmp_path) == "1" and mgr.validate(str(tmp_path / "global_step_1")) == 1
    assert (tmp_path / "global_step_1" / "actor" / "weights.bin").read_text() == "good"


@pytest.mark.parametrize(("code", "reason"), [(errno.ENOSPC, "No space left on device"), (errno.EDQUOT, "Disk quota exceeded")])
def test_a_full_disk_during_the_write_is_one_line_and_loses_nothing(tmp_path, code, reason):
    """#58: a full disk was a 60-line Megatron traceback naming no folder."""
    mgr = CheckpointManager(str(tmp_path))
    mgr.save(1, _writer("good"), {})
    with pytest.raises(CheckpointDiskFull) as info:
        mgr.save(2, _fills_the_disk(code), {})
    assert re.match(_disk_full_line(tmp_path, 2, reason), str(info.value)), str(info.value)
    assert isinstance(info.value, ValueError)  # an entry point's one-line user error
    _only_step_1_left(tmp_path, mgr)
    mgr.save(2, _writer("good2"), {})  # room again: the next save works
    assert mgr.latest().step == 2


def test_a_full_disk_inside_torchs_distributed_checkpoint_is_found(tmp_path):
    """Megatron's dist_checkpointing saves through torch.distributed.checkpoint, which gathers each
    rank's OSError into a CheckpointException (a BaseException) that Megatron re-raises from."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    def write(tmp: str) -> None:
        _writer("x" * 5000)(tmp)
        failure = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        try:
            raise CheckpointException("save failed", {0: (failure, traceback.StackSummary())})
        except CheckpointException as exc:
            raise RuntimeError("megatron: saving the sharded state failed") from exc

    mgr = CheckpointManager(str(tmp_path))
    mgr.save(1, _writer("good"), {})
    with pytest.raises(CheckpointDiskFull, match=_disk_full_line(tmp_path, 2)):
        mgr.save(2, write, {})
    _only_step_1_left(tmp_path, mgr)


def test_a_full_disk_at_the_manifest_keeps_the_step_it_was_replacing(tmp_path, monkeypatch):
    """The fsync after the manifest fails (a full disk can say so only then): the step being saved
    again keeps its earlier copy, the staging folder goes."""
    from verl.utils import checkpoint

    mgr = CheckpointManager(str(tmp_path))
    mgr.save(1, _writer("good"), {})

    def full(path: str) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint, "_fsync_dir", full)
    with pytest.raises(CheckpointDiskFull, match=_disk_full_line(tmp_path, 1, written=r"[\d,]+ bytes( \([\d.]+ KiB\))?")):
        mgr.save(1, _writer("new"), {})
    monkeypatch.undo()
    _only_step_1_left(tmp_path, mgr)


def test_another_write_error_is_not_called_a_full_disk(tmp_path):
    def denied(tmp: str) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), tmp)

    with pytest.raises(PermissionError):
        CheckpointManager(str(tmp_path)).save(1, denied, {})


def _full_on_rank_1_body(root: str) -> str:
    import torch.distributed as dist

    mgr = CheckpointManager(root)
    mgr.save(1, _writer("good") if dist.get_rank() == 0 else lambda tmp: None, {})
    try:
        mgr.save(2, _fills_the_disk() if dist.get_rank() == 1 else lambda tmp: None, {})
    except CheckpointDiskFull as exc:
        return str(exc)
    return "no error"


@pytest.mark.distributed
def test_a_full_disk_on_one_rank_is_the_same_line_on_every_rank(tmp_path):
    """Rank 0 wrote its share; rank 1's disk was full: both raise (rank 0 waited at a barrier before)."""
    from verl.testing.distributed import run_distributed

    results = run_distributed(_full_on_rank_1_body, 2, str(tmp_path))
    assert results[0] == results[1]
    assert results[0].startswith(f"checkpoint of step 2 into {tmp_path}: No space left on device on rank(s) 1; ")
    _only_step_1_left(tmp_path, CheckpointManager(str(tmp_path)))
