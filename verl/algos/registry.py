"""A named registry of plain functions, the one mechanism behind every ``get_*`` lookup in verl.algos.

Config selects an algorithm by string (``algorithm.adv_estimator=grpo``); the registry maps that
string to a function, lists what exists, and fails with the full list when a name is unknown.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Generic, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class Registry(Generic[F]):
    """Name -> function table for one kind of algorithm piece (e.g. "advantage estimator").

    ``kind`` and ``config_key`` only shape error messages, so a user who mistypes a name is told
    which config field to change and which names exist.
    """

    def __init__(self, kind: str, config_key: str) -> None:
        self.kind = kind
        self.config_key = config_key
        self._table: dict[str, F] = {}

    def register(self, *names: str) -> Callable[[F], F]:
        """Decorator: register the function under each of ``names`` (the first is its canonical name).

        Registering a different function under a taken name is an error (two plugins colliding
        silently would change results); re-registering the same function is a no-op.
        """
        if not names:
            raise ValueError(f"register() for a {self.kind} needs at least one name")

        def decorator(fn: F) -> F:
            for name in names:
                if not isinstance(name, str) or not name:
                    raise ValueError(f"{self.kind} names must be non-empty strings, got {name!r}")
                existing = self._table.get(name)
                if existing is not None and existing is not fn:
                    raise ValueError(
                        f"{self.kind} {name!r} is already registered to "
                        f"{existing.__module__}.{existing.__qualname__}; pick another name"
                    )
                self._table[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        """The function registered as ``name``; ValueError listing every registered name otherwise."""
        if not isinstance(name, str):
            raise ValueError(
                f"{self.config_key} must be a string naming a {self.kind}, got {type(name).__name__} "
                f"{name!r}; registered: {self.names()}"
            )
        try:
            return self._table[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r} (config key {self.config_key}); "
                f"registered: {self.names()}"
            ) from None

    def names(self) -> list[str]:
        """Every registered name (aliases included), sorted."""
        return sorted(self._table)

    def __contains__(self, name: object) -> bool:
        return name in self._table


def call_with_accepted(fn: Callable[..., Any], what: str, inputs: dict[str, Any]) -> Any:
    """Call ``fn`` with the subset of ``inputs`` that its signature names.

    A trainer holds every tensor a step has (values, index, reward_baselines...) but each
    registered function needs only some; this passes exactly those and reports a missing
    required argument by name instead of a bare TypeError.
    """
    sig = inspect.signature(fn)
    params = sig.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(**inputs)
    missing = [
        name
        for name, p in params.items()
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        and name not in inputs
    ]
    if missing:
        raise ValueError(f"{what} needs {missing}, which were not given; it takes {list(params)}")
    return fn(**{k: v for k, v in inputs.items() if k in params})
