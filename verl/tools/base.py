"""Tools the agent loop offers the model: a small base class, a function wrapper, a registry, the
YAML tool config, and the built-in calculator.

A tool has a name, an OpenAI-style JSON schema (``{"type": "function", "function": {"name",
"description", "parameters"}}``, what chat templates render into the system prompt) and
``call(instance_id, arguments) -> str``. ``instance_id`` names one conversation: a stateful tool
(the Python interpreter) keeps one state per conversation, made by ``create`` on the
conversation's first call and dropped by ``release`` when it ends. A tool that raises turns
into an error message for the model (``verl.rollout.agent.loop``), never a crashed rollout.

The YAML file at ``actor_rollout_ref.rollout.multi_turn.tool_config_path`` lists tools in the
reference verl's layout::

    tools:
      - class_name: calculator                      # a registered name, or a dotted path
        config: {}                                  # keyword arguments of the class
        tool_schema: {type: function, function: {...}}   # optional: replaces the class's schema

``class_name`` may name a :class:`Tool` subclass or a plain function (wrapped in
:class:`FunctionTool`; a function needs its ``tool_schema`` unless its signature says enough).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import logging
import math
import operator
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from verl.tools.response import ToolResponse

logger = logging.getLogger(__name__)

__all__ = [
    "TOOLS",
    "CalculatorTool",
    "FunctionTool",
    "PythonTool",
    "Tool",
    "ToolArgumentError",
    "as_tools",
    "check_arguments",
    "check_tool",
    "load_tool_config",
    "register_tool",
    "safe_calculate",
]


class ToolArgumentError(ValueError):
    """The model called a tool with arguments its schema does not admit (the message goes back to the model)."""


class Tool:
    """One tool (see the module docstring). Subclasses set ``schema`` and implement :meth:`call`."""

    schema: dict[str, Any]
    """OpenAI-style function schema: ``{"type": "function", "function": {"name", "description", "parameters"}}``."""

    @property
    def name(self) -> str:
        """The function name the model writes in its call."""
        return self.schema["function"]["name"]

    def create(self, instance_id: str, **kwargs: Any) -> None:
        """Set up this tool's state for one conversation (its ``create_kwargs`` from the sample's
        ``extra_info.tools_kwargs``); stateless tools need nothing."""

    def call(self, instance_id: str, arguments: dict[str, Any]) -> str:
        """Run the tool for conversation ``instance_id``; the returned text is the model's tool turn.
        Raise (any exception) for a failed call: the message becomes an error turn."""
        raise NotImplementedError  # abstract: a tool subclass writes call()

    def release(self, instance_id: str) -> None:
        """Drop the state of conversation ``instance_id``."""


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}


def check_arguments(schema: Mapping[str, Any], arguments: Any) -> dict[str, Any]:
    """``arguments`` checked against the schema's ``parameters``: an object, every required key
    present, no key the schema does not list (unless ``additionalProperties`` allows it), and
    each listed key of its declared JSON type. Raises :class:`ToolArgumentError` naming the fault."""
    fn = schema["function"]
    if not isinstance(arguments, dict):
        raise ToolArgumentError(f"the arguments of {fn['name']} must be a JSON object, got {type(arguments).__name__}")
    params = fn.get("parameters") or {}
    props = params.get("properties") or {}
    missing = [k for k in params.get("required") or () if k not in arguments]
    if missing:
        raise ToolArgumentError(f"{fn['name']} needs the argument(s) {missing}")
    if params.get("additionalProperties", False) is False:
        unknown = [k for k in arguments if k not in props]
        if unknown:
            raise ToolArgumentError(f"{fn['name']} has no argument(s) {unknown}; it takes {sorted(props)}")
    for key, value in arguments.items():
        kind = (props.get(key) or {}).get("type")
        allowed = _JSON_TYPES.get(kind) if isinstance(kind, str) else None
        if allowed is None:
            continue
        # bool is an int in Python; JSON keeps them apart.
        if not isinstance(value, allowed) or (isinstance(value, bool) and kind != "boolean"):
            raise ToolArgumentError(f"argument {key!r} of {fn['name']} must be a JSON {kind}, got {value!r:.80}")
    return arguments


def _check_schema(schema: Any, where: str) -> dict[str, Any]:
    if not isinstance(schema, Mapping) or schema.get("type") != "function" or not isinstance(schema.get("function"), Mapping):
        raise ValueError(f"{where}: a tool schema is {{'type': 'function', 'function': {{'name', 'description', 'parameters'}}}}, got {schema!r:.200}")
    fn = schema["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"{where}: the tool's function name must be an identifier, got {name!r}")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, Mapping) or params.get("type", "object") != "object":
        raise ValueError(f"{where}: {name}'s parameters must be a JSON schema of type object, got {params!r:.200}")
    return {"type": "function", "function": {**fn, "parameters": dict(params)}}


_PY_TO_JSON = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


class FunctionTool(Tool):
    """A plain Python function as a stateless tool: ``fn(**arguments) -> str`` or a
    :class:`~verl.tools.response.ToolResponse` (other return values are turned into text with ``str``).

    Args:
        fn: the function.
        schema: its OpenAI-style schema; None: built from the signature (parameters annotated
            str/int/float/bool/list/dict; those without a default are required) and the first
            line of the docstring.
    """

    def __init__(self, fn: Callable[..., Any], schema: Mapping[str, Any] | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"FunctionTool: {fn!r} is not callable")
        self.fn = fn
        where = f"tool {getattr(fn, '__name__', fn)!r}"
        self.schema = _check_schema(schema if schema is not None else self._schema_of(fn), where)

    @staticmethod
    def _schema_of(fn: Callable[..., Any]) -> dict[str, Any]:
        name = getattr(fn, "__name__", None)
        props: dict[str, Any] = {}
        required = []
        try:
            hints = inspect.get_annotations(fn, eval_str=True)
        except Exception:  # noqa: BLE001 - unresolvable annotations: fall back to no types
            hints = {}
        for pname, param in inspect.signature(fn).parameters.items():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                continue
            kind = _PY_TO_JSON.get(hints.get(pname))
            if kind is None:
                raise ValueError(
                    f"tool {name!r}: parameter {pname!r} has no JSON-able annotation (str, int, float, bool, list, "
                    "dict); annotate it or pass schema="
                )
            props[pname] = {"type": kind}
            if param.default is param.empty:
                required.append(pname)
        doc = inspect.getdoc(fn) or ""
        return {
            "type": "function",
            "function": {
                "name": name,
                "description": doc.splitlines()[0] if doc else "",
                "parameters": {"type": "object", "properties": props, "required": required},
            },
        }

    def call(self, instance_id: str, arguments: dict[str, Any]) -> str:
        out = self.fn(**arguments)
        return out if isinstance(out, (str, ToolResponse)) else str(out)


# ---------------------------------------------------------------------------------------------
# the calculator

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_DIGITS = 100  # results (and operands of **) beyond ~10^100 are refused: no runaway big-int work
_MAX_EXPRESSION = 500


def safe_calculate(expression: str) -> int | float:
    """The value of an arithmetic expression: numbers, ``+ - * / // % **``, unary signs and
    parentheses. Parsed with :mod:`ast` and walked node by node (never ``eval``); names, calls,
    attributes and everything else are refused with ValueError, as are results past 10^100 and
    division by zero."""
    if not isinstance(expression, str):
        raise ValueError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > _MAX_EXPRESSION:
        raise ValueError(f"the expression is {len(expression)} characters; at most {_MAX_EXPRESSION}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {expression!r} ({exc.msg})") from None
    return _evaluate(tree.body)


def _bounded(value: int | float) -> int | float:
    if isinstance(value, complex):  # (-8) ** 0.5
        raise ValueError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is not a finite number")
    if abs(value) >= 10**_MAX_DIGITS:
        raise ValueError(f"the result has more than {_MAX_DIGITS} digits")
    return value


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            # Bound the work before doing it: |left| ** right has about right * log10|left| digits.
            if abs(right) > 1000 or (abs(left) > 1 and right * math.log10(abs(left)) >= _MAX_DIGITS):
                raise ValueError(f"{left} ** {right} is too large")
            if left == 0 and right < 0:
                raise ValueError("division by zero")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("the result is too large") from None
    raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed, not {ast.unparse(node)!r}")


def _format_number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


class CalculatorTool(Tool):
    """Arithmetic on request: ``calculator(expression="1234*5678")`` -> ``"7006652"`` (see
    :func:`safe_calculate`; a float that is a whole number prints as an integer)."""

    def __init__(self, *, name: str = "calculator") -> None:
        self.schema = _check_schema(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
                    "parameters": {
                        "type": "object",
                        "properties": {"expression": {"type": "string", "description": "e.g. 1234*5678"}},
                        "required": ["expression"],
                    },
                },
            },
            "CalculatorTool",
        )

    def call(self, instance_id: str, arguments: dict[str, Any]) -> str:
        return _format_number(safe_calculate(arguments["expression"]))


# ---------------------------------------------------------------------------------------------
# the Python interpreter


class PythonTool(Tool):
    """Stateful Python over the sandbox (``verl.sandbox.PythonInterpreter``): one interpreter per
    conversation, so names defined by earlier calls persist; every call is one confined process
    (no network, private tmpfs, CPU/wall/memory limits; docs/sandbox.md). The model gets the
    cell's stdout, stderr and, when it did not end normally, why (timeout, memory, ...).

    Args:
        name: the function name offered to the model.
        wall_time_s / memory_mb: this tool's limits per call (None: the sandbox's defaults,
            ``sandbox.limits``); keep ``wall_time_s`` below ``multi_turn.tool_timeout_s``.
        max_chars: characters of output kept (the loop then cuts to ``max_tool_response_length`` tokens).
    """

    def __init__(
        self, *, name: str = "python", wall_time_s: float | None = None, memory_mb: int | None = None, max_chars: int = 4000
    ) -> None:
        from verl.sandbox import PythonInterpreter

        self._make = PythonInterpreter
        self.limits = None
        if wall_time_s is not None or memory_mb is not None:
            from verl.sandbox import default_sandbox

            base = default_sandbox().config.limits
            changes: dict[str, Any] = {k: v for k, v in (("wall_time_s", wall_time_s), ("memory_mb", memory_mb)) if v is not None}
            if wall_time_s is not None:
                changes["cpu_time_s"] = min(base.cpu_time_s, wall_time_s)
            self.limits = dataclasses.replace(base, **changes)
        self.max_chars = max_chars
        self.schema = _check_schema({**PythonInterpreter().schema}, "PythonTool")
        self.schema["function"]["name"] = name
        self._interpreters: dict[str, Any] = {}

    def create(self, instance_id: str, **kwargs: Any) -> None:
        if kwargs:
            raise ValueError(f"the python tool takes no create_kwargs, got {sorted(kwargs)}")
        self._interpreters[instance_id] = self._make(limits=self.limits, max_chars=self.max_chars)

    def call(self, instance_id: str, arguments: dict[str, Any]) -> str:
        interpreter = self._interpreters.get(instance_id)
        if interpreter is None:  # called without create (a caller outside the agent loop)
            interpreter = self._interpreters[instance_id] = self._make(limits=self.limits, max_chars=self.max_chars)
        return interpreter.execute(arguments["code"]).text or "(no output)"

    def release(self, instance_id: str) -> None:
        self._interpreters.pop(instance_id, None)


# ---------------------------------------------------------------------------------------------
# registry and config

TOOLS: dict[str, Callable[..., Tool]] = {}
"""Short name -> tool factory (a class or function taking the YAML ``config`` as keyword arguments)."""


def register_tool(name: str) -> Callable[[Callable[..., Tool]], Callable[..., Tool]]:
    """Register a tool factory under a short name usable as ``class_name`` in the tool config."""

    def deco(factory: Callable[..., Tool]) -> Callable[..., Tool]:
        if name in TOOLS:
            raise ValueError(f"tool {name!r} is already registered ({TOOLS[name]!r})")
        TOOLS[name] = factory
        return factory

    return deco


register_tool("calculator")(CalculatorTool)
register_tool("python")(PythonTool)


def _import_object(path: str, where: str, key: str = "class_name", not_dotted: str | None = None) -> Any:
    """The object at dotted ``path`` (``module.Name``), named by config ``key``; ValueError naming
    ``where`` otherwise (``not_dotted``: the message for a path without a module)."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(
            f"{where}: {key} {path!r} "
            + (not_dotted or f"is neither a registered tool {sorted(TOOLS)} nor a dotted path")
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{where}: cannot import {module_name!r} for {key} {path!r}: {exc}") from exc
    if not hasattr(module, attr):
        raise ValueError(f"{where}: module {module_name!r} has no {attr!r} ({key} {path!r})")
    return getattr(module, attr)


