"""The SFT trainer end to end: it learns the arithmetic task, and a resumed run continues identically."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest

from tests.processes import python_stacks, run_tree
from verl.testing.distributed import run_distributed


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; on timeout the whole group (torchrun's ranks too) is
    killed. The limits are hang guards sized for a loaded machine (tests/processes.py)."""
    try:
        return run_tree(cmd, timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{cmd[:6]} ... timed out after {timeout} s: {exc}") from None


def _losses(log_dir: str) -> dict[int, float]:
    out = {}
    with open(os.path.join(log_dir, "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            if "train/loss" in record:
                out[record["step"]] = record["train/loss"]
    return out


def _sft_config(model_dir: str, files: dict[str, str], run_dir: str, *extra: str, world_size: int = 1):
    from verl.config import SFTConfig, load_config

    return load_config(
        SFTConfig,
        config_file="sft_tiny_cpu",
        overrides=[
            f"model.path={model_dir}",
            f"data.train_files={files['train']}",
            f"data.val_files={files['val']}",
            "data.train_batch_size=16",
            "data.micro_batch_size_per_gpu=8",
            "trainer.total_training_steps=5",
            "optim.lr_warmup_steps=2",  # warm-up and cosine decay: the scheduler state must resume too
            "trainer.test_freq=-1",
            "trainer.logger=[jsonl]",
            "trainer.save_hf=false",
            f"trainer.default_local_dir={run_dir}",
            f"trainer.log_dir={run_dir}/logs",
            *extra,
        ],
        world_size=world_size,
    )


def _resume_body(
    model_dir: str, files: dict[str, str], root: str
) -> tuple[dict[int, float], dict[int, float], list[str]]:
    from verl.trainer.sft_trainer import SFTTrainer

    whole = f"{root}/whole"
    with SFTTrainer(_sft_config(model_dir, files, whole, "trainer.save_freq=-1")) as trainer:
        trainer.fit()
    parts = f"{root}/parts"
    # "Killed" right after the step-3 checkpoint; the end-of-run actions never happen.
    with SFTTrainer(_sft_config(model_dir, files, parts, "trainer.save_freq=3")) as trainer:
        trainer.fit(stop_after=4)
    with SFTTrainer(_sft_config(model_dir, files, parts, "trainer.save_freq=3")) as trainer:
        assert trainer.resume() == 3
        trainer.fit()
        assert trainer.global_step == 5
    return _losses(f"{whole}/logs"), _losses(f"{parts}/logs"), sorted(os.listdir(parts))


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_resumed_run_continues_identically(tiny_model_dir, arithmetic_files, tmp_path):
    whole, parts, listing = run_distributed(_resume_body, 1, tiny_model_dir, arithmetic_files, str(tmp_path))[
        0
    ]
    assert sorted(whole) == [1, 2, 3, 4, 5]
    # The interrupted run logged steps 1-4; the resumed one dropped its step 4 (re-done from the
    # step-3 checkpoint) before logging 4 and 5: every step appears once.
    expected = [whole[s] for s in (4, 5)]
    with open(tmp_path / "parts" / "logs" / "metrics.jsonl", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    actual = [r["train/loss"] for r in records if r["step"] in (4, 5)]
    # Same process, same single thread, same data and states: bit-identical.
    assert actual == expected
    assert [parts[s] for s in (1, 2, 3)] == [whole[s] for s in (1, 2, 3)]
    # sft_tiny_cpu keeps one checkpoint: step 3's went when step 5's was complete.
    assert listing == ["global_step_5", "latest_checkpointed_iteration.txt", "logs"]


@pytest.mark.slow
@pytest.mark.timeout(960)
def test_short_sft_run_learns_the_task(tiny_model_dir, arithmetic_files, tmp_path):
    """`python -m verl.trainer.main_sft` (no torchrun: a world of one) teaches 1-digit addition.

    The accuracy is measured on the first 64 training problems (the 1-digit table has only
    100, so there is no disjoint test set): greedy generation with transformers on the
    exported Hugging Face model, scored by the verl/arithmetic scorer. The random model
    scores 0; 100 steps (~15-25 s) reach ~0.8-0.9 with this seed, so 0.5 is a safe bar.
    """
    from verl.trainer.eval_generation import evaluate_generation

    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "verl.trainer.main_sft",
        "--config",
        "sft_tiny_cpu",
        f"model.path={tiny_model_dir}",
        f"data.train_files={arithmetic_files['train']}",
        f"data.val_files={arithmetic_files['val']}",
        "trainer.total_training_steps=100",
        "optim.lr_warmup_steps=10",
        "trainer.test_freq=50",
        "trainer.save_freq=-1",
        "trainer.logger=[console,jsonl]",
        f"trainer.default_local_dir={run}",
        f"trainer.log_dir={run}/logs",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    proc = _run(cmd, env, timeout=900)  # 284+ s beside two busy loops (suite17)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(run / "logs" / "metrics.jsonl", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    train = [r["train/loss"] for r in records if "train/loss" in r]
    val = [r["val/loss"] for r in records if "val/loss" in r]
    assert len(train) == 100 and len(val) == 2
    # Response tokens of a random 902-token model cost ~ln(902) = 6.8 nats; the trained
    # model is nearly certain of the format and mostly right about the digit(s)
    # (seen with this seed: train 6.84 -> 0.25, validation 0.44 at step 50 -> 0.25 at 100).
    assert train[0] > 5.0 and train[-1] < 1.0
    assert val[-1] < val[0] < 1.0
    before = evaluate_generation(tiny_model_dir, arithmetic_files["val"], max_samples=64, max_new_tokens=8)
    after = evaluate_generation(
        str(run / "huggingface"), arithmetic_files["val"], max_samples=64, max_new_tokens=8
    )
    assert before.accuracy <= 0.05, before.examples
    assert after.accuracy >= 0.5, after.examples


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(660)
def test_torchrun_tensor_parallel_run(tiny_model_dir, arithmetic_files, tmp_path):
    """`torchrun --nproc_per_node=2 -m verl.trainer.main_sft` with TP=2 + sequence parallel:
    trains, checkpoints, and exports a Hugging Face model that transformers loads."""
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "verl.trainer.main_sft",
        "--config",
        "sft_tiny_cpu",
        f"model.path={tiny_model_dir}",
        f"data.train_files={arithmetic_files['train']}",
        f"data.val_files={arithmetic_files['val']}",
        "trainer.n_gpus_per_node=2",
        "megatron.tensor_model_parallel_size=2",
        "megatron.sequence_parallel=true",
        "data.train_batch_size=16",
        "data.micro_batch_size_per_gpu=8",
        "trainer.total_training_steps=3",
        "optim.lr_warmup_steps=1",
        "trainer.test_freq=3",
        "trainer.save_freq=3",
        "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={run}",
        f"trainer.log_dir={run}/logs",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = _run(cmd, env, timeout=600)  # 36 s quiet, 170+ s beside two busy loops (suite17)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(run / "logs" / "metrics.jsonl", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[-1]["train/loss"] < records[0]["train/loss"] and "val/loss" in records[-1]
    assert (run / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(run / "huggingface"))
    assert model.config.num_key_value_heads == 2


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid``."""
    import psutil

    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return set()


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _cmdline(pid: int) -> str:
    import psutil

    try:
        return " ".join(psutil.Process(pid).cmdline())[:300]
    except psutil.Error:
        return "?"


def _cmdline_of(cmd: list[str]) -> str:
    """What :func:`_cmdline` reads for a process started as ``cmd``."""
    return " ".join(cmd)[:300]


def _stuck(pid: int, stderr: os.PathLike) -> str:
    """What a hang guard reports of the trainer ``pid``: its processes with their command lines, the
    Python stacks and the end of its stderr (a file, never a pipe: an undrained pipe that fills
    would stop the trainer itself)."""
    tree = "\n".join(f"  {c}: {_cmdline(c)[:160]}" for c in sorted({pid, *_descendants(pid)}))
    with open(stderr, encoding="utf-8", errors="replace") as f:
        tail = f.read()[-3000:]
    return f"\n-- processes:\n{tree}\n-- stacks:\n{python_stacks(pid)}\n-- stderr ends:\n{tail}"


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_killed_run_leaves_no_process_behind_and_its_resume_logs_each_step_once(
    tiny_model_dir, arithmetic_files, tmp_path
):
    """SIGKILL of `main_sft` after a checkpoint: any child it started goes with it; the restarted run
    resumes and metrics.jsonl holds every step once. (Megatron's checkpoint writer no longer leaves
    a spawned Manager process behind — verl.models.dist_save — so there may be no child at all; a
    kill during the next save, step 6's, meets its forked writers: verl.utils.process.)"""
    import time

    run = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "verl.trainer.main_sft", "--config", "sft_tiny_cpu",
        f"model.path={tiny_model_dir}", f"data.train_files={arithmetic_files['train']}", "data.val_files=null",
        "data.train_batch_size=16", "data.micro_batch_size_per_gpu=16", "trainer.total_training_steps=6",
        "optim.lr_warmup_steps=1", "trainer.test_freq=-1", "trainer.save_freq=3", "trainer.save_hf=false",
        "trainer.logger=[jsonl]", f"trainer.default_local_dir={run}", f"trainer.log_dir={run}/logs",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    stderr = tmp_path / "trainer.stderr"
    with open(stderr, "w", encoding="utf-8") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        deadline = time.monotonic() + 600  # hang guards sized for a loaded machine (tests/processes.py)
        while not (run / "global_step_3").is_dir():
            assert proc.poll() is None, stderr.read_text(errors="replace")[-4000:]
            if time.monotonic() > deadline:
                raise AssertionError("no checkpoint within 600 s" + _stuck(proc.pid, stderr))
            time.sleep(0.2)
        children = _descendants(proc.pid)
        proc.kill()  # SIGKILL of the trainer only, as an OOM killer or a user would
        proc.wait()
        # A child goes within a second of its watcher starting (verl.utils.process), but a spawned
        # child that is still importing its entry module (torch, Megatron) reaches the watcher only
        # when that import ends: 15 s was too short at load 30 on 2 cores (the suite, 2026-12-05).
        deadline = time.monotonic() + 120
        while any(_alive(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = {c: _cmdline(c) for c in children if _alive(c)}
        assert not left, f"children outlived the killed trainer: {left}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    resumed = _run(cmd, env, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    with open(run / "logs" / "metrics.jsonl", encoding="utf-8") as f:
        steps = [json.loads(line)["step"] for line in f]
    assert steps == list(range(1, 7))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_run_killed_during_a_save_leaves_no_checkpoint_writer_behind(tiny_model_dir, arithmetic_files, tmp_path):
    """Megatron's checkpoint writer forks a worker per file bucket, which ends by taking an item
    from a count queue its parent filled through a feeder thread: SIGKILL of the trainer before
    that thread flushed left a worker waiting forever (the suite, 2026-12-05; 1 kill in 3 by hand).
    Here that state is made certain: the trainer runs with the count queue's items held back
    (``JoinableQueue.put`` sends nothing, so the worker's last ``get`` never returns and the save
    never ends), and is killed once a worker exists. Without verl.utils.process's parent-death
    signal the worker waits on for good."""
    import time

    run = tmp_path / "run"
    held_back = (
        "import multiprocessing.queues, runpy; "
        "multiprocessing.queues.JoinableQueue.put = lambda self, obj, block=True, timeout=None: None; "
        "runpy.run_module('verl.trainer.main_sft', run_name='__main__', alter_sys=True)"
    )
    cmd = [
        sys.executable, "-c", held_back, "--config", "sft_tiny_cpu",
        f"model.path={tiny_model_dir}", f"data.train_files={arithmetic_files['train']}", "data.val_files=null",
        "data.train_batch_size=16", "data.micro_batch_size_per_gpu=16", "trainer.total_training_steps=12",
        "optim.lr_warmup_steps=1", "trainer.test_freq=-1", "trainer.save_freq=1", "trainer.save_hf=false",
        "trainer.logger=[jsonl]", f"trainer.default_local_dir={run}", f"trainer.log_dir={run}/logs",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    stderr = tmp_path / "trainer.stderr"
    with open(stderr, "w", encoding="utf-8") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        deadline = time.monotonic() + 600  # hang guard sized for a loaded machine (quiet: ~10 s)
        # A writer is a fork of the trainer (its command line); other children come and go (the
        # `ldconfig -p` of a library lookup at import, which the first version of this test took for one).
        # The command line compared is the one given to Popen, not the trainer's as read from /proc:
        # read once right after Popen that can be the forked pytest's, and read each round a loaded CI
        # pass still got "" until the 600 s limit, when the stuck report read the trainer and its
        # writer as this command (2026-12-07).
        trainer = _cmdline_of(cmd)
        while not (writers := {c for c in _descendants(proc.pid) if _cmdline(c) == trainer}):
            assert proc.poll() is None, "the run ended before a writer was seen: " + stderr.read_text(errors="replace")[-2000:]
            if time.monotonic() > deadline:
                raise AssertionError(f"no checkpoint writer (a fork: {trainer[:160]}) within 600 s" + _stuck(proc.pid, stderr))
            time.sleep(0.005)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 120  # the parent-death signal is at once; a guard for a loaded machine
        while any(_alive(c) for c in writers) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {c: _cmdline(c) for c in writers if _alive(c)}
        assert not left, f"checkpoint writers outlived the killed trainer: {left}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
