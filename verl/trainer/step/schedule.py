"""What runs beside the update, by rollout mode: a schedule object with named points of the step.

``StepPieces.update_step`` is written once; at each named point it asks the step's schedule:

| point | when |
| --- | --- |
| ``before_passes(ctx, batch)`` | the batch is scored; the old/reference log-probs and values are next |
| ``share_passes(ctx, batch, shares)`` | the passes ran on their ranks: hand their columns over (True: this rank has them now) |
| ``before_updates(ctx, batch)`` | the advantages are on the batch; the critic and actor updates are next |
| ``after_updates(ctx)`` | this rank's updates are done, before the collective that gathers their metrics |
| ``share_updates(ctx, batch, shares, updates)`` | hand the updates' metrics (and passes' columns not yet shared) to every rank |
| ``hold()`` | a block in which nothing runs beside the main thread (validation, checkpoints) |
| ``close()`` | the end of the run |

The schedules (``trainer.rollout_mode``; ``verl.trainer.step.stream`` owns the queue they fill):

- :class:`SyncSchedule` (``sync``): nothing runs beside the step; columns and metrics are exchanged once each.
- :class:`StepPacedSchedule` (``one_step_off``/``async`` with the rollout on a rank of the passes'
  roles): the batches of the next steps are generated between the advantages and the updates.
- :class:`StepPacedApartSchedule` (the same with the rollout on ranks that only generate,
  ``RLWorld.trainer_group``): those ranks generate from the start of the update step, so they join no
  collective until the updates end; the other ranks hand each other the passes' columns over the
  trainer group, and the generating ranks get them, with the updates' metrics, after the updates.
- :class:`FreeRunningSchedule` (``async_training.free_running``): as the one before, but a thread
  generates throughout (``verl.trainer.step.generator``); the step only holds it for the push,
  validation, checkpoints and the end.

A new mode is a new class with these methods (``docs/step.md`` shows one).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from verl.protocol import Batch
    from verl.trainer.step.context import StepContext

__all__ = ["FreeRunningSchedule", "Schedule", "StepPacedApartSchedule", "StepPacedSchedule", "SyncSchedule"]

# (role, the batch columns it computed, its metrics), as RLWorld.exchange takes them
Shares = list[tuple[str, list[str], dict[str, float]]]


class Schedule(Protocol):
    """The named points of the step (module docstring); every method is called on every rank."""

    def before_passes(self, ctx: "StepContext", batch: "Batch") -> dict[str, float]: ...

    def share_passes(self, ctx: "StepContext", batch: "Batch", shares: Shares) -> tuple["Batch", dict[str, float], bool]: ...

    def before_updates(self, ctx: "StepContext", batch: "Batch") -> dict[str, float]: ...

    def after_updates(self, ctx: "StepContext") -> None: ...

    def share_updates(
        self, ctx: "StepContext", batch: "Batch", shares: Shares, updates: Shares
    ) -> tuple["Batch", dict[str, float]]: ...

    def hold(self) -> contextlib.AbstractContextManager[None]: ...

    def close(self) -> None: ...


class SyncSchedule:
    """``trainer.rollout_mode=sync``: nothing runs beside the step."""

    def __init__(self, world: Any) -> None:
        self.world = world

    def before_passes(self, ctx: "StepContext", batch: "Batch") -> dict[str, float]:
        return {}

    def share_passes(self, ctx: "StepContext", batch: "Batch", shares: Shares) -> tuple["Batch", dict[str, float], bool]:
        batch, metrics = self.world.exchange(batch, shares)
        return batch, metrics, True

    def before_updates(self, ctx: "StepContext", batch: "Batch") -> dict[str, float]:
        return {}

    def after_updates(self, ctx: "StepContext") -> None:
        pass

    def share_updates(
        self, ctx: "StepContext", batch: "Batch", shares: Shares, updates: Shares
    ) -> tuple["Batch", dict[str, float]]:
        return batch, self.world.exchange(None, updates)[1]

    def hold(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def close(self) -> None:
        pass


class StepPacedSchedule(SyncSchedule):
    """``one_step_off``/``async``, the rollout on a rank of the passes' roles: the next steps' batches
    are generated between the advantages and the updates (``StreamRolloutOperator.generate_ahead``)."""

    def __init__(self, world: Any, stream: Any) -> None:
        super().__init__(world)
        self.stream = stream

    def before_updates(self, ctx: "StepContext", batch: "Batch") -> dict[str, float]:
        with ctx.timer("gen_ahead"):
            return self.stream.generate_ahead(ctx)

    def after_updates(self, ctx: "StepContext") -> None:
        self.stream.update_done(ctx)


def _share_passes_among_trainers(world: Any, batch: "Batch", shares: Shares) -> tuple["Batch", dict[str, float], bool]:
    """The passes' columns over the trainer group; a rank that only generates gets them later."""
    if world.generates_only:
        return batch, {}, False
    batch, metrics = world.exchange_among_trainers(batch, shares)
    return batch, metrics, True


