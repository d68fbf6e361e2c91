"""Starting and stopping the torch.distributed world: the one place every entry point calls.

- :func:`init_distributed` chooses the backend (:func:`resolve_backend`: NCCL when CUDA has a
  device for every rank of this node, else gloo, or what the caller asks for), pins the rank's
  GPU, and initialises the default process group with a timeout, from torchrun's environment,
  from an explicit store, rank and world size (the test harness), or as a world of one (a
  plain ``python -m ...``). It returns the rank's device.
- :func:`destroy_distributed` undoes it: Megatron's parallel state first, then the group.
- :func:`start_world` / :func:`distributed_world` (a context manager) start the world a trainer
  config describes (``trainer.device``: on ``cpu`` CUDA is hidden from Megatron first;
  ``trainer.collective_timeout_s``) unless one is already up, and tear down only what they
  started: every entry point (``main_ppo``, ``main_sft``, the Python API, the launcher, the
  benchmarks) starts its world through them.
- The start-up (:func:`start_world` to :func:`end_startup`: the engines' build, the optimizers',
  the resume) waits on its collectives as long as a group's connect (:data:`CONNECT_TIMEOUT`): the
  ranks reach them as far apart as their builds differ, like the connect itself. Only from
  :func:`end_startup` on (the training loop's first step) do they wait the short collective
  timeout that notices a lost rank.
- :func:`run_on_ranks` runs a function on N ranks: the ranks of an enclosing torchrun, or N
  spawned processes that each call :func:`init_distributed`.

The trainers, the Python API, the conversion tools, the benchmarks, the dry run's simulated
ranks (backend ``fake``) and ``verl.testing.run_distributed`` all start their worlds here: this
module holds verl's one ``init_process_group`` call. The code is the same on gloo and NCCL.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import sys
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist

from verl.utils.malloc import cap_malloc_arenas

__all__ = [
    "CONNECT_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "destroy_distributed",
    "distributed_world",
    "end_startup",
    "free_port",
    "init_distributed",
    "new_group",
    "set_collective_timeout",
    "resolve_backend",
    "run_on_ranks",
    "start_world",
    "under_torchrun",
]

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
"""How long a collective may wait for its peers before torch.distributed raises."""

CONNECT_TIMEOUT = datetime.timedelta(minutes=5)
"""How long a rank waits for the others to join a group (the default group's rendezvous, a
``new_group``'s connect): at least this, whatever the collective timeout. Ranks arrive at a
group's creation as far apart as their start-up differs (imports, data loading, a loaded
machine), which has nothing to do with how long a collective of a running job may wait; a
short ``trainer.collective_timeout_s`` (seconds, to notice a lost rank quickly) used for the
connect too failed healthy start-ups under load."""

Device = Literal["auto", "cpu", "cuda"]
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def under_torchrun() -> bool:
    """Whether this process is one rank of a torchrun (or similar ``env://``) launch."""
    return all(k in os.environ for k in _TORCHRUN_VARS)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a world this process starts)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cuda_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_backend(local_world_size: int, backend: str | None = None, *, device: Device = "auto") -> str:
    """The process-group backend for ``local_world_size`` ranks on this machine.

    ``backend`` ("gloo"/"nccl") is checked and returned when given. Otherwise ``device``
    decides: ``cpu`` is gloo, ``cuda`` is NCCL (which needs one visible GPU per local rank),
    ``auto`` is NCCL when there are enough GPUs, else gloo. Raises ValueError naming the fix.
    """
    if backend == "fake":  # the dry run's simulated ranks (torch's FakeProcessGroup): no devices
        return backend
    if backend is not None and backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}; use 'gloo', 'nccl' or None (auto)")
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device={device!r}; use 'auto', 'cpu' or 'cuda'")
    gpus = _cuda_devices()
    wants_nccl = backend == "nccl" or (backend is None and device == "cuda")
    if wants_nccl and gpus < local_world_size:
        what = "backend='nccl'" if backend == "nccl" else "device=cuda"
        raise ValueError(
            f"{what} needs {local_world_size} CUDA devices (one per rank on this machine), this machine "
            f"has {gpus}; use device cpu (gloo) or auto"
        )
    if backend is not None:
        return backend
    if device == "cpu":
        return "gloo"
    return "nccl" if gpus >= local_world_size else "gloo"


