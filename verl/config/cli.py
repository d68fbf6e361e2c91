"""Command-line front end shared by every trainer: ``--config FILE``, ``key=value``, ``--help``.

``--help`` lists every option of the root config with its type, default and doc, grouped by
section, from the same field metadata the loader checks against, so the listing cannot drift
from what is accepted.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import yaml

from verl.config.core import ConfigError, bounds_text, is_section, leaf_default, schema, type_name
from verl.config.loader import load_config
from verl.utils.logging import global_rank

__all__ = ["OptionDoc", "describe", "format_help", "parse_cli"]

logger = logging.getLogger(__name__)

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
        f"usage: {prog} [-h] [--config FILE | --config-path FILE] [key=value ...]",
        "",
        f"Builds a {config_cls.__name__} from the defaults below, then FILE (default: {default_file}; a path or",
        "a name under configs/), then each key=value override from left to right. Values are YAML:",
        "1e-6, true, null, [console,jsonl], {key: value}. '+key=value' adds a key inside a dict option.",
        "--config-path FILE (or --config-path DIR --config-name NAME) is an alias of --config FILE.",
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
    aliases: dict[str, str] = getattr(config_cls, "ALIASES", {})
    if aliases:
        lines.append("aliases (keys of other trainers' tutorials, accepted as overrides):")
        lines += [f"  {alias} -> {target}" for alias, target in aliases.items()]
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
    """Parse ``[-h] [--config FILE | --config-path FILE] [key=value ...]`` into a validated ``config_cls``.

    ``argv`` excludes the program name (None: ``sys.argv[1:]``). ``--config`` replaces
    ``default_config_file``; Hydra's ``--config-path FILE`` (or ``--config-path DIR --config-name
    NAME``) is accepted as its alias. Keys in ``config_cls.ALIASES`` are accepted as overrides of the
    fields they name. ``--help`` prints :func:`format_help` and exits 0; any error is
    printed to stderr and exits 2.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        sys.stdout.write(format_help(config_cls, prog=prog, default_config_file=_shown(default_config_file)))
        raise SystemExit(0)
    config_file: str | None = None
    hydra: dict[str, str] = {}
    overrides: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        flag = arg.split("=", 1)[0]
        if flag in _HYDRA_FLAGS:
            if arg == flag:
                if i + 1 >= len(args):
                    _fail(prog, f"{flag} needs a value")
                i += 1
                hydra[flag] = args[i]
            else:
                hydra[flag] = arg.split("=", 1)[1]
        elif arg == "--config" or arg.startswith("--config="):
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
    if hydra:
        if config_file is not None:
            _fail(prog, "give either --config FILE or Hydra's --config-path/--config-name, not both")
        config_file = _hydra_config_file(prog, hydra)
    try:
        return load_config(
            config_cls,
            config_file=config_file if config_file is not None else default_config_file,
            overrides=overrides,
            world_size=world_size,
        )
    except ConfigError as exc:
        _fail(prog, str(exc))


# Hydra's flags, as tutorials for Hydra-based trainers write them: --config-path is a YAML file
# (or a folder, with --config-name naming the file in it); both stand for --config.
_HYDRA_FLAGS = ("--config-path", "--config-name")


def _hydra_config_file(prog: str, hydra: dict[str, str]) -> str:
    path, name = hydra.get("--config-path"), hydra.get("--config-name")
    if path is not None and Path(path).expanduser().is_dir():
        if name is None:
            _fail(prog, f"--config-path={path} is a folder; name the file in it with --config-name NAME")
        chosen = str(Path(path).expanduser() / name)
    elif path is not None:
        if name is not None:
            _fail(prog, f"--config-path={path} is a file (or missing); --config-name={name} has no folder to look in")
        chosen = path
    else:
        chosen = str(name)  # a name under configs/, as --config takes it
    if global_rank() == 0:
        logger.info("config: %s is an alias of --config %s", " ".join(f"{k}={v}" for k, v in hydra.items()), chosen)
    return chosen


def _shown(path: str | Path | None) -> str | None:
    if path is None:
        return None
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)
