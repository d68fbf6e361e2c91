"""Command-line front end shared by every trainer: ``--config FILE``, ``key=value``, ``--help``.

``--help`` lists every option of the root config with its type, default and doc, grouped by
section, from the same field metadata the loader checks against, so the listing cannot drift
from what is accepted.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import yaml

from verl.config.core import ConfigError, bounds_text, is_section, leaf_default, schema, type_name
from verl.config.loader import load_config

__all__ = ["OptionDoc", "describe", "format_help", "parse_cli"]

C = TypeVar("C")


@dataclass(frozen=True, kw_only=True)
class OptionDoc:
    """One leaf option of a root config, as ``--help`` shows it."""

    path: str  # dotted key, e.g. "actor_rollout_ref.actor.optim.lr"
    section: str  # dotted path of the enclosing section ("" for the root)
    type: str  # readable type, e.g. "int | None"
    default: Any  # the default value (a fresh copy)
    help: str  # the field's one-line doc
    bounds: str  # e.g. ">= 1" ("" when unbounded)
    follows: str | None  # the field this one copies unless set (PPOConfig.LINKS), else None


@dataclass(frozen=True, kw_only=True)
class SectionDoc:
    """One section of a root config and its own leaf options."""

    path: str
    help: str
    options: tuple[OptionDoc, ...]


def _sections(config_cls: type) -> list[SectionDoc]:
    links: dict[str, str] = getattr(config_cls, "LINKS", {})
    out: list[SectionDoc] = []

    def walk(cls: type, prefix: str, doc: str, section_defaults: dict[str, Any]) -> None:
        options, subsections = [], []
        for name, (f, hint) in schema(cls).items():
            path = prefix + name
            if is_section(hint):
                subsections.append((hint, path, f.metadata["help"], f.metadata.get("defaults", {})))
                continue
            options.append(
                OptionDoc(
                    path=path,
                    section=prefix.rstrip("."),
                    type=type_name(hint),
                    default=leaf_default(f, section_defaults),
                    help=f.metadata["help"],
                    bounds=bounds_text(f.metadata),
                    follows=links.get(path),
                )
            )
        if options:
            out.append(SectionDoc(path=prefix.rstrip("."), help=doc, options=tuple(options)))
        for hint, path, sub_doc, sub_defaults in subsections:
            walk(hint, path + ".", sub_doc, sub_defaults)

    walk(config_cls, "", "", {})
    return out


def describe(config_cls: type) -> list[OptionDoc]:
    """Every leaf option of ``config_cls`` with type, default and doc, in ``--help`` order."""
    return [opt for sec in _sections(config_cls) for opt in sec.options]


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    if isinstance(value, str):
        return repr(value) if (not value or value != value.strip() or any(c in value for c in " #:")) else value
    return repr(value)


def format_help(config_cls: type, *, prog: str, default_config_file: str | None) -> str:
    """The ``--help`` text: usage, how layers combine, then every option grouped by section."""
    default_file = default_config_file if default_config_file is not None else "none"
    lines = [
        f"usage: {prog} [-h] [--config FILE] [key=value ...]",
        "",
        f"Builds a {config_cls.__name__} from the defaults below, then FILE (default: {default_file}; a path or",
        "a name under configs/), then each key=value override from left to right. Values are YAML:",
        "1e-6, true, null, [console,jsonl], {key: value}. '+key=value' adds a key inside a dict option.",
        "Options marked 'follows X' copy X unless they are set themselves.",
        "",
    ]
    for sec in _sections(config_cls):
        title = sec.path or "(top level)"
        lines.append(f"{title}: {sec.help}" if sec.help else f"{title}:")
        for opt in sec.options:
            extras = [e for e in (opt.bounds, f"follows {opt.follows}" if opt.follows else "") if e]
            suffix = f"  [{'; '.join(extras)}]" if extras else ""
            lines.append(f"  {opt.path}: {opt.type} = {_show(opt.default)}{suffix}")
            lines.append(f"      {opt.help}")
        lines.append("")
    return "\n".join(lines)


def _fail(prog: str, message: str) -> NoReturn:
    sys.stderr.write(f"{prog}: error: {message}\n(run '{prog} --help' to list every option)\n")
    raise SystemExit(2)


def parse_cli(
    config_cls: type[C],
    argv: Sequence[str] | None,
    *,
    prog: str,
    default_config_file: str | Path | None,
    world_size: int | None = None,
) -> C:
    """Parse ``[-h] [--config FILE] [key=value ...]`` into a validated ``config_cls``.

    ``argv`` excludes the program name (None: ``sys.argv[1:]``). ``--config`` replaces
    ``default_config_file``. ``--help`` prints :func:`format_help` and exits 0; any error is
    printed to stderr and exits 2.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        sys.stdout.write(format_help(config_cls, prog=prog, default_config_file=_shown(default_config_file)))
        raise SystemExit(0)
    config_file: str | None = None
    overrides: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--config" or arg.startswith("--config="):
            if config_file is not None:
                _fail(prog, "--config given twice; put shared settings in a file named under 'base:' instead")
            if arg == "--config":
                if i + 1 >= len(args):
                    _fail(prog, "--config needs a FILE")
                i += 1
                config_file = args[i]
            else:
                config_file = arg.split("=", 1)[1]
        elif arg.startswith("-"):
            _fail(prog, f"unknown option {arg!r}; options are -h/--help and --config FILE, settings are key=value")
        elif "=" in arg:
            overrides.append(arg)
        else:
            _fail(prog, f"unexpected argument {arg!r}; settings are given as key=value (e.g. trainer.total_epochs=1)")
        i += 1
    try:
        return load_config(
            config_cls,
            config_file=config_file if config_file is not None else default_config_file,
            overrides=overrides,
            world_size=world_size,
        )
    except ConfigError as exc:
        _fail(prog, str(exc))


def _shown(path: str | Path | None) -> str | None:
    if path is None:
        return None
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)