def _build_tool(entry: Any, where: str) -> Tool:
    if not isinstance(entry, Mapping) or "class_name" not in entry:
        raise ValueError(f"{where}: each tool is a mapping with class_name (and optional config, tool_schema), got {entry!r:.200}")
    unknown = set(entry) - {"class_name", "config", "tool_schema"}
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; a tool has class_name, config, tool_schema")
    class_name = entry["class_name"]
    config = dict(entry.get("config") or {})
    config.pop("type", None)  # the reference's `type: native` marker: every tool here is native
    schema = entry.get("tool_schema")
    factory = TOOLS.get(class_name) or _import_object(str(class_name), where)
    if inspect.isclass(factory) and issubclass(factory, Tool) or class_name in TOOLS:
        try:
            tool = factory(**config)
        except TypeError as exc:
            raise ValueError(f"{where}: {class_name}(**config) failed: {exc}; check the tool's config keys") from exc
        except Exception as exc:  # the tool's own __init__: the user's code, said in one line
            raise ValueError(
                f"{where}: {class_name}(**{config!r:.200}) raised {type(exc).__name__}: {exc}; fix the tool's config "
                "or its __init__"
            ) from exc
        if not isinstance(tool, Tool):
            raise ValueError(f"{where}: {class_name} made a {type(tool).__name__}, not a verl.rollout.agent.Tool")
        if schema is not None:
            tool.schema = _check_schema(schema, where)
        return check_tool(tool, f"{where} ({class_name})")
    if callable(factory):
        if config:
            raise ValueError(f"{where}: {class_name} is a function; functions take no config")
        return FunctionTool(factory, schema)
    raise ValueError(f"{where}: {class_name} is neither a Tool class nor a function")


