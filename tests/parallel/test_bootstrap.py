"""``verl.parallel.bootstrap``: the one place a distributed world is started and torn down."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from verl.parallel.bootstrap import free_port, resolve_backend, run_on_ranks

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_backend_follows_the_device_and_the_gpus():
    assert resolve_backend(2, device="cpu") == "gloo"
    assert resolve_backend(2, backend="gloo") == "gloo"
    assert resolve_backend(1, device="auto") == ("nccl" if GPUS >= 1 else "gloo")
    # auto never asks NCCL for more ranks than there are GPUs on this machine
    assert resolve_backend(GPUS + 1, device="auto") == "gloo"


def test_impossible_or_unknown_backends_name_the_fix():
    with pytest.raises(ValueError, match=rf"backend='nccl' needs {GPUS + 1} CUDA devices .* this machine has {GPUS}"):
        resolve_backend(GPUS + 1, backend="nccl")
    with pytest.raises(ValueError, match=rf"device=cuda needs {GPUS + 1} CUDA devices"):
        resolve_backend(GPUS + 1, device="cuda")
    with pytest.raises(ValueError, match="backend='mpi'; use 'gloo', 'nccl' or None"):
        resolve_backend(1, backend="mpi")
    with pytest.raises(ValueError, match="device='tpu'; use 'auto', 'cpu' or 'cuda'"):
        resolve_backend(1, device="tpu")


_WORLD_OF_ONE = """
import torch.distributed as dist
from verl.parallel.bootstrap import destroy_distributed, init_distributed
device = init_distributed(device="cpu")
print(device, dist.get_world_size(), dist.get_rank(), dist.get_backend())
assert init_distributed(device="cpu") == device  # already initialised: nothing changes
destroy_distributed()
print("initialised after destroy:", dist.is_initialized())
"""


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    clean.update(env, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=clean)


def test_a_plain_process_is_a_world_of_one():
    out = _python(_WORLD_OF_ONE, {})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["cpu 1 0 gloo", "initialised after destroy: False"]


def test_a_half_torchrun_environment_is_refused():
    out = _python("from verl.parallel.bootstrap import init_distributed\ninit_distributed()", {"RANK": "0"})
    assert out.returncode != 0
    assert "RANK is set but WORLD_SIZE, MASTER_ADDR, MASTER_PORT not" in out.stderr


def _rank_and_world() -> tuple[int, int, str]:
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size(), dist.get_backend()


@pytest.mark.distributed
def test_run_on_ranks_spawns_a_world():
    backend = "nccl" if GPUS >= 2 else "gloo"
    assert run_on_ranks(_rank_and_world, 2) == [(0, 2, backend), (1, 2, backend)]


def test_free_port_is_bindable():
    import socket

    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))


_WORLD_OF_A_CONFIG = """
import datetime, os
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from verl.config import PPOConfig, load_config
from verl.parallel.bootstrap import distributed_world, start_world
cfg = load_config(PPOConfig, overrides=["trainer.device=cpu", "trainer.collective_timeout_s=37",
                                        "trainer.n_gpus_per_node=1"], world_size=1)
from verl.parallel.bootstrap import CONNECT_TIMEOUT, end_startup
with distributed_world(cfg.trainer) as started:
    def timeout():
        return c10d._get_default_group()._get_backend(c10d.torch.device("cpu")).options._timeout
    starting = timeout() == CONNECT_TIMEOUT  # until the training loop ends the start-up
    end_startup()
    print(started, dist.get_backend(), starting and timeout() == datetime.timedelta(seconds=37),
          os.environ["CUDA_VISIBLE_DEVICES"] == "")
    with distributed_world(cfg.trainer) as again:  # a world already up: used, not torn down
        print(again)
    print(dist.is_initialized(), start_world(cfg.trainer))