def _share_updates_with_generators(
    world: Any, batch: "Batch", shares: Shares, updates: Shares
) -> tuple["Batch", dict[str, float]]:
    """The passes' columns reach the ranks that only generate (the others keep their own), then
    every rank gets the updates' metrics."""
    metrics: dict[str, float] = {}
    keys = [key for _, names, _ in shares for key in names]
    got, more = world.exchange(batch if world.generates_only else batch.select(keys), shares)
    if world.generates_only:
        batch = got
        metrics.update(more)
    metrics.update(world.exchange(None, updates)[1])
    return batch, metrics


class StepPacedApartSchedule(SyncSchedule):
    """``one_step_off``/``async`` with ranks that only generate (``RLWorld.trainer_group``): they
    generate ahead from the start of the update step and get the passes' columns after the updates."""

    def __init__(self, world: Any, stream: Any) -> None:
        super().__init__(world)
        self.stream = stream

    def before_passes(self, ctx: "StepContext", batch: "Batch") -> dict[str, float]:
        with ctx.timer("gen_ahead"):
            return self.stream.generate_ahead(ctx)

    def share_passes(self, ctx: "StepContext", batch: "Batch", shares: Shares) -> tuple["Batch", dict[str, float], bool]:
        return _share_passes_among_trainers(self.world, batch, shares)

    def after_updates(self, ctx: "StepContext") -> None:
        self.stream.update_done(ctx)

    def share_updates(
        self, ctx: "StepContext", batch: "Batch", shares: Shares, updates: Shares
    ) -> tuple["Batch", dict[str, float]]:
        return _share_updates_with_generators(self.world, batch, shares, updates)


class FreeRunningSchedule(SyncSchedule):
    """``async_training.free_running``: the generator thread runs through the step; the step holds it
    (``hold``) for validation and checkpoints, the stream holds it for the push and the hand-over."""

    def __init__(self, world: Any, stream: Any, generator: Any) -> None:
        super().__init__(world)
        self.stream = stream
        self.generator = generator  # verl.trainer.step.generator.Generator on the rollout's ranks, else None

    def share_passes(self, ctx: "StepContext", batch: "Batch", shares: Shares) -> tuple["Batch", dict[str, float], bool]:
        return _share_passes_among_trainers(self.world, batch, shares)

    def share_updates(
        self, ctx: "StepContext", batch: "Batch", shares: Shares, updates: Shares
    ) -> tuple["Batch", dict[str, float]]:
        return _share_updates_with_generators(self.world, batch, shares, updates)

    def hold(self) -> contextlib.AbstractContextManager[None]:
        return self.stream.held()  # the thread paused, the queue the main thread's (verl.trainer.step.queue)

    def close(self) -> None:
        if self.generator is not None:
            self.generator.stop()
