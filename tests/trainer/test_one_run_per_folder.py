"""One run per output folder (#58): a run holds a lock on its checkpoint and log folders
(``verl.utils.run_lock``, taken in ``check_run_outputs``); a second run into either is refused in one
line before any model is built, and a lock left by a run that is gone is taken over with one line."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from verl.utils import run_lock
from verl.utils.run_lock import LOCK_FILE, FolderInUse

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_HOLD = (
    "import sys, time\n"
    "from verl.utils.run_lock import hold_folder\n"
    "hold_folder(sys.argv[1], 'trainer.log_dir')\n"
    "print('held', flush=True)\n"
    "time.sleep(600)\n"
)


@pytest.fixture
def holder(tmp_path):
    """Start a process that holds ``folder``'s lock (as a run's rank 0 does); yields (start, procs)."""
    procs: list[subprocess.Popen] = []

    def start(folder) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(folder)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": ROOT})
        procs.append(proc)
        assert proc.stdout.readline().strip() == "held"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def _trainer(tmp_path, *more: str):
    from verl.config import PPOConfig, load_config

    return load_config(PPOConfig, overrides=[f"trainer.default_local_dir={tmp_path}/ckpt", f"trainer.log_dir={tmp_path}/logs",
                                             "trainer.logger=[console,jsonl]", "trainer.save_freq=1",
                                             "trainer.n_gpus_per_node=1", *more], world_size=1).trainer


@pytest.mark.timeout(300)
def test_a_second_run_into_a_held_folder_is_refused_in_one_line(tiny_model_dir, arithmetic_files, tmp_path, holder):
    """``main_ppo`` into a log folder a live run holds: exit 2 and one line naming the folder, the holder
    and the fix, before any model is built; the holder's lock is untouched."""
    logs = tmp_path / "logs"
    first = holder(logs)
    lock_before = (logs / LOCK_FILE).read_text()
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", "--config", "grpo_tiny_cpu", "trainer.n_gpus_per_node=1",
         f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={arithmetic_files['train']}",
         f"data.val_files={arithmetic_files['val']}", f"trainer.default_local_dir={tmp_path}/ckpt",
         f"trainer.log_dir={logs}", "trainer.logger=[jsonl]"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
        env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr[-3000:]
    line = errors[0]
    assert f"trainer.log_dir={logs} is in use by another run: pid {first.pid} on " in line, line
    assert "wait for that run to end, or choose another trainer.log_dir" in line, line
    assert "Traceback" not in proc.stderr and "Megatron" not in proc.stderr, proc.stderr[-3000:]
    assert (logs / LOCK_FILE).read_text() == lock_before
    # The refused run took no lock of its own: its checkpoint folder has none.
    assert not (tmp_path / "ckpt" / LOCK_FILE).exists()
    assert time.monotonic() - start < 200  # no model was built (a loaded machine: tens of seconds of imports)


