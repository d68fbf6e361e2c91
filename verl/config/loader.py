"""Loading configs: YAML layers, dotted command-line overrides, links, and serialisation.

A config is built in one pass from layers, lowest precedence first:

1. the dataclass defaults (``verl/config/schema.py``);
2. a YAML file, after the files it names under ``base:`` (a path or a list, relative to it);
3. ``key=value`` overrides (``actor_rollout_ref.actor.optim.lr=1e-6``, ``trainer.logger=[console,jsonl]``,
   ``+actor_rollout_ref.model.override_config.rope_theta=10000`` for a new key inside a dict field).

Each layer is checked against the schema as it is read, so an unknown key or a wrong type is
reported with the file or argument it came from. The checked layers are merged into a tree of
explicitly set values, the root class's ``LINKS`` fill unset fields from the fields they follow,
and the dataclasses are constructed (which runs the whole-config validation).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import re
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from verl.config.core import (
    ConfigError,
    close_matches,
    coerce,
    is_dict_type,
    is_section,
    leaf_default,
    schema,
    type_name,
)
from verl.config.validation import deferred_validation
from verl.utils.logging import global_rank

__all__ = [
    "CONFIG_DIR",
    "all_paths",
    "from_dict",
    "load_config",
    "parse_value",
    "resolve_config_path",
    "to_dict",
    "to_flat_dict",
    "to_yaml",
]

C = TypeVar("C")
logger = logging.getLogger(__name__)

#: Where named configs (``--config grpo_tiny_cpu``) are looked up: the repository's configs/.
CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


# ----------------------------------------------------------------------------------------------
# YAML


class _Loader(yaml.SafeLoader):
    """Safe YAML loader that reads ``1e-6`` as a float (YAML 1.2) and rejects duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # the base class reports unhashable keys
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first on line {seen[key] + 1})", key_node.start_mark
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