print(dist.is_initialized())
"""


def test_a_world_from_the_trainer_config_is_started_once_and_torn_down_by_its_starter():
    out = _python(_WORLD_OF_A_CONFIG, {})
    assert out.returncode == 0, out.stderr
    # started, gloo, the connect's timeout during the start-up and then the config's collective
    # timeout, CUDA hidden on cpu; the nested block found
    # the world up; the world is gone after the block that started it.
    assert out.stdout.splitlines() == ["True gloo True True", "False", "True False", "False"]


def test_verl_and_tools_start_worlds_in_one_place():
    """One ``init_process_group`` call in verl/ and tools/ (``init_distributed``); every other
    start goes through it."""
    import re

    calls = []
    for top in ("verl", "tools"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    with open(path, encoding="utf-8") as f:
                        for number, line in enumerate(f, 1):
                            if re.search(r"\binit_process_group\(", line) and not line.lstrip().startswith("#"):
                                calls.append(f"{os.path.relpath(path, ROOT)}:{number}")
    assert calls == ["verl/parallel/bootstrap.py:" + calls[0].split(":")[1]] and len(calls) == 1, calls


def _two_ranks(code: str, arg: str, *, timeout: float) -> tuple[list[subprocess.Popen], list[tuple[str, str]]]:
    """``code`` as ranks 0 and 1 of a torchrun-like world on this machine; each rank's (stdout, stderr).
    Rank 0 is waited for first; then rank 1's stdin is closed (``_UNTIL_RANK_0_IS_DONE``) and it is waited for."""
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = {k: v for k, v in os.environ.items()}
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PYTHONPATH=ROOT)
        procs.append(subprocess.Popen([sys.executable, "-c", code, arg], env=env, text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return procs, [p.communicate(timeout=timeout) for p in procs]  # communicate closes stdin


# Rank 1 alive (and silent) while rank 0 waits: until the test closes its stdin once rank 0 is done
# (a hang guard of 120 s, and EOF if the test dies).
_UNTIL_RANK_0_IS_DONE = "select.select([sys.stdin], [], [], 120)"


_LATE_RANK = """
import datetime, os, select, sys, time
import torch
import torch.distributed as dist
from verl.parallel.bootstrap import init_distributed, new_group
rank, late = int(os.environ["RANK"]), float(sys.argv[1])
timeout = datetime.timedelta(seconds=2)
if rank == 1:
    time.sleep(late)  # joins the world later than a collective may wait
init_distributed(device="cpu", timeout=timeout)
if rank == 1:
    time.sleep(late)  # and the group too
group = new_group([0, 1], timeout=timeout)
if rank == 0:
    for name, g in (("group", group), ("world", None)):
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=g)  # rank 1 never joins this one
            print(name, "answered")
        except RuntimeError as exc:
            print(name, "timed out" if "Timed out" in str(exc) else str(exc)[:200], round(time.monotonic() - start))
    sys.stdout.flush()
    # Not what this test checks: a process leaving with a timed-out gloo collective still pending may
    # abort in teardown ("terminate called without an active exception", seen once in a loaded suite).
    os._exit(0)
else:
    """ + _UNTIL_RANK_0_IS_DONE + """
"""


def test_a_rank_may_join_late_but_a_collective_waits_only_the_collective_timeout():
    """Joining the world or a group has ``CONNECT_TIMEOUT``, not the collective timeout: rank 1
    arrives 4 s late at both with a 2 s collective timeout and the world starts; then a collective
    rank 1 never joins raises after ~2 s (not the connect's minutes). A connect that used the
    collective timeout failed healthy start-ups under load (tests/trainer/test_lost_rank.py)."""
    procs, outs = _two_ranks(_LATE_RANK, "4", timeout=120)
    lines = outs[0][0].splitlines()
    assert procs[0].returncode == 0, (lines, outs[0][1][-3000:])
    assert [line.rsplit(" ", 1)[0] for line in lines] == ["group timed out", "world timed out"], outs[0]
    # 2 s plus scheduling on a loaded machine; the connect timeout would be 300 s, and rank 1
    # leaving early would show as a closed connection, not a timeout.
    assert all(int(line.rsplit(" ", 1)[1]) < 8 for line in lines), lines


_SLOW_BUILD = """
import os, select, sys, time, types
import torch
import torch.distributed as dist
from verl.parallel.bootstrap import end_startup, new_group, start_world
import datetime
rank, late = int(os.environ["RANK"]), float(sys.argv[1])
start_world(types.SimpleNamespace(device="cpu", collective_timeout_s=2.0))
group = new_group([0, 1], timeout=datetime.timedelta(seconds=2))  # as the role groups are made
for name, g in (("group", group), ("world", None)):
    if rank == 1:
        time.sleep(late)  # a build on a loaded machine: rank 1 reaches the gather 4 s after rank 0
    out = [None, None]
    dist.all_gather_object(out, rank, group=g)  # as Megatron's optimizer build does
    print("start-up", name, "answered", out, flush=True)
end_startup()
if rank == 0:
    for name, g in (("group", group), ("world", None)):
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=g)  # rank 1 never joins this one
            print("step", name, "answered")
        except RuntimeError as exc:
            print("step", name, "timed out" if "Timed out" in str(exc) else str(exc)[:200], round(time.monotonic() - start))
    sys.stdout.flush()
    os._exit(0)  # as in _LATE_RANK: a pending timed-out gloo collective may abort the teardown
else:
    """ + _UNTIL_RANK_0_IS_DONE + """
"""


def test_a_start_up_waits_like_a_connect_and_the_steps_the_collective_timeout():
    """suite19: ``trainer.collective_timeout_s=8`` failed a healthy start-up on a loaded machine,
    where the two ranks reached Megatron's optimizer-build gather more than 8 s apart. From
    ``start_world`` to ``end_startup`` (the training loop's first step) collectives wait as long as
    a connect; after it, a collective a rank never joins raises after the collective timeout (2 s)."""
    procs, outs = _two_ranks(_SLOW_BUILD, "4", timeout=300)
    lines = outs[0][0].splitlines()
    assert procs[0].returncode == 0, (lines, outs[0][1][-3000:])
    assert lines[:2] == ["start-up group answered [0, 1]", "start-up world answered [0, 1]"], outs[0]
    assert [line.rsplit(" ", 1)[0] for line in lines[2:]] == ["step group timed out", "step world timed out"], outs[0]
    # 2 s plus scheduling on a loaded machine; the start-up's timeout would be 300 s.
    assert all(int(line.rsplit(" ", 1)[1]) < 30 for line in lines[2:]), lines


def _state_of_the_other_rank(pid_file: str) -> str:
    """Rank 1 returns at once; rank 0 waits a while, then reads rank 1's process state."""
    import time

    import torch.distributed as dist

    if dist.get_rank() == 1:
        with open(pid_file + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(pid_file + ".tmp", pid_file)
        return "returned"
    deadline = time.monotonic() + 60
    while not os.path.exists(pid_file) and time.monotonic() < deadline:
        time.sleep(0.05)
    with open(pid_file) as f:
        pid = int(f.read())
    time.sleep(1.5)  # ample time for a rank that does not wait to tear down and exit
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(line.split()[1] for line in f if line.startswith("State:"))
    except FileNotFoundError:
        return "gone"


@pytest.mark.distributed
def test_no_spawned_rank_tears_the_world_down_before_every_rank_finished(tmp_path):
    """A rank whose ``fn`` has no collective waits for its peers before tearing the world down:
    otherwise a peer still inside ``init_process_group`` fails with "Gloo connectFullMesh failed
    ... Connection closed by peer" (a suite run under load). Rank 1 must still be alive (waiting,
    not a zombie or gone) while rank 0 is in ``fn``."""
    states = run_on_ranks(_state_of_the_other_rank, 2, str(tmp_path / "pid"))
    assert states[1] == "returned"
    assert states[0] in ("S", "R", "D"), f"rank 1 was {states[0]!r} while rank 0 was still running"
