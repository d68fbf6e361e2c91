"""The free-running generator (``trainer.async_training.free_running``): on each rank that only
generates, a thread runs segments of the streaming rollout's batches in flight without stopping
at step boundaries (``verl.trainer.step.stream``).

The thread owns the engine between *holds*. The main thread takes one (:meth:`Generator.held`)
whenever it needs the engine or a still picture of the queue: the weight push and the step's own
batch (``StreamRolloutOperator.process``), validation, a checkpoint, the end of the run. Outside
holds the main thread takes part in the world's collectives (the batch's hand-over, the reward, the
exchanges of the update step) while the thread generates; ``role_world`` keeps the engine's world
to the thread that entered it (``verl.parallel.role_world``), and the engine takes one call at a
time (``Rollout.lock``).

The protocol, the same on every rollout rank:

- the main thread counts the holds it asks for (``requested``) and ends (``released``);
- before each segment the thread checks whether a hold is asked for that it has not paused for;
  with several rollout ranks they agree over the rollout's group (an all-reduce: a segment is a
  collective of theirs, so if one pauses every one does, before the same segment);
- having paused for hold ``k`` (``rounds = k``), the thread waits until its own main thread has
  released hold ``k``. Every rank's main thread takes the same holds in the same order (they run
  the same step), so a rank paused for a hold its own main thread has not reached yet simply
  waits for it;
- with nothing to do (every batch the bound allows is finished) the thread waits for the next hold;
  what it would do next changes only inside holds, the same on every rank.

An error in the thread is raised again in the main thread at its next hold (the run stops, its
last checkpoint intact); the thread never outlives :meth:`Generator.stop`'s wait by more than the
collective timeout.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["THREAD_NAME", "Generator"]

THREAD_NAME = "verl-free-running-generator"


class Generator:
    """The thread (module docstring).

    Args:
        work: runs one unit of work (one segment of a batch in flight, or a batch's first) and
            returns True, or returns False when there is none; called on the thread only.
        group: the rollout's group (several rollout ranks agree on each pause over it), or None.
        stop_timeout_s: how long :meth:`stop` waits for the thread.
    """

    def __init__(self, work: Callable[[], bool], *, group: Any = None, stop_timeout_s: float = 600.0) -> None:
        self._work = work
        self._group = group if group is not None and torch.distributed.get_world_size(group) > 1 else None
        self._stop_timeout_s = stop_timeout_s
        self._cv = threading.Condition()
        self._requested = 0  # holds the main thread asked for
        self._released = 0  # holds it ended
        self._rounds = 0  # holds the thread paused for
        self._paused = False  # the thread waits between two units of work
        self._stopping = False
        self._holding = False  # the main thread is inside held()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.busy_s = 0.0  # seconds in work since the last take_busy()
        self.units = 0  # units of work since the last take_busy()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the thread (once)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def take_busy(self) -> tuple[float, int]:
        """(seconds, units of work) since the last call (the main thread reads them inside a hold)."""
        with self._cv:
            out = (self.busy_s, self.units)
            self.busy_s, self.units = 0.0, 0
        return out

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The block runs with the thread paused between two units of work (module docstring).
        Before the thread starts (and after it stops) the block just runs."""
        if self._thread is None or self._stopping or self._holding:  # (a hold inside a hold: already paused)
            self._raise()
            yield
            return
        with self._cv:
            self._requested += 1
            target = self._requested
            self._cv.notify_all()
            while not (self._rounds >= target and self._paused) and self._error is None and self._thread.is_alive():
                self._cv.wait(timeout=1.0)
        try:
            self._raise()
            self._holding = True
            yield
        finally:
            self._holding = False
            with self._cv:
                self._released += 1
                self._cv.notify_all()

    def stop(self) -> None:
        """End the thread: a last hold that is never released (every rollout rank calls it at the
        same point, the end of the run)."""
        if self._thread is None or self._stopping:
            return
        with self._cv:
            self._stopping = True
            self._requested += 1
            self._cv.notify_all()
        self._thread.join(timeout=self._stop_timeout_s)
        if self._thread.is_alive():
            logger.warning(
                "the free-running generator did not stop within %.0f s (a collective of the rollout's ranks waits "
                "for a rank that is gone?); leaving it behind", self._stop_timeout_s,
            )
        self._raise()

    # -- the thread -------------------------------------------------------------------------

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"the free-running generator failed: {error!r}") from error

    def _pause_asked(self) -> bool:
        with self._cv:
            asked = self._requested > self._rounds
        if self._group is not None:  # several rollout ranks: paused by one, paused by all
            from verl.protocol.collectives import comm_device

            flag = torch.tensor([int(asked)], device=comm_device(self._group))
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self._group)
            asked = bool(flag.item())
        return asked

    def _run(self) -> None:
        try:
            while True:
                if self._pause_asked():
                    with self._cv:
                        self._rounds += 1
                        self._paused = True
                        self._cv.notify_all()
                        while self._released < self._rounds and not (self._stopping and self._rounds >= self._requested):
                            self._cv.wait()
                        self._paused = False
                        if self._stopping and self._rounds >= self._requested:
                            return
                    continue
                start = time.perf_counter()
                if self._work():
                    with self._cv:
                        self.busy_s += time.perf_counter() - start
                        self.units += 1
                    continue
                with self._cv:  # nothing to do until the next hold changes the queue
                    while self._requested <= self._rounds:
                        self._cv.wait()
        except BaseException as exc:  # raised again in the main thread (held/stop)
            logger.error("the free-running generator failed: %r", exc)
            with self._cv:
                self._error = exc
                self._cv.notify_all()