# PyYAML follows YAML 1.1, where a float needs a dot ("1e-6" stays a string). This adds the
# YAML 1.2 forms; add_implicit_resolver copies the resolver table, SafeLoader is untouched.
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def parse_value(text: str) -> Any:
    """Read one command-line value as YAML (``[a,b]``, ``null``, ``true``, ``1e-6``); unparsable text stays a string."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError:
        return text


def _read_yaml(path: Path, shown: str) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {shown}: {exc.strerror}") from None
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise ConfigError(f"{shown} is not valid YAML ({where}{exc.problem or exc.context})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{shown} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{shown}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def resolve_config_path(name: str | Path) -> Path:
    """Find a config file: the path as given, else under :data:`CONFIG_DIR`, else (``configs/...``) under
    the folder that holds :data:`CONFIG_DIR`; ``.yaml`` may be omitted."""
    given = Path(name).expanduser()
    candidates = [given]
    if not given.is_absolute():
        candidates.append(CONFIG_DIR / given)
        if given.parts[:1] == (CONFIG_DIR.name,):
            # "configs/ppo/default.yaml", as tutorials write it from the repository root: found from any folder.
            candidates.append(CONFIG_DIR.parent / given)
    if given.suffix not in (".yaml", ".yml"):
        candidates += [c.with_name(c.name + ".yaml") for c in list(candidates)]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    if given.is_dir():
        raise ConfigError(f"config file {str(name)!r} is a directory; give a YAML file (or a name under {CONFIG_DIR})")
    raise ConfigError(f"config file {str(name)!r} not found (looked for: {', '.join(str(c) for c in candidates)})")


def _file_layers(path: Path, shown: str, chain: tuple[Path, ...]) -> list[tuple[str, dict[str, Any]]]:
    """The layers of one YAML file: its bases first (recursively), then the file itself."""
    real = path.resolve()
    if real in chain:
        cycle = " -> ".join(str(p) for p in (*chain, real))
        raise ConfigError(f"config files include each other through 'base:': {cycle}")
    data = _read_yaml(path, shown)
    base = data.pop("base", None)
    layers: list[tuple[str, dict[str, Any]]] = []
    if base is not None:
        bases = [base] if isinstance(base, str) else base
        if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
            raise ConfigError(f"{shown}: 'base' must be a file name or a list of file names, got {base!r}")
        for b in bases:
            bpath = Path(b).expanduser()
            if not bpath.is_absolute():
                bpath = path.parent / bpath
            if not bpath.is_file() and bpath.suffix not in (".yaml", ".yml"):
                bpath = bpath.with_name(bpath.name + ".yaml")
            if not bpath.is_file():
                raise ConfigError(f"{shown}: base config {b!r} not found (looked for {bpath})")
            layers += _file_layers(bpath, str(bpath), (*chain, real))
    layers.append((shown, data))
    return layers


# ----------------------------------------------------------------------------------------------
# schema paths and did-you-mean


@functools.cache
def all_paths(config_cls: type) -> tuple[str, ...]:
    """Every dotted path of a root config class: sections and leaves, in declaration order."""
    out: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for name, (_, hint) in schema(cls).items():
            out.append(prefix + name)
            if is_section(hint):
                walk(hint, prefix + name + ".")

    walk(config_cls, "")
    return tuple(out)


def _unknown_key(root: type, cls: type, parts: list[str], index: int, origin: str) -> ConfigError:
    """Error for ``parts[index]`` not being a field of ``cls``, with the best suggestions."""
    given = ".".join(parts)
    prefix = ".".join(parts[:index])
    key, rest = parts[index], parts[index + 1 :]
    names = list(schema(cls))
    paths = set(all_paths(root))
    suggestions: list[str] = []
    # 1. a typo at the failing level: actor_rollout_ref.actr.optim.lr -> actor_rollout_ref.actor.optim.lr
    for match in close_matches(key, names):
        candidate = ".".join([*parts[:index], match, *rest])
        suggestions.append(candidate if candidate in paths else ".".join([*parts[:index], match]))
    # 2. a missing prefix: actor.optim.lr -> actor_rollout_ref.actor.optim.lr
    if not suggestions:
        suggestions = [p for p in all_paths(root) if p.endswith("." + given)][:3]
    where = f"'{prefix}'" if prefix else "the top level"
    msg = f"unknown config key '{given}' in {origin}: {where} has no field '{key}'"
    if suggestions:
        msg += "; did you mean " + " or ".join(repr(s) for s in dict.fromkeys(suggestions)) + "?"
    else:
        msg += f" (its fields: {', '.join(names)})"
    return ConfigError(msg)


# ----------------------------------------------------------------------------------------------
# layers -> tree of explicitly set values


def _dict_seed(f: dataclasses.Field, section_defaults: Mapping[str, Any], tree: dict[str, Any]) -> dict[str, Any]:
    """The current value of a dict field: already set in this tree, else its default."""
    if f.name in tree and isinstance(tree[f.name], dict):
        return tree[f.name]
    value = leaf_default(f, section_defaults)
    return copy.deepcopy(value) if isinstance(value, dict) else {}


def _deep_merge(into: dict[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    for k, v in new.items():
        if isinstance(v, Mapping) and isinstance(into.get(k), dict):
            _deep_merge(into[k], v)
        else:
            into[k] = copy.deepcopy(v)
    return into


def _merge_mapping(
    root: type,
    cls: type,
    section_defaults: Mapping[str, Any],
    tree: dict[str, Any],
    data: Mapping[str, Any],
    parts: list[str],
    origin: str,
) -> None:
    """Check a (YAML) mapping against section ``cls`` and merge it into ``tree``."""
    fields = schema(cls)
    for key, value in data.items():
        path = [*parts, str(key)]
        if not isinstance(key, str) or key not in fields:
            raise _unknown_key(root, cls, path, len(parts), origin)
        f, hint = fields[key]
        dotted = ".".join(path)
        if is_section(hint):
            if value is None:  # `critic:` with nothing under it
                continue
            if not isinstance(value, Mapping):
                raise ConfigError(
                    f"{dotted} (in {origin}): expected a mapping of {hint.__name__} fields, got {value!r}"
                )
            sub = tree.setdefault(key, {})
            _merge_mapping(root, hint, f.metadata.get("defaults", {}), sub, value, path, origin)
        elif is_dict_type(hint) and isinstance(value, Mapping):
            checked = coerce(value, hint, where=f"{dotted} (in {origin})", metadata=f.metadata)
            tree[key] = _deep_merge(_dict_seed(f, section_defaults, tree), checked)
        else:
            tree[key] = coerce(value, hint, where=f"{dotted} (in {origin})", metadata=f.metadata)


_ALIASES_LOGGED: set[tuple[str, str]] = set()


def _resolve_alias(root: type, key: str) -> str:
    """The field a tutorial key (``root.ALIASES``, e.g. ``trainer.num_epochs``) stands for; logged once."""
    target = getattr(root, "ALIASES", {}).get(key)
    if target is None:
        return key
    if (key, target) not in _ALIASES_LOGGED:
        _ALIASES_LOGGED.add((key, target))
        if global_rank() == 0:
            logger.info("config: %s is an alias of %s", key, target)
    return target


def _apply_override(root: type, tree: dict[str, Any], arg: str) -> None:
    """Apply one ``key=value`` / ``+key=value`` argument to ``tree``."""
    if "=" not in arg:
        raise ConfigError(f"override {arg!r} is not of the form key=value (e.g. actor_rollout_ref.rollout.n=4)")
    key, text = arg.split("=", 1)
    key = key.strip()
    add = key.startswith("+")
    if add:
        key = key[1:].lstrip("+")  # Hydra's '++' (add or replace) behaves like '+' here
    origin = f"command-line override {arg!r}"
    key = _resolve_alias(root, key)
    if key.startswith("~"):
        raise ConfigError(f"{origin}: deleting keys with '~' is not supported; set the value instead")
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise ConfigError(f"{origin}: {key!r} is not a dotted key like actor_rollout_ref.actor.optim.lr")
    value = parse_value(text)

    cls, node, section_defaults = root, tree, {}
    for i, part in enumerate(parts):
        fields = schema(cls)
        if part not in fields:
            err = _unknown_key(root, cls, parts, i, origin)
            if add:
                err = ConfigError(f"{err}; '+' only adds keys inside dict fields such as actor_rollout_ref.model.override_config")
            raise err
        f, hint = fields[part]
        dotted = ".".join(parts[: i + 1])
        last = i == len(parts) - 1
        if is_section(hint):
            if last:
                if not isinstance(value, Mapping):
                    raise ConfigError(
                        f"{origin}: {dotted} is a section; set one of its fields ({dotted}.FIELD=VALUE) "
                        f"or give a mapping ({dotted}={{FIELD: VALUE}})"
                    )
                if add:
                    raise ConfigError(f"{origin}: {dotted} already exists; drop the '+'")
                sub = node.setdefault(part, {})
                _merge_mapping(root, hint, f.metadata.get("defaults", {}), sub, value, parts, origin)
                return
            cls, node, section_defaults = hint, node.setdefault(part, {}), f.metadata.get("defaults", {})
            continue
        if is_dict_type(hint) and not last:
            # a key inside a free-form dict field: +...override_config.rope_theta=1e6
            current = _dict_seed(f, section_defaults, node)
            inner = current
            for sub_key in parts[i + 1 : -1]:
                if not isinstance(inner.get(sub_key, {}), dict):
                    raise ConfigError(f"{origin}: {dotted}.{sub_key} holds {inner[sub_key]!r}, not a mapping")
                inner = inner.setdefault(sub_key, {})
            inner[parts[-1]] = value
            node[part] = coerce(current, hint, where=f"{dotted} (in {origin})", metadata=f.metadata)
            return
        if not last:
            raise ConfigError(
                f"unknown config key '{key}' in {origin}: '{dotted}' is a value of type {type_name(hint)}, not a section"
            )
        if add:
            raise ConfigError(
                f"{origin}: '{key}' already exists; drop the '+' ('+' only adds keys inside dict fields)"
            )
        node[part] = coerce(value, hint, where=f"{key} (in {origin})", metadata=f.metadata, raw=text)
        return


# ----------------------------------------------------------------------------------------------
# links and construction


def _tree_get(tree: dict[str, Any], path: str) -> tuple[bool, Any]:
    node: Any = tree
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _apply_links(root: type, tree: dict[str, Any]) -> None:
    """Fill every unset link target from its source, when the source was set."""
    for target, source in getattr(root, "LINKS", {}).items():
        target_set, _ = _tree_get(tree, target)
        source_set, value = _tree_get(tree, source)
        if target_set or not source_set:
            continue
        *parents, leaf = target.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = copy.deepcopy(value)


def _build(cls: type[C], tree: Mapping[str, Any], section_defaults: Mapping[str, Any]) -> C:
    kwargs: dict[str, Any] = copy.deepcopy(dict(section_defaults))
    for name, (f, hint) in schema(cls).items():
        if is_section(hint):
            kwargs[name] = _build(hint, tree.get(name, {}), f.metadata.get("defaults", {}))
        elif name in tree:
            kwargs[name] = copy.deepcopy(tree[name])
    return cls(**kwargs)


def _construct(config_cls: type[C], tree: dict[str, Any], world_size: int | None) -> C:
    _apply_links(config_cls, tree)
    if world_size is None:
        return _build(config_cls, tree, {})  # __post_init__ validates with nnodes x n_gpus_per_node
    with deferred_validation():  # validated once, against the launched world
        cfg = _build(config_cls, tree, {})
    cfg.validate(world_size)
    return cfg


def load_config(
    config_cls: type[C],
    *,
    config_file: str | Path | None = None,
    overrides: Sequence[str] = (),
    world_size: int | None = None,
) -> C:
    """Build ``config_cls`` (``PPOConfig``, ``SFTConfig``) from its defaults, a YAML file and overrides.

    ``config_file`` is a path, or a name under ``configs/`` (``"grpo_tiny_cpu"``); ``overrides`` are
    ``key=value`` strings. ``world_size`` (the launched one) is checked against the layout when
    given. Raises ConfigError naming the file, argument or field at fault.
    """
    if isinstance(overrides, str):
        raise TypeError("overrides must be a sequence of 'key=value' strings, not one string")
    tree: dict[str, Any] = {}
    if config_file is not None:
        path = resolve_config_path(config_file)
        for shown, data in _file_layers(path, str(config_file) if Path(config_file) == path else str(path), ()):
            _merge_mapping(config_cls, config_cls, {}, tree, data, [], shown)
    for arg in overrides:
        _apply_override(config_cls, tree, arg)
    return _construct(config_cls, tree, world_size)


def from_dict(config_cls: type[C], data: Mapping[str, Any], *, world_size: int | None = None) -> C:
    """Build ``config_cls`` from a nested mapping (as :func:`to_dict` returns), with the same checks as YAML."""
    tree: dict[str, Any] = {}
    _merge_mapping(config_cls, config_cls, {}, tree, data, [], "the given mapping")
    return _construct(config_cls, tree, world_size)


# ----------------------------------------------------------------------------------------------
# serialisation


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as nested plain dicts/lists (a deep copy)."""
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise TypeError(f"to_dict expects a config instance, got {type(cfg).__name__}")
    return dataclasses.asdict(cfg)


def to_flat_dict(cfg: Any) -> dict[str, Any]:
    """``{"actor_rollout_ref.actor.optim.lr": 1e-06, ...}``: every leaf by its dotted path (for loggers)."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, prefix + f.name + ".")
            else:
                out[prefix + f.name] = copy.deepcopy(value)

    walk(cfg, "")
    return out


def to_yaml(cfg: Any) -> str:
    """The fully resolved config as YAML; loading it back gives an equal config."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False, allow_unicode=True)
