"""A rollout engine without a model, for tests that script its samples.

Subclasses define only ``_sample(prompts, spec) -> list[Sample]``; the weight, memory and
lifecycle methods of :class:`~verl.rollout.base.RolloutEngine` do nothing (there are no weights,
no KV cache), and a weight push is refused with a TypeError, since a scripted engine cannot take one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from verl.rollout.base import RolloutEngine


class WeightlessEngine(RolloutEngine):
    """A :class:`RolloutEngine` whose samples come from the subclass's ``_sample`` alone."""

    def update_weights(self, weights: Any) -> None:
        raise TypeError(f"{type(self).__name__} is a scripted test engine: it has no weights to take a push into")

    def named_parameters(self) -> Iterator[tuple[str, Any]]:
        return iter(())

    def release(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def kv_cache_bytes(self) -> int:
        return 0

    def shutdown(self) -> None:
        pass