def read_yaml_list(path: str, key: str, where: str, setting: str) -> list[Any]:
    """The list under ``key`` of the YAML mapping in file ``path``; ValueError naming ``where``
    (and the config ``setting`` for a missing file) for anything else."""
    import yaml

    if not os.path.isfile(path):
        raise ValueError(f"{where}: no such file ({setting})")
    with open(path, encoding="utf-8") as f:
        try:
            doc = yaml.safe_load(f)
        except yaml.YAMLError as exc:
            raise ValueError(f"{where}: not valid YAML: {exc}") from exc
    if not isinstance(doc, Mapping) or not isinstance(doc.get(key), list):
        raise ValueError(f"{where}: the file must hold a mapping with a {key!r} list")
    return doc[key]


def load_tool_config(path: str) -> list[Tool]:
    """The tools listed in the YAML file ``path`` (see the module docstring)."""
    where = f"tool config {path}"
    entries = read_yaml_list(path, "tools", where, "actor_rollout_ref.rollout.multi_turn.tool_config_path")
    return as_tools([_build_tool(e, f"{where}, tools[{i}]") for i, e in enumerate(entries)])


def check_tool(tool: Tool, where: str) -> Tool:
    """``tool`` has a valid schema (``function.name`` an identifier, ...) and its own ``call``;
    ValueError naming ``where`` otherwise (a missing name was a KeyError when the tool was first
    named, a missing ``call`` a NotImplementedError turned into an error turn at every call)."""
    if type(tool).call is Tool.call:
        raise ValueError(
            f"{where}: {type(tool).__name__} does not define call(self, instance_id, arguments) -> str, the method "
            "the agent loop runs for each of the model's calls: add it (or give a plain function as the tool)"
        )
    schema = getattr(tool, "schema", None)
    if schema is None:
        raise ValueError(
            f"{where}: {type(tool).__name__} has no schema; set schema = {{'type': 'function', 'function': "
            "{'name', 'description', 'parameters'}} on the class, or give tool_schema in the tool config"
        )
    _check_schema(schema, f"{where}: {type(tool).__name__}.schema")
    return tool


def as_tools(tools: Sequence[Tool | Callable[..., Any]]) -> list[Tool]:
    """Tools and plain functions (wrapped in :class:`FunctionTool`) as a list of tools with
    distinct names (ValueError on a repeated name, a bad schema or a tool without ``call``)."""
    out = [check_tool(t, f"tools[{i}]") if isinstance(t, Tool) else FunctionTool(t) for i, t in enumerate(tools)]
    seen: dict[str, int] = {}
    for i, t in enumerate(out):
        if t.name in seen:
            raise ValueError(f"tools {seen[t.name]} and {i} are both named {t.name!r}; tool names must be distinct")
        seen[t.name] = i
    return out
