"""The state of the step in progress, handed to its schedule and its pieces.

``StepPipeline.run`` begins a :class:`StepContext` (``StepPieces.begin_step``), runs the operators
in it and ends it. Inside a step, everything reads the step from here: ``ctx.step`` is the step in
progress (1-based) for the whole step, and ``ctx.version`` the policy version it begins from (the
actor updates done before it), which is also the version the rollout engine holds throughout.
The trainer's ``global_step`` counts the steps begun; the pipeline advances it in one place, once
the step's first operator has drawn its batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["PhaseTimer", "StepContext"]


class PhaseTimer:
    """``with timer("gen"):`` adds the block's seconds to ``timing_s/gen`` (and tells ``on_enter``
    the phase's name)."""

    def __init__(self, on_enter: Callable[[str], None] | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self.on_enter = on_enter

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self.on_enter is not None:
            self.on_enter(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{k}": v for k, v in self.seconds.items()}


@dataclasses.dataclass
class StepContext:
    """One step: its number, its clock, its phase timer and the schedule of its mode
    (``verl.trainer.step.schedule``)."""

    step: int  # the step in progress, 1-based
    timer: PhaseTimer
    schedule: Any  # verl.trainer.step.schedule.Schedule
    start: float = dataclasses.field(default_factory=time.perf_counter)

    @property
    def version(self) -> int:
        """The policy version the step begins from: the actor updates done before it."""
        return self.step - 1

    def seconds(self) -> float:
        """Seconds since the step began."""
        return time.perf_counter() - self.start