def init_distributed(
    *,
    device: Device = "auto",
    backend: str | None = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    store: Any = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> torch.device:
    """Initialise the default process group of this process; returns the rank's device.

    - ``store`` given: join that store's world as ``rank`` of ``world_size`` (the test harness);
      every rank is on this machine.
    - torchrun's environment present: ``env://`` with its RANK / WORLD_SIZE / LOCAL_RANK.
    - neither: a world of one on a free local port (``python -m verl.trainer.main_sft``).

    Under NCCL the current CUDA device is the rank's local GPU. The ranks have
    ``max(CONNECT_TIMEOUT, timeout)`` to join; after that, collectives that wait longer than
    ``timeout`` raise. When the world is already initialised, nothing changes and the device of
    its backend is returned.
    """
    if not dist.is_initialized():
        if store is not None:
            if rank is None or world_size is None:
                raise ValueError("init_distributed: a store needs rank and world_size")
            local_rank, local_world = rank, world_size
        else:
            if rank is not None or world_size is not None:
                raise ValueError("init_distributed: rank and world_size are given with a store only")
            if "RANK" not in os.environ:
                os.environ.update(
                    RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                )
            elif not under_torchrun():
                missing = [k for k in _TORCHRUN_VARS if k not in os.environ]
                raise ValueError(
                    f"RANK is set but {', '.join(missing)} not: start the job with torchrun, or unset RANK"
                )
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        chosen = resolve_backend(local_world, backend, device=device)
        if chosen == "fake" and store is None:
            raise ValueError("init_distributed: backend='fake' joins a FakeStore (the dry run's simulated ranks)")
        if chosen == "nccl":
            torch.cuda.set_device(local_rank)
        joined = {} if store is None else {"store": store, "rank": rank, "world_size": world_size}  # else env://
        dist.init_process_group(backend=chosen, timeout=max(CONNECT_TIMEOUT, timeout), **joined)
        if chosen == "fake":
            return torch.device("meta")
        set_collective_timeout(None, timeout)
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_startup: list[tuple[dist.ProcessGroup | None, datetime.timedelta]] | None = None
"""The collective timeouts held back until :func:`end_startup` (None: not starting up)."""


def end_startup() -> None:
    """The start-up :func:`start_world` began is over: every group made since waits its own
    collective timeout from now on (no-op outside a start-up). Called by the training loop before
    its first step, after the resume: Megatron's optimizer build gathers over the role's group, and
    on a loaded machine its ranks reached that gather more than a short timeout apart (suite19:
    ``trainer.collective_timeout_s=8`` failed a healthy start-up)."""
    global _startup
    pending, _startup = _startup, None
    for group, timeout in pending or []:
        set_collective_timeout(group, timeout)


def set_collective_timeout(group: dist.ProcessGroup | None, timeout: datetime.timedelta) -> None:
    """Collectives of ``group`` (None: the default group) that wait longer than ``timeout`` raise
    from now on, or from :func:`end_startup` on during a start-up; the group's connect used
    :data:`CONNECT_TIMEOUT`.

    The one use of torch's private ``distributed_c10d._set_pg_timeout`` (checked against torch
    2.13 CPU/gloo and 2.11 CUDA; ``tests/parallel/test_bootstrap.py`` fails when it stops
    working). Where it is missing (another torch) the group keeps its connect timeout, logged once.
    """
    if group is None and dist.get_backend() == "fake":
        return
    if _startup is not None:
        _startup.append((group, timeout))
        return
    current = dist.distributed_c10d._get_default_group() if group is None else group
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:
        from verl.utils.logging import warn_once

        warn_once(
            logging.getLogger(__name__),
            f"torch {torch.__version__} has no distributed_c10d._set_pg_timeout: collectives wait as long as "
            f"a group's connect (at least {CONNECT_TIMEOUT}), not the collective timeout {timeout}",
        )
        return
    setter(timeout, current)


def new_group(ranks: list[int], *, timeout: datetime.timedelta | None) -> dist.ProcessGroup:
    """``dist.new_group(ranks)`` whose members have ``max(CONNECT_TIMEOUT, timeout)`` to join, and
    whose collectives then wait ``timeout`` (None: torch's default for both). Collective over the
    world (or the role's world) like ``dist.new_group``."""
    if timeout is None:
        return dist.new_group(ranks=ranks)
    group = dist.new_group(ranks=ranks, timeout=max(CONNECT_TIMEOUT, timeout))
    if group is not dist.GroupMember.NON_GROUP_MEMBER:  # a rank outside holds no backend to set
        set_collective_timeout(group, timeout)
    return group


def start_world(trainer: Any) -> bool:
    """Start the world ``trainer`` (a ``TrainerConfig``/``RunConfig``) describes, unless one is
    already initialised: its ``device`` (``cpu`` hides CUDA first: Megatron chooses CUDA whenever
    it sees one) and ``collective_timeout_s``, which its collectives wait from :func:`end_startup` on
    (until then, as long as a connect). Returns whether this call started it (then the
    caller tears it down with :func:`destroy_distributed`). ValueError names a device that cannot
    serve the launch. Caps glibc's malloc arenas first (:mod:`verl.utils.malloc`)."""
    global _startup
    if dist.is_initialized():
        return False
    # Before vLLM's, the saves' and the reward pool's threads exist: a long run's RSS stays flat.
    cap_malloc_arenas()
    if trainer.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    _startup = []  # until end_startup (module docstring)
    try:
        init_distributed(device=trainer.device, timeout=datetime.timedelta(seconds=trainer.collective_timeout_s))
    except BaseException:
        _startup = None
        raise
    return True


@contextlib.contextmanager
def distributed_world(trainer: Any) -> Iterator[bool]:
    """``with distributed_world(cfg.trainer) as started:``: :func:`start_world` on entry, and on
    exit :func:`destroy_distributed` when this block started the world."""
    started = start_world(trainer)
    try:
        yield started
    finally:
        if started:
            destroy_distributed()


def destroy_distributed() -> None:
    """Tear down Megatron's parallel state (if it was built) and the default process group."""
    global _startup
    _startup = None  # the groups it held are going
    if "verl.parallel.megatron_state" in sys.modules or "megatron.core.parallel_state" in sys.modules:
        from verl.parallel import megatron_state

        megatron_state.destroy_model_parallel()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _spawned_rank(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    init_distributed()
    finished = False
    try:
        results.put((rank, fn(*args)))
        finished = True
    finally:
        if finished:
            # No rank tears the world down before every rank has finished ``fn``: gloo's connect is
            # two-sided, so a rank whose ``fn`` has no collective could otherwise close its side
            # (or rank 0 its store) while a peer is still inside ``init_process_group`` ("Gloo
            # connectFullMesh failed ... Connection closed by peer"; 7 of 60 runs under load).
            # A failed rank skips this: ``start_processes`` then stops its peers.
            dist.barrier()
        destroy_distributed()


def run_on_ranks(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks with torch.distributed initialised.

    Under torchrun the current world runs it (its size must equal ``world_size``); otherwise
    ``world_size`` processes are spawned (a picklable, module-level ``fn``). Megatron's parallel
    state is torn down after ``fn``. Returns every rank's value, indexed by rank.
    """
    if under_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world_size:
            raise ValueError(
                f"launched with WORLD_SIZE={os.environ['WORLD_SIZE']} but the layout needs {world_size} ranks; "
                "start torchrun with that many processes, or run without torchrun"
            )
        init_distributed()
        from verl.parallel.megatron_state import destroy_model_parallel

        try:
            value = fn(*args)
        finally:
            destroy_model_parallel()
        out: list[Any] = [None] * world_size
        dist.all_gather_object(out, value)
        return out

    import torch.multiprocessing as mp

    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(
        _spawned_rank, args=(world_size, free_port(), fn, args, results), nprocs=world_size, join=True,
        start_method="spawn",
    )
    values: list[Any] = [None] * world_size
    while not results.empty():
        r, value = results.get()
        values[r] = value
    return values
