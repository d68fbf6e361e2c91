"""The operator protocol of ``verl.DataStream``.

An operator is any object with

- ``inputs``: the batch fields it reads (a tuple of names; checked when it is added to a stream:
  an earlier operator must list each in its ``outputs``),
- ``outputs``: the fields it adds,
- ``process(batch)``: the one method; takes the step's ``verl.protocol.Batch`` (None for the first
  operator of a stream, which makes the batch) and returns the batch, or ``(batch, metrics)``.

A user-written operator needs nothing else (no base class)::

    class ResponseLength:
        inputs = ("response_mask",)
        outputs = ("response_length",)

        def process(self, batch):
            batch["response_length"] = batch["response_mask"].sum(-1)  # [B]
            return batch

The built-in operators subclass :class:`Operator`, which adds what the stream needs to give them
the trainer: :meth:`Operator.bind` and :meth:`Operator.config_overrides`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from verl.trainer.step.pieces import StepPieces

__all__ = ["Operator", "declared", "operator_name"]


class Operator:
    """Base of the built-in operators: one step piece of :class:`verl.trainer.ppo_trainer.PPOTrainer`."""

    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    # The step's schedule this operator brings (verl.trainer.step.schedule), set when it is bound;
    # None: it runs under the pipeline's (the synchronous one unless another operator brings one).
    schedule: Any = None

    def __init__(self) -> None:
        self._trainer: "StepPieces | None" = None

    def config_overrides(self) -> dict[str, Any]:
        """Config keys (dotted) this operator's arguments set; a stream that builds its trainer
        applies them, one given a trainer checks them."""
        return {}

    def check_config(self, cfg: Any) -> None:
        """Refuse (ValueError naming the fix) a config this operator cannot train with; a stream
        calls it when it builds its config, before any model is built."""

    def bind(self, trainer: "StepPieces") -> None:
        """Attach the trainer whose roles this operator calls (the stream does this)."""
        self._trainer = trainer

    @property
    def trainer(self) -> "StepPieces":
        if self._trainer is None:
            raise ValueError(f"{type(self).__name__} is not in a DataStream yet: add it with stream.add_operator(op)")
        return self._trainer


def declared(op: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(inputs, outputs) of ``op``, each a tuple of field names; TypeError when one is not."""
    result = []
    for attr in ("inputs", "outputs"):
        value = getattr(op, attr, ())
        if isinstance(value, str) or not all(isinstance(v, str) for v in value):
            raise TypeError(f"{type(op).__name__}.{attr} must be a tuple of field names, got {value!r}")
        result.append(tuple(value))
    return result[0], result[1]


def operator_name(op: Any, taken: list[str]) -> str:
    """``op``'s name in metrics (``timing_s/op/<name>``): its ``name`` attribute or class name,
    with ``_2``, ``_3`` ... when the stream already has one of that name."""
    base = str(getattr(op, "name", "") or type(op).__name__)
    name, i = base, 2
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    return name
