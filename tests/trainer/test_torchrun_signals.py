"""torchrun and a run's life (#58): a ``kill -9`` of the torchrun agent leaves no worker running
(each rank arms the parent-death signal, ``verl.utils.process.die_with_launcher``); SIGTERM to
verl's torchrun (``python -m verl.trainer.torchrun``, what ``launch/`` runs) lets the workers save
their checkpoint and ends with exit 143 and no traceback; while the run lives, a second run into its
folders is refused in one line naming the launcher; a rank that gets the same stop signal twice at
once (its process group's and torchrun's forward) stops once, after its checkpoint.

Worlds of one rank under torchrun, with test_reliability.py's settings (the raw tiny model, the
transformers rollout engine); each run is stopped after its first step."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.processes import kill_tree
from tests.trainer.test_reliability import FAULTS, ROOT, _env, _micro, _run_args
from verl.utils.run_lock import LOCK_FILE, holder_of, in_use_by_another_run

# Hang guards sized for a loaded machine (tests/processes.py): a world of one starts in ~20 s quiet.
FIRST_STEP_S = 480
END_S = 300


def _start(launcher: list[str], args: list[str], stderr_path) -> subprocess.Popen:
    with open(stderr_path, "w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", *launcher, "--standalone", "--nproc_per_node=1", FAULTS, *args],
            stdout=subprocess.DEVNULL, stderr=err, env=_env(), cwd=ROOT, start_new_session=True,
        )


def _wait_for_step(proc: subprocess.Popen, log_dir: str, stderr_path) -> None:
    """Until metrics.jsonl has a step: the run is past its start-up and trains."""
    metrics = os.path.join(log_dir, "metrics.jsonl")
    deadline = time.monotonic() + FIRST_STEP_S
    while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0):
        assert proc.poll() is None, open(stderr_path).read()[-3000:]
        assert time.monotonic() < deadline, f"no step within {FIRST_STEP_S} s\n" + open(stderr_path).read()[-3000:]
        time.sleep(0.5)


def _args(arithmetic_files, tiny_model_dir, tmp_path, name: str) -> list[str]:
    return [*_run_args(arithmetic_files, tiny_model_dir, tmp_path, name, *_micro(2)), "trainer.total_training_steps=200"]


@pytest.mark.slow
@pytest.mark.timeout(FIRST_STEP_S + END_S + 120)
def test_kill_9_of_torchrun_leaves_no_worker(tiny_model_dir, arithmetic_files, tmp_path):
    import psutil

    args = _args(arithmetic_files, tiny_model_dir, tmp_path, "run")
    stderr_path = tmp_path / "stderr.txt"
    agent = _start(["torch.distributed.run"], args, stderr_path)  # plain torchrun: the workers arm the signal
    try:
        _wait_for_step(agent, f"{tmp_path}/run/logs", stderr_path)
        workers = psutil.Process(agent.pid).children(recursive=True)
        assert workers, "torchrun has no worker"
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        # SIGKILL at the agent's death; the workers' own children (reward pool, resource tracker)
        # follow within their 1 s watch.
        gone, alive = psutil.wait_procs(workers, timeout=15)
        assert not alive, [(p.pid, p.cmdline()) for p in alive]
    finally:
        kill_tree(agent)
    # The killed run's lock file is left behind, naming a process that is gone: the next run takes it over.
    left = holder_of(f"{tmp_path}/run")
    assert left is not None and left.launcher_pid == agent.pid and not left.alive()
    assert in_use_by_another_run(f"{tmp_path}/run", "trainer.default_local_dir") is None


@pytest.mark.slow
@pytest.mark.timeout(FIRST_STEP_S + END_S + 240)
def test_sigterm_to_torchrun_saves_and_exits_143_while_a_second_run_is_refused(tiny_model_dir, arithmetic_files, tmp_path):
    args = _args(arithmetic_files, tiny_model_dir, tmp_path, "run")
    stderr_path = tmp_path / "stderr.txt"
    agent = _start(["verl.trainer.torchrun"], args, stderr_path)
    try:
        _wait_for_step(agent, f"{tmp_path}/run/logs", stderr_path)
        # A second run into the same folders while the first lives: refused in one line, nothing built.
        second = subprocess.run([sys.executable, FAULTS, *args], env=_env(), cwd=ROOT, capture_output=True, text=True,
                                timeout=240)
        assert second.returncode == 2, second.stderr[-3000:]
        errors = [line for line in second.stderr.splitlines() if "error:" in line]
        assert len(errors) == 1, second.stderr[-3000:]
        assert re.search(rf"trainer.default_local_dir=\S*/run is in use by another run: pid \d+ on \S+ "
                         rf"\(launcher pid {agent.pid}\), since .*, command: .*verl.trainer.torchrun", errors[0]), errors[0]
        assert "wait for that run to end, or choose another trainer.default_local_dir" in errors[0]

        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=END_S)
    finally:
        kill_tree(agent)
    err = stderr_path.read_text()
    assert agent.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    found = re.search(r"SIGTERM: stopped after step (\d+); checkpoint (\S*global_step_\d+)", err)
    assert found, err[-3000:]
    assert os.path.isdir(found.group(2).rstrip(".,;")), found.group(0)
    with open(f"{tmp_path}/run/latest_checkpointed_iteration.txt") as f:
        assert int(f.read()) == int(found.group(1))
    assert "torchrun: SIGTERM: forwarded to the workers" in err
    # A clean end releases the folders.
    assert not os.path.exists(f"{tmp_path}/run/{LOCK_FILE}") and not os.path.exists(f"{tmp_path}/run/logs/{LOCK_FILE}")


_ECHO = """
import os, signal, sys, time
from verl.trainer.resilience import StopSignals
with StopSignals() as stop:
    os.kill(os.getpid(), signal.SIGTERM)  # from the process group (Ctrl-C, scancel) ...
    os.kill(os.getpid(), signal.SIGTERM)  # ... and torchrun's forward of the same
    time.sleep(0.2)
    print("alive", stop.received.name, flush=True)
    time.sleep(2.5)
    os.kill(os.getpid(), signal.SIGTERM)  # a second request, later: stops at once
    time.sleep(5)
print("not stopped", flush=True)
"""


@pytest.mark.timeout(120)
def test_the_same_signal_twice_at_once_is_one_stop_request():
    """A rank that gets SIGTERM from its process group and again from torchrun's forward saves and
    stops once; the same signal seconds later still stops it at once."""
    proc = subprocess.run([sys.executable, "-c", _ECHO], env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert proc.stdout == "alive SIGTERM\n", (proc.stdout, proc.stderr[-2000:])
    assert proc.returncode == -signal.SIGTERM, proc.stderr[-2000:]
    assert "SIGTERM again: stopping now" in proc.stderr
