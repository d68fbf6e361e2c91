"""The batches generated ahead of their step (``verl.trainer.step.stream``), as explicit states.

Each :class:`AheadBatch` is in one :class:`State`:

| state | what it holds | reached by |
| --- | --- | --- |
| ``DRAWN`` | its step's prompts (the rollout's ranks), nothing generated | :meth:`AheadQueue.draw` |
| ``IN_FLIGHT`` | a partial rollout's samples so far (``partial``) | :meth:`AheadQueue.begin` with a ``PartialBatch`` |
| ``FINISHED`` | the whole batch (``generated``) | :meth:`AheadQueue.begin` with a batch, :meth:`AheadQueue.finish` |
| ``DROPPED`` | nothing: its samples were beyond the staleness bound and are sampled again | :meth:`AheadQueue.drop` |

On ranks without the rollout every batch stays ``DRAWN``: a placeholder for the step whose batch
the rollout's ranks hand over.

Who may change the queue: its *owner*. Without a generator thread that is always the main thread.
With the free-running generator the main thread lends the queue to the thread (:meth:`lend`) when it
lets the thread run, and takes it back (:meth:`take_back`) inside every hold; the thread may only
begin, advance (``IN_FLIGHT`` to ``IN_FLIGHT``) and finish batches, never draw, pop or drop them,
and only while it holds the queue. Every transition asserts both, so a break of the protocol is an
error at the line that breaks it, not a race.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
from typing import Any

from verl.trainer.step.generator import THREAD_NAME

__all__ = ["AheadBatch", "AheadQueue", "State"]


class State(enum.Enum):
    DRAWN = "drawn"
    IN_FLIGHT = "in_flight"
    FINISHED = "finished"
    DROPPED = "dropped"


@dataclasses.dataclass
class AheadBatch:
    """One step's batch ahead (module docstring)."""

    step: int  # the step that trains it
    version: int = -1  # the actor updates done before the weights that began it (-1: not begun)
    state: State = State.DRAWN
    prompts: Any = None  # its prompts (the rollout's ranks): stale_samples=drop samples them again
    partial: Any = None  # IN_FLIGHT: the batch in flight (verl.trainer.step.partial.PartialBatch)
    # StepPieces.generate_here's (batch, ReMax's greedy batch or None, metrics); the batch is None
    # until FINISHED and on ranks without the rollout
    generated: tuple[Any, Any, dict[str, float]] = (None, None, {})


class AheadQueue:
    """The batches generated ahead, oldest first, and who may change them (module docstring)."""

    def __init__(self) -> None:
        self._items: list[AheadBatch] = []
        self.exhausted = False  # the data is used up: no batch will be drawn again
        self._lent = False  # the generator thread holds the queue

    # -- ownership ------------------------------------------------------------------------

    def lend(self) -> None:
        """The main thread lets the generator thread change the queue until :meth:`take_back`
        (before it starts the thread, and at the end of every hold)."""
        assert not _on_generator(), "the generator thread cannot lend itself the queue"
        self._lent = True

    def take_back(self) -> None:
        """Inside a hold (the thread paused): the main thread owns the queue again."""
        assert not _on_generator(), "only the main thread takes the queue back"
        self._lent = False

    def _assert_main(self) -> None:
        assert not self._lent, "the queue is lent to the generator thread: the main thread changes it only in a hold"
        assert not _on_generator(), "the generator thread may not draw, pop or drop batches"

    def _assert_owner(self) -> None:
        if self._lent:
            assert _on_generator(), "the main thread changed the queue while it was lent to the generator"
        else:
            assert not _on_generator(), "the generator thread changed the queue during a hold"

    # -- reading ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(list(self._items))

    def __bool__(self) -> bool:
        return bool(self._items)

    def oldest_unfinished(self) -> AheadBatch | None:
        """The oldest batch not yet ``FINISHED`` (the generator's next work), or None."""
        return next((b for b in self._items if b.state in (State.DRAWN, State.IN_FLIGHT)), None)

    # -- the main thread's transitions ----------------------------------------------------------

    def draw(self, batch: AheadBatch) -> None:
        """Append a ``DRAWN`` batch (its prompts only)."""
        self._assert_main()
        assert batch.state is State.DRAWN, batch.state
        self._items.append(batch)

    def pop(self, step: int) -> AheadBatch:
        """The oldest batch, which must be step ``step``'s."""
        self._assert_main()
        batch = self._items.pop(0)
        if batch.step != step:
            raise RuntimeError(f"the streaming rollout's next batch is for step {batch.step}, not step {step}")
        return batch

    def drop(self, batch: AheadBatch) -> None:
        """A batch in flight begun beyond the staleness bound: its samples dropped (to be sampled again)."""
        self._assert_main()
        assert batch.state is State.IN_FLIGHT, batch.state
        batch.partial, batch.state = None, State.DROPPED

    # -- transitions of the queue's owner (the main thread, or the generator while lent) --------

    def begin(self, batch: AheadBatch, version: int, *, partial: Any = None, generated: Any = None) -> None:
        """``DRAWN`` (or ``DROPPED``) -> ``IN_FLIGHT`` with ``partial``, or -> ``FINISHED`` with ``generated``,
        begun by policy ``version``."""
        self._assert_owner()
        assert batch.state in (State.DRAWN, State.DROPPED), batch.state
        assert (partial is None) != (generated is None), "begin with a partial batch or a whole one"
        batch.version = version if batch.state is State.DRAWN else batch.version
        if partial is not None:
            batch.partial, batch.state = partial, State.IN_FLIGHT
        else:
            batch.generated, batch.state = generated, State.FINISHED

    def finish(self, batch: AheadBatch, generated: tuple[Any, Any, dict[str, float]]) -> None:
        """``IN_FLIGHT`` (or ``DROPPED``, sampled again) -> ``FINISHED`` with the assembled batch."""
        self._assert_owner()
        assert batch.state in (State.IN_FLIGHT, State.DROPPED), batch.state
        batch.generated, batch.partial, batch.state = generated, None, State.FINISHED

    def assert_in_flight(self, batch: AheadBatch) -> None:
        """Before a segment of ``batch``: it is ``IN_FLIGHT`` and the caller owns the queue."""
        self._assert_owner()
        assert batch.state is State.IN_FLIGHT, batch.state

    def restore(self, batches: list[AheadBatch], exhausted: bool) -> None:
        """The queue a checkpoint held (the main thread, before the run's first step)."""
        self._assert_main()
        self._items, self.exhausted = list(batches), exhausted


def _on_generator() -> bool:
    return threading.current_thread().name == THREAD_NAME