def test_a_lock_left_by_a_dead_run_is_taken_over_with_one_line(tmp_path, holder, caplog):
    """The holder killed with SIGKILL leaves its lock file; the next run's check takes it over and says
    so in one line, and a clean end (the trainer's close) removes it."""
    from verl.trainer.run_checks import check_run_outputs, release_run_outputs

    trainer = _trainer(tmp_path)
    dead = holder(tmp_path / "ckpt")
    with pytest.raises(FolderInUse, match=rf"trainer.default_local_dir=\S*ckpt is in use by another run: pid {dead.pid} "):
        check_run_outputs(trainer, inputs={})
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    assert json.loads((tmp_path / "ckpt" / LOCK_FILE).read_text())["pid"] == dead.pid  # left behind
    with caplog.at_level(logging.WARNING, logger="verl.utils.run_lock"):
        check_run_outputs(trainer, inputs={})
    lines = [r.getMessage() for r in caplog.records if "took over" in r.getMessage()]
    assert len(lines) == 1 and f"trainer.default_local_dir={tmp_path}/ckpt: took over the lock left by a run " \
        f"that is gone (pid {dead.pid} on " in lines[0], lines
    assert json.loads((tmp_path / "ckpt" / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert json.loads((tmp_path / "logs" / LOCK_FILE).read_text())["pid"] == os.getpid()
    check_run_outputs(trainer, inputs={})  # the same process again (a Python API's second fit): kept
    release_run_outputs(trainer)
    assert not (tmp_path / "ckpt" / LOCK_FILE).exists() and not (tmp_path / "logs" / LOCK_FILE).exists()


def test_a_run_refused_for_one_folder_holds_neither(tmp_path, holder):
    from verl.trainer.run_checks import check_run_outputs

    holder(tmp_path / "logs")
    with pytest.raises(FolderInUse, match=r"trainer.log_dir=\S*logs is in use by another run"):
        check_run_outputs(_trainer(tmp_path), inputs={})
    assert not (tmp_path / "ckpt" / LOCK_FILE).exists()


def _foreign_lock(folder, *, age_s: float, world: str | None = None, host: str = "node-17") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    path.write_text(json.dumps({"host": host, "pid": 4242, "pid_started": None, "launcher_pid": 4240,
                                "command": "torchrun --nnodes 2 launch/grpo_7b.sh", "folder": str(folder),
                                "since": time.time() - 3600, "world": world}))
    os.utime(path, (time.time() - age_s, time.time() - age_s))


def test_across_hosts_the_heartbeat_decides(tmp_path, caplog):
    """On a shared file system flock may not reach another host: a holder there whose heartbeat (the
    lock file's mtime) is fresh is a live run; one silent for longer than STALE_AFTER_S is gone."""
    folder = tmp_path / "shared"
    _foreign_lock(folder, age_s=5)
    with pytest.raises(FolderInUse) as exc:
        run_lock.hold_folder(str(folder), "trainer.default_local_dir")
    assert "is in use by another run: pid 4242 on node-17 (launcher pid 4240)" in str(exc.value)
    assert "command: torchrun --nnodes 2 launch/grpo_7b.sh" in str(exc.value)
    assert f"taken over once that is {run_lock.STALE_AFTER_S:.0f} s" in str(exc.value)
    _foreign_lock(folder, age_s=run_lock.STALE_AFTER_S + 60)
    with caplog.at_level(logging.WARNING, logger="verl.utils.run_lock"):
        assert run_lock.hold_folder(str(folder), "trainer.default_local_dir")
    assert any("took over the lock left by a run that is gone (pid 4242 on node-17" in r.getMessage() for r in caplog.records)
    run_lock.release_folder(str(folder))
    assert not (folder / LOCK_FILE).exists()


def test_the_other_ranks_recognise_their_own_rank_0(tmp_path, monkeypatch):
    """Before the world starts, ranks other than 0 read the lock: their own rank 0's (same torchrun
    world) is no refusal, another live run's is."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    monkeypatch.setenv("MASTER_ADDR", "node-1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    folder = tmp_path / "logs"
    _foreign_lock(folder, age_s=1, world="job-1/node-1/29500")
    assert run_lock.in_use_by_another_run(str(folder), "trainer.log_dir") is None
    _foreign_lock(folder, age_s=1, world="job-0/node-9/29500")
    refusal = run_lock.in_use_by_another_run(str(folder), "trainer.log_dir")
    assert refusal is not None and "is in use by another run: pid 4242 on node-17" in str(refusal)
    _foreign_lock(folder, age_s=run_lock.STALE_AFTER_S + 60, world="job-0/node-9/29500")
    assert run_lock.in_use_by_another_run(str(folder), "trainer.log_dir") is None  # gone


def test_a_recipe_rerun_does_not_move_a_live_runs_folder(tmp_path, holder):
    """A launcher's rerun moves an earlier run's outputs into earlier_runs/; a folder a live run holds
    stays where it is (said in one line), and the trainer then refuses the rerun."""
    from verl.trainer.launcher import set_aside_earlier_run

    ckpt = tmp_path / "ckpt"
    (ckpt / "global_step_2").mkdir(parents=True)
    holder(ckpt)
    assert set_aside_earlier_run([f"trainer.default_local_dir={ckpt}", "trainer.resume_mode=disable"]) is None
    assert (ckpt / "global_step_2").is_dir()


def test_a_run_refused_by_a_later_check_holds_no_lock_and_leaves_no_folder(tmp_path):
    """The lock is taken before the checks that read the folders; a refusal by one of them (the log
    folder holds a model's config.json) releases it, and the checkpoint folder it made is gone again."""
    from verl.trainer.run_checks import check_run_outputs
    from verl.utils.outputs import OutputPathError

    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(OutputPathError, match=r"holds config.json, which verl did not write"):
        check_run_outputs(_trainer(tmp_path), inputs={})
    assert sorted(os.listdir(tmp_path / "logs")) == ["config.json"]
    assert not (tmp_path / "ckpt").exists()
