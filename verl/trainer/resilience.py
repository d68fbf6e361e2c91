"""What keeps a long run honest when something goes wrong: signals, non-finite steps, lost ranks.

- :class:`StopSignals`: SIGTERM, SIGINT and SIGUSR1 (Slurm's ``--signal`` preemption warning)
  ask the run to stop after the current step; the trainer then checkpoints, says where, and
  exits 128 + the signal's number. A second signal stops at once (the default action of that
  signal); the same signal again within :data:`_ECHO_S` is the first one forwarded by torchrun to a
  rank that got it from its process group too, and changes nothing. Every rank
  agrees on the decision at the end of each step (:meth:`StopSignals.agreed`, one all-reduce
  of one integer), so a signal that reached only some ranks never leaves the others waiting
  in a collective.
- :class:`SkippedSteps`: a step whose actor or critic update was skipped (a non-finite loss
  or gradient norm: the engine does not apply it) is counted; ``trainer.max_consecutive_skipped_steps``
  in a row stop the run with a message naming the steps and the last good checkpoint.
- :func:`check_finite_rewards`: a non-finite reward or advantage is refused before any update,
  naming the sample and its ``data_source``.
- :class:`PhaseBoard`: each rank posts the phase it is in (``gen``, ``update_actor`` ...) to the
  job's key-value store; when a collective fails or times out (``trainer.collective_timeout_s``),
  :func:`rank_failure` reads the board and names the rank that stopped answering and the phase
  it was last seen in (:class:`RankFailure`; the entry point exits non-zero).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from verl.utils.logging import log_rank0

logger = logging.getLogger(__name__)

__all__ = [
    "STOP_SIGNALS",
    "PhaseBoard",
    "RankFailure",
    "SkippedSteps",
    "StopSignals",
    "check_finite_rewards",
    "is_collective_failure",
    "rank_failure",
]

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
_ECHO_S = 2.0  # the same signal again this soon is torchrun's forward of the first, not a second one


def _world_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class StopSignals:
    """Catch :data:`STOP_SIGNALS` while a run trains (module docstring); a context manager.

    Handlers can only be installed from the main thread; elsewhere (a test harness thread)
    the signals keep their default action and :attr:`received` stays None.
    """

    def __init__(self, signals: Sequence[signal.Signals] = STOP_SIGNALS) -> None:
        self.signals = tuple(signals)
        self.received: signal.Signals | None = None
        self._received_at = 0.0
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: object) -> None:
        sig = signal.Signals(signum)
        if sig == self.received and time.monotonic() - self._received_at < _ECHO_S:
            # The same signal again at once: torchrun forwarding what its whole process group got
            # (Ctrl-C on a terminal, Slurm's scancel), not a second request.
            return
        if self.received is not None:
            # The second signal: stop now, as that signal would without us.
            logger.warning("%s again: stopping now, without a checkpoint", sig.name)
            self.__exit__()
            signal.signal(sig, signal.SIG_DFL)
            signal.raise_signal(sig)
            return
        self.received, self._received_at = sig, time.monotonic()
        # A handler may run between any two bytecodes; logging takes locks, so only a write.
        os.write(
            2,
            f"[rank{os.environ.get('RANK', '0')}] {sig.name} received: finishing the current step, "
            f"then a checkpoint and exit (send it again to stop at once)\n".encode(),
        )

    def agreed(self) -> signal.Signals | None:
        """The signal any rank received (collective over the world; every rank calls it at the
        same point), or None. Without torch.distributed, this process's own."""
        mine = int(self.received) if self.received is not None else 0
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.received
        flag = torch.tensor([mine], dtype=torch.int64, device=_world_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        value = int(flag.item())
        return signal.Signals(value) if value else None


class SkippedSteps:
    """Count steps whose update was skipped; stop after ``limit`` in a row (0: never stop)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.total = 0
        self.consecutive: list[int] = []  # the steps of the current run of skipped steps

    def record(self, step: int, skipped: bool, *, last_checkpoint: str | None) -> dict[str, float]:
        """Note step ``step``; returns its metrics. ValueError once ``limit`` steps in a row were skipped."""
        if skipped:
            self.total += 1
            self.consecutive.append(step)
            logger.warning(
                "step %d: non-finite loss or gradient norm, the update was skipped (%d in a row, %d in all)",
                step,
                len(self.consecutive),
                self.total,
            )
        else:
            self.consecutive = []
        if self.limit > 0 and len(self.consecutive) >= self.limit:
            where = (
                f"the last good checkpoint is {last_checkpoint}"
                if last_checkpoint
                else "no checkpoint was written yet (trainer.save_freq)"
            )
            raise ValueError(
                f"steps {self.consecutive[0]}-{self.consecutive[-1]}: {len(self.consecutive)} updates in a row "
                f"were skipped for a non-finite loss or gradient norm (trainer.max_consecutive_skipped_steps="
                f"{self.limit}); {where}. Lower the learning rate or raise actor.optim.clip_grad, check the "
                "reward function, and resume from that checkpoint"
            )
        return {
            "training/skipped_steps": float(self.total),
            "training/consecutive_skipped_steps": float(len(self.consecutive)),
        }


def check_finite_rewards(
    step: int, tensors: dict[str, torch.Tensor], mask: torch.Tensor, data_sources: Sequence[Any]
) -> None:
    """ValueError naming the first sample (and its data source) whose value in any of ``tensors``
    (``token_level_rewards``, ``advantages`` [B, R]) is non-finite on a response token."""
    valid = mask.bool()
    for name, values in tensors.items():
        bad = ~torch.isfinite(values) & valid
        if bool(bad.any()):
            rows = torch.nonzero(bad.any(dim=-1)).flatten().tolist()
            first = rows[0]
            value = values[first][bad[first]][0].item()
            raise ValueError(
                f"step {step}: {name} is {value} for sample {first} (data_source={data_sources[first]!r})"
                f"{f' and {len(rows) - 1} more' if len(rows) > 1 else ''}; the update was not made. "
                "A reward function returned a non-finite score, or the values diverged: check that "
                "data source's scorer (custom_reward_function) and resume from the last checkpoint"
            )


# -- lost ranks ---------------------------------------------------------------------------


class RankFailure(RuntimeError):
    """A collective failed or timed out because another rank died or hung; the message names it."""


# What gloo's and the c10d store's errors say when a peer is gone or silent (NCCL's and newer
# gloo's are DistError subclasses).
_FAILURE_MARKERS = (
    "timed out",
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
)


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a torch.distributed communication failure (a dead or hung peer)."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return any(marker in text for marker in _FAILURE_MARKERS)


class PhaseBoard:
    """Where each rank is: ``(step, phase, time)`` posted to the job's c10d store on every change.

    The store is the one torch.distributed was started with (torchrun's rendezvous store
    outlives the ranks it serves). Posting costs one small store write per phase.
    """

    _KEY = "verl/phase/{rank}"
    _FAILED = "verl/failed/{rank}"

    def __init__(self) -> None:
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.step = 0
        self.phase = "start"
        self.since = time.time()
        self._store = None
        if self.world_size > 1:
            try:
                from torch.distributed.distributed_c10d import _get_default_store

                self._store = _get_default_store()
            except (ImportError, RuntimeError, ValueError):  # pragma: no cover - a torch without it
                self._store = None
        self.post("start", 0)

    @property
    def answering(self) -> bool:
        """Whether the job's store still answers (False in a world of one)."""
        return self._store is not None

    def post(self, phase: str, step: int) -> None:
        self.phase, self.step, self.since = phase, step, time.time()
        if self._store is None:
            return
        try:
            self._store.set(
                self._KEY.format(rank=self.rank), json.dumps({"step": step, "phase": phase, "time": self.since})
            )
        except Exception:  # noqa: BLE001 - the board only helps a failure message; never fail a step for it
            self._store = None

    def others(self) -> dict[int, dict[str, Any] | None]:
        """Every other rank's last post (None: never posted, or the store no longer answers)."""
        return {rank: self._read(self._KEY.format(rank=rank)) for rank in range(self.world_size) if rank != self.rank}

    def _read(self, key: str) -> dict[str, Any] | None:
        if self._store is None:
            return None
        try:
            self._store.set_timeout(timedelta(seconds=5))
            if self._store.check([key]):
                return json.loads(self._store.get(key))
        except Exception:  # noqa: BLE001 - a store that died with its rank
            self._store = None
        return None

    def roll_call(self, wait_s: float) -> list[int]:
        """After a failed collective: say so on the board, then wait up to ``wait_s`` for every
        other rank to say the same; returns the ranks that did not (dead, hung, or elsewhere)."""
        if self._store is None:
            return []
        try:
            self._store.set(self._FAILED.format(rank=self.rank), "1")
        except Exception:  # noqa: BLE001
            self._store = None
            return []
        missing = [rank for rank in range(self.world_size) if rank != self.rank]
        deadline = time.time() + wait_s
        while missing and self._store is not None:
            missing = [rank for rank in missing if self._read(self._FAILED.format(rank=rank)) is None]
            if not missing or time.time() > deadline:
                break
            time.sleep(0.1)
        return missing


def rank_failure(board: PhaseBoard, exc: BaseException, *, timeout_s: float, wait_s: float = 3.0) -> RankFailure:
    """The message for a failed collective: where this rank was, and which ranks stopped answering
    (the ranks that do not join :meth:`PhaseBoard.roll_call` within ``wait_s``)."""
    now = time.time()
    waited = now - board.since
    lines = [
        f"rank {board.rank}: a collective failed in phase '{board.phase}' of step {board.step} after "
        f"{waited:.0f} s (trainer.collective_timeout_s={timeout_s:g}): another rank died or stopped answering."
    ]
    missing = board.roll_call(wait_s)
    posts = board.others()
    if missing:
        described = []
        for rank in missing:
            post = posts.get(rank)
            described.append(
                f"rank {rank} (last seen in phase '{post['phase']}' of step {post['step']}, "
                f"{now - post['time']:.0f} s before this failure)"
                if post
                else f"rank {rank} (never seen)"
            )
        lines.append("Not answering: " + ", ".join(described) + "; its own log (or the launcher's) says why.")
    elif board.world_size > 1 and board.answering:
        lines.append("Every other rank saw a failure too; the communication itself failed.")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    lines.append(f"The error: {first}")
    return RankFailure(" ".join(lines))


def log_stop(signal_name: str, step: int, checkpoint: str | None) -> None:
    """Say, once, why the run stopped and where it can resume from."""
    log_rank0(
        logger,
        logging.WARNING,
        "%s: stopped after step %d; %s",
        signal_name,
        step,
        f"checkpoint {checkpoint} (trainer.resume_mode=auto continues from it)"
        if checkpoint
        else "no checkpoint was written (trainer.save_freq=-1 and nothing to save)",
    )

