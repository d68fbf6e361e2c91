"""Building blocks of verl's typed configuration.

Every config section is a keyword-only dataclass deriving from :class:`ConfigBase`. Each field
is declared with :func:`option` (a leaf value) or :func:`section` (a nested dataclass) so that
its one-line doc sits in ``field.metadata["help"]``, where ``--help`` and :func:`describe`
read it. Values are checked against the field's type hint by :func:`coerce`, the one
conversion routine used for YAML files, command-line overrides and direct construction.

Supported field types: ``bool``, ``int``, ``float``, ``str``, ``Literal[...]``, ``list[T]``,
``dict[str, T]``, ``Any``, unions of those with ``None`` (``int | None``, ``str | list[str]``)
and nested sections.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union, get_args, get_origin

__all__ = [
    "ConfigBase",
    "ConfigError",
    "close_matches",
    "coerce",
    "did_you_mean",
    "is_dict_type",
    "is_section",
    "leaf_default",
    "option",
    "schema",
    "section",
    "type_name",
]

_NoneType = type(None)


class ConfigError(ValueError):
    """A user-supplied configuration is invalid; the message names the key/file at fault and the fix."""


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",  # noqa: A002 - mirrors argparse's keyword
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> Any:
    """Declare a leaf field with its default, one-line doc and optional numeric bounds.

    Mutable defaults (lists, dicts) are copied per instance, so ``option(["console"], ...)`` is safe.
    """
    if not help:
        raise TypeError("every config option needs a one-line help string")
    metadata = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt}
    if isinstance(default, (list, dict)):
        frozen = copy.deepcopy(default)
        return dataclasses.field(default_factory=lambda: copy.deepcopy(frozen), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def section(cls: type, help: str, **defaults: Any) -> Any:  # noqa: A002
    """Declare a nested section of type ``cls``; ``defaults`` replace some of its leaf defaults here.

    ``optim: OptimConfig = section(OptimConfig, "Critic optimizer.", lr=1e-5)`` gives the critic
    its own learning-rate default while every other OptimConfig default stays in OptimConfig.
    """
    if not help:
        raise TypeError("every config section needs a one-line help string")
    unknown = set(defaults) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise TypeError(f"section({cls.__name__}) got defaults for unknown fields {sorted(unknown)}")
    frozen = copy.deepcopy(defaults)
    return dataclasses.field(
        default_factory=lambda: cls(**copy.deepcopy(frozen)),
        metadata={"help": help, "defaults": frozen},
    )


def leaf_default(f: dataclasses.Field, section_defaults: Mapping[str, Any]) -> Any:
    """The default of leaf field ``f`` inside a section whose declaration set ``section_defaults``."""
    if f.name in section_defaults:
        return copy.deepcopy(section_defaults[f.name])
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"config field {f.name} has no default")


def is_section(hint: Any) -> bool:
    """True when ``hint`` is a nested config dataclass."""
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _union_args(hint: Any) -> tuple[Any, ...] | None:
    origin = get_origin(hint)
    if origin is Union or origin is types.UnionType:
        return get_args(hint)
    return None


def is_dict_type(hint: Any) -> bool:
    """True for ``dict``/``dict[str, T]`` fields (and their ``| None`` forms): free-form keys allowed."""
    args = _union_args(hint)
    if args is not None:
        return any(is_dict_type(a) for a in args if a is not _NoneType)
    return hint is dict or get_origin(hint) is dict


def type_name(hint: Any) -> str:
    """Readable name of a type hint, as shown in errors and ``--help`` (``int | None``, ``a|b|c``)."""
    if hint is Any:
        return "any"
    args = _union_args(hint)
    if args is not None:
        return " | ".join("None" if a is _NoneType else type_name(a) for a in args)
    origin = get_origin(hint)
    if origin is Literal:
        return "|".join(str(a) for a in get_args(hint))
    if origin is list:
        (item,) = get_args(hint) or (Any,)
        return f"list[{type_name(item)}]"
    if origin is dict or hint is dict:
        return "dict"
    if isinstance(hint, type):
        return hint.__name__
    return str(hint)


@functools.cache
def schema(cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    """``{field name: (Field, resolved type hint)}`` of a config dataclass, in declaration order."""
    hints = typing.get_type_hints(cls)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(cls)}


def close_matches(word: str, candidates: list[str] | tuple[str, ...]) -> list[str]:
    """Up to three candidates close to ``word`` (difflib ratio >= 0.6), best first."""
    return difflib.get_close_matches(word, list(candidates), n=3, cutoff=0.6)


def did_you_mean(word: str, candidates: list[str] | tuple[str, ...]) -> str:
    """``"; did you mean 'x'?"`` (or ``'x' or 'y'``) for close matches of ``word``, else ``""``."""
    matches = close_matches(word, candidates)
    if not matches:
        return ""
    return "; did you mean " + " or ".join(repr(m) for m in matches) + "?"


class _Mismatch(Exception):
    """Internal: a value does not fit a type; ``hint`` carries an optional did-you-mean."""

    def __init__(self, suggestion: str = "") -> None:
        super().__init__(suggestion)
        self.suggestion = suggestion


def _convert(value: Any, hint: Any, raw: str | None, wrap_scalar: bool) -> Any:
    """Convert ``value`` to ``hint`` or raise _Mismatch. ``raw`` is the command-line text, if any."""
    if hint is Any:
        return value
    args = _union_args(hint)
    if args is not None:
        if value is None:
            if _NoneType in args:
                return None
            raise _Mismatch()
        members = [a for a in args if a is not _NoneType]
        # str last: a command-line "[a,b]" or "3" must first get a chance as list / int.
        ordered = [a for a in members if a is not str] + [a for a in members if a is str]
        for member in ordered:
            try:
                return _convert(value, member, raw, wrap_scalar=False)
            except _Mismatch:
                continue
        raise _Mismatch()
    origin = get_origin(hint)
    if origin is Literal:
        choices = get_args(hint)
        if isinstance(value, str) and value in choices:
            return value
        raise _Mismatch(did_you_mean(str(value), [str(c) for c in choices]))
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch()
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise _Mismatch() from None
        raise _Mismatch()
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # PyYAML reads "1e-6" (no dot) as a string
            except ValueError:
                raise _Mismatch() from None
        raise _Mismatch()
    if hint is str:
        if isinstance(value, str):
            return value
        if raw is not None:
            return raw  # command line: a string field takes the text as written (`experiment_name=2024`)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise _Mismatch()
    if origin is list or hint is list:
        (item,) = get_args(hint) or (Any,)
        if isinstance(value, (list, tuple)):
            out = []
            for index, v in enumerate(value):
                try:
                    out.append(_convert(v, item, None, wrap_scalar=False))
                except _Mismatch as exc:
                    raise _Mismatch(f" (item {index}, {v!r}, is not {type_name(item)}{exc.suggestion})") from None
            return out
        if wrap_scalar and value is not None and not isinstance(value, dict):
            return [_convert(value, item, raw, wrap_scalar=False)]  # `trainer.logger=console`
        raise _Mismatch()
    if origin is dict or hint is dict:
        key_t, val_t = get_args(hint) or (str, Any)
        if not isinstance(value, Mapping):
            raise _Mismatch()
        return {_convert(k, key_t, None, False): _convert(v, val_t, None, False) for k, v in value.items()}
    raise TypeError(f"unsupported config field type {hint!r}")


def _check_bounds(value: Any, metadata: Mapping[str, Any], where: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    if isinstance(value, float) and math.isnan(value):
        raise ConfigError(f"{where}: got nan; expected a number")
    for key, ok, text in (
        ("ge", lambda v, b: v >= b, ">="),
        ("gt", lambda v, b: v > b, ">"),
        ("le", lambda v, b: v <= b, "<="),
        ("lt", lambda v, b: v < b, "<"),
    ):
        bound = metadata.get(key)
        if bound is not None and not ok(value, bound):
            raise ConfigError(f"{where}: got {value!r}; it must be {text} {bound}")


def coerce(value: Any, hint: Any, *, where: str, metadata: Mapping[str, Any] | None = None, raw: str | None = None) -> Any:
    """Convert ``value`` to the type ``hint`` and check the field's bounds, or raise ConfigError.

    ``where`` names the field and its origin for the message (``"actor_rollout_ref.rollout.n
    (command-line override 'actor_rollout_ref.rollout.n=abc')"``). ``raw`` is the original
    command-line text, used verbatim when the field is a string.
    """
    try:
        out = _convert(value, hint, raw, wrap_scalar=True)
    except _Mismatch as exc:
        raise ConfigError(f"{where}: expected {type_name(hint)}, got {value!r}{exc.suggestion}") from None
    if metadata:
        _check_bounds(out, metadata, where)
    return out


def bounds_text(metadata: Mapping[str, Any]) -> str:
    """``">= 1, <= 1.0"`` for the bounds set in a field's metadata (``""`` when none)."""
    parts = []
    for key, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        if metadata.get(key) is not None:
            parts.append(f"{sym} {metadata[key]}")
    return ", ".join(parts)


class ConfigBase:
    """Base of every config section: type-checks and bounds-checks all fields after ``__init__``.

    Sections are mutable (trainers fill derived values such as the number of training steps),
    but every value given at construction is checked, so a section never starts out invalid.
    """

    def __post_init__(self) -> None:
        cls = type(self)
        for name, (f, hint) in schema(cls).items():
            value = getattr(self, name)
            where = f"{cls.__name__}.{name}"
            if is_section(hint):
                if not isinstance(value, hint):
                    raise ConfigError(f"{where}: expected a {hint.__name__}, got {type(value).__name__}")
                continue
            setattr(self, name, coerce(value, hint, where=where, metadata=f.metadata))
