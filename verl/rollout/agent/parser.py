"""Tool calls in the model's text, by format (``actor_rollout_ref.rollout.multi_turn.format``).

Formats, each the syntax a family of models writes:

- ``hermes`` (Hermes, Qwen2.5, Qwen3, SmolLM3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number per turn;
- ``qwen3_coder`` (Qwen3-Coder): XML, a parameter per element, values as plain text::

      <tool_call>
      <function=get_weather>
      <parameter=city>
      Paris
      </parameter>
      </function>
      </tool_call>

  A value is typed by the tool's schema (``integer``, ``number``, ``boolean``, ``object``,
  ``array``: read as JSON; ``string``: kept as written);
- ``llama3_json`` (Llama 3.1-3.3 custom tools): the turn is the call, ``{"name": ..., "parameters":
  {...}}``, after an optional ``<|python_tag|>``; several calls are separated by ``;`` or newlines;
- ``auto``: the format the chat template's family writes (:mod:`verl.rollout.agent.templates`);
- a dotted path ``module.function``: a parser of your own, ``fn(text) -> list`` (or ``fn(text,
  schemas)``, ``schemas`` the offered tools' schemas by name) of :class:`ToolCall` or ``{"name":
  ..., "arguments": {...}}`` dicts.

A call that cannot be read (bad JSON or XML, no name, an unclosed element, a user parser that
raises) is a :class:`ToolCall` with ``error`` set: the agent loop answers it with an ``Error: ...``
tool message, so the model learns from it and the run goes on.

Parsing reads the decoded text of one model turn; the trajectory keeps the sampled token ids
regardless (``verl.rollout.agent.loop``), so a lossy decode can only change what is parsed,
never what is trained on.
"""

from __future__ import annotations

import inspect
import json
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from verl.utils.logging import warn_once

logger = logging.getLogger(__name__)

__all__ = [
    "FORMATS",
    "PARSERS",
    "ToolCall",
    "parse_hermes",
    "parse_llama3_json",
    "parse_qwen3_coder",
    "tool_call_parser",
]


@dataclass(frozen=True, kw_only=True)
class ToolCall:
    """One call the model wrote: a name and arguments, or why it could not be read."""

    name: str | None
    """The function name (None when the call could not be parsed)."""
    arguments: dict[str, Any] | None
    """The arguments object (None when the call could not be parsed)."""
    error: str | None = None
    """Why the call is unreadable (bad JSON, no name, arguments not an object); None if it is fine."""


Schemas = Mapping[str, Mapping[str, Any]]
"""The offered tools' OpenAI-style schemas by tool name."""


def _bad(error: str, name: str | None = None) -> ToolCall:
    return ToolCall(name=name, arguments=None, error=error)


# --------------------------------------------------------------------------- hermes

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_HERMES_OPEN = "<tool_call>"


def parse_hermes(text: str, schemas: Schemas | None = None) -> list[ToolCall]:
    """Hermes / Qwen calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any
    number per turn, in order. ``arguments`` may also be a JSON string of an object (some models
    write it so). An opened ``<tool_call>`` that is never closed counts as one malformed call.
    """
    calls = [_json_call(body.strip(), "arguments") for body in _HERMES.findall(text)]
    if _HERMES_OPEN in _HERMES.sub("", text):
        calls.append(_bad("a <tool_call> is not closed with </tool_call>"))
    return calls


def _json_call(body: str, *arg_keys: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return _bad(f"the tool call is not valid JSON ({exc.msg} at {exc.pos})")
    return _call_from_object(obj, arg_keys)


def _call_from_object(obj: Any, arg_keys: tuple[str, ...]) -> ToolCall:
    keys = " or ".join(f'"{k}"' for k in arg_keys)
    if not isinstance(obj, dict):
        return _bad(f"the tool call must be a JSON object with \"name\" and {keys}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return _bad("the tool call has no \"name\" string")
    args = next((obj[k] for k in arg_keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as exc:
            return _bad(f"the arguments of {name} are not valid JSON ({exc.msg})", name)
    if not isinstance(args, dict):
        return _bad(f"the arguments of {name} must be a JSON object", name)
    return ToolCall(name=name, arguments=args)


# --------------------------------------------------------------------------- llama 3 JSON

_LLAMA_SPECIALS = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")
_LLAMA_TAG = "<|python_tag|>"


def parse_llama3_json(text: str, schemas: Schemas | None = None) -> list[ToolCall]:
    """Llama 3.x custom-tool calls: the turn (after an optional ``<|python_tag|>``, before the
    end-of-turn token) is ``{"name": ..., "parameters": {...}}`` (``"arguments"`` is read too),
    several separated by ``;`` or whitespace. A turn that does not start with ``{`` is an
    answer (no call); one that does but is not such objects is one malformed call."""
    body = text.strip()
    for special in _LLAMA_SPECIALS:
        while body.endswith(special):
            body = body[: -len(special)].rstrip()
    if body.startswith(_LLAMA_TAG):
        body = body[len(_LLAMA_TAG) :].lstrip()
    if not body.startswith("{"):
        return []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError as exc:
            calls.append(_bad(f"the tool call is not valid JSON ({exc.msg} at {exc.pos})"))
            break
        calls.append(_call_from_object(obj, ("parameters", "arguments")))
        at = end
        while at < len(body) and (body[at].isspace() or body[at] == ";"):
            at += 1
        if at < len(body) and body[at] != "{":  # text after the calls: Llama's call is the whole turn
            calls.append(_bad(f"unexpected text after a tool call: {body[at:at + 40]!r}; a call is the whole turn"))
            break
    return calls


# --------------------------------------------------------------------------- qwen3-coder XML

_XML_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_XML_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)</function>", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.DOTALL)


def parse_qwen3_coder(text: str, schemas: Schemas | None = None) -> list[ToolCall]:
    """Qwen3-Coder calls: ``<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>``,
    any number per turn. A value loses the one newline the format writes after its opening tag
    and before its closing tag; it is typed by the tool's schema in ``schemas`` (see the module
    docstring), and without a schema read as JSON where it is JSON, else kept as text."""
    calls = [_xml_call(body, schemas or {}) for body in _XML_CALL.findall(text)]
    if _HERMES_OPEN in _XML_CALL.sub("", text):
        calls.append(_bad("a <tool_call> is not closed with </tool_call>"))
    return calls


def _xml_call(body: str, schemas: Schemas) -> ToolCall:
    found = _XML_FUNCTION.search(body)
    if found is None:
        return _bad("a <tool_call> holds no <function=name>...</function> element")
    if _XML_FUNCTION.sub("", body).strip():
        return _bad("a <tool_call> holds text besides one <function=name>...</function> element")
    name, inner = found.group(1).strip(), found.group(2)
    if not name:
        return _bad("a <function=...> element has no name")
    props = ((schemas.get(name) or {}).get("function", {}).get("parameters") or {}).get("properties") or {}
    args: dict[str, Any] = {}
    for key, raw in _XML_PARAMETER.findall(inner):
        key = key.strip()
        if key in args:
            return _bad(f"the parameter {key!r} of {name} is given twice", name)
        args[key] = _typed(_strip_one_newline(raw), (props.get(key) or {}).get("type"))
    if "<parameter=" in _XML_PARAMETER.sub("", inner):
        return _bad(f"a <parameter=...> of {name} is not closed with </parameter>", name)
    return ToolCall(name=name, arguments=args)


def _strip_one_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _typed(value: str, kind: Any) -> Any:
    """``value`` as the schema's JSON ``kind`` says; a value that does not read as that kind is kept
    as text, so the argument check answers the model with the expected type."""
    if kind == "string":
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        if kind == "boolean" and value.strip() in ("True", "False"):
            return value.strip() == "True"
        return value
    return parsed


# --------------------------------------------------------------------------- choosing one

PARSERS: dict[str, Callable[..., list[ToolCall]]] = {
    "hermes": parse_hermes,
    "qwen3_coder": parse_qwen3_coder,
    "llama3_json": parse_llama3_json,
}
"""Format name (``multi_turn.format``) -> parser ``(text, schemas=None) -> list[ToolCall]`` of one model turn."""

FORMATS = ("auto", *PARSERS)
"""The values ``multi_turn.format`` takes besides a dotted path to a parser of your own."""


def tool_call_parser(format: str, *, template_format: str | None = None) -> tuple[str, Callable[[str, Schemas], list[ToolCall]]]:
    """``(name, parse)`` for ``multi_turn.format``: ``parse(text, schemas)`` reads one model turn.

    ``template_format``: the format the chat template's family writes (``auto`` takes it;
    None or unknown: ``hermes``). ValueError naming the key for a format that is neither known
    nor an importable callable."""
    key = "actor_rollout_ref.rollout.multi_turn.format"
    if format == "auto":
        chosen = template_format if template_format in PARSERS else "hermes"
        return chosen, PARSERS[chosen]
    if format in PARSERS:
        return format, PARSERS[format]
    if "." not in format:
        raise ValueError(
            f"{key}={format!r} is not a tool-call format; use one of {list(FORMATS)} or a dotted path "
            "(module.function) to a parser of your own"
        )
    from verl.tools.base import _import_object

    fn = _import_object(format, key, key="parser")
    if not callable(fn):
        raise ValueError(f"{key}={format!r} is not callable; give a function fn(text) -> list of tool calls")
    return format, _user_parser(fn, format)


def _takes_schemas(fn: Callable[..., Any]) -> bool:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


def _user_parser(fn: Callable[..., Any], path: str) -> Callable[[str, Schemas], list[ToolCall]]:
    """A user's parser whose failures become malformed calls (logged once), never a crash of the rollout."""
    two = _takes_schemas(fn)

    def parse(text: str, schemas: Schemas) -> list[ToolCall]:
        try:
            got = fn(text, schemas) if two else fn(text)
        except Exception as exc:  # noqa: BLE001 - the model's text must not end the run
            warn_once(logger, "tool-call parser %s raised %s: %s (answered to the model as a malformed call)", path, type(exc).__name__, exc)
            return [_bad(f"the tool call could not be read ({type(exc).__name__}: {exc})")]
        if got is None:
            return []
        if not isinstance(got, (list, tuple)):
            warn_once(logger, "tool-call parser %s returned %s, not a list; read as no call", path, type(got).__name__)
            return []
        out = []
        for item in got:
            if isinstance(item, ToolCall):
                out.append(item)
            elif isinstance(item, Mapping):
                out.append(_call_from_object(dict(item), ("arguments", "parameters")))
            else:
                out.append(_bad(f"the tool call could not be read (the parser gave {type(item).__name__})"))
        return out

    return parse
