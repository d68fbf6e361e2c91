"""What a chat template does to a multi-turn conversation, checked once at start-up.

The agent loop never re-renders a conversation: each turn it adds is the text the template writes
after the model's last turn (:class:`verl.rollout.agent.turns.ToolTurnEncoder`), so a template
that rewrites earlier turns (Qwen3 drops the reasoning of turns before the latest user turn) still
gives the engine's own ids. :func:`check_template` renders probe conversations with and without
the generation prompt, refuses a template the loop cannot use, and names the family and the quirks
it found (one log line); ``multi_turn.format=auto`` takes the tool-call syntax of that family.

Families (by the template's text; the quirks are found by rendering, whatever the family):

| family | tool calls | turns |
| --- | --- | --- |
| ``qwen2.5`` | ``hermes`` | ChatML; a default system turn; tool messages wrapped in ``<tool_response>`` inside one user turn |
| ``qwen3`` | ``hermes`` | as qwen2.5 (no default system turn); reasoning of earlier turns dropped; ``enable_thinking=false`` adds an empty think block to the generation prompt |
| ``qwen3_coder`` | ``qwen3_coder`` | as qwen3, calls in XML |
| ``llama3`` | ``llama3_json`` | header/``<|eot_id|>`` turns; tool results under the ``ipython`` role, JSON-encoded; a dated system turn |
| ``chatml`` | ``hermes`` | ``<|im_start|>role ... <|im_end|>`` (SmolLM, the tiny models); one turn per tool message |
| ``other`` | ``hermes`` | whatever renders append-only |
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["FAMILY_FORMATS", "TemplateReport", "check_template", "detect_family"]

FAMILY_FORMATS = {
    "qwen2.5": "hermes",
    "qwen3": "hermes",
    "qwen3_coder": "qwen3_coder",
    "llama3": "llama3_json",
    "chatml": "hermes",
    "other": "hermes",
}
"""The tool-call syntax (``multi_turn.format``) each template family writes."""

# Probe texts: distinctive, so that finding them in a rendering cannot hit a template's own words.
USER, ANSWER, REASONING = "question-7f3a", "answer-7f3a", "reasoning-7f3a"
TOOL_1, TOOL_2 = "result-one-7f3a", "result-two-7f3a"

_logged: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class TemplateReport:
    """What :func:`check_template` found."""

    family: str
    """One of :data:`FAMILY_FORMATS`."""
    generation_prompt: str
    """The text ``add_generation_prompt=True`` adds after the last turn."""
    turn_end: str
    """What the template writes after an assistant turn's content (ChatML: ``<|im_end|>\\n``)."""
    quirks: tuple[str, ...] = field(default=())
    """The family's habits the loop handles, in words."""
    thinking_switch: bool = False
    """``enable_thinking`` changes the generation prompt (Qwen3)."""

    @property
    def tool_format(self) -> str:
        """The tool-call syntax of the family (``multi_turn.format=auto``)."""
        return FAMILY_FORMATS[self.family]

    def line(self) -> str:
        """The one log line."""
        return (
            f"chat template: family {self.family} (tool calls: {self.tool_format}), generation prompt "
            f"{self.generation_prompt!r}, end of turn {self.turn_end!r}; handles: {'; '.join(self.quirks) or 'nothing special'}"
        )


def detect_family(template: str) -> str:
    """The family of a chat template, by its text."""
    if "<|start_header_id|>" in template:
        return "llama3"
    if "<function=" in template or "<parameter=" in template:
        return "qwen3_coder"
    if "<tool_response>" in template:
        return "qwen3" if "<think>" in template else "qwen2.5"
    if "<|im_start|>" in template:
        return "chatml"
    return "other"


def check_template(tokenizer: Any, template_kwargs: Mapping[str, Any] | None = None) -> TemplateReport:
    """Render probe conversations with ``tokenizer``'s chat template (with and without the
    generation prompt), refuse what the agent loop cannot use (ValueError naming the fault) and
    report the family and its quirks; logs :meth:`TemplateReport.line` once per template."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(
            "the agent loop renders tool turns with the tokenizer's chat template, and this tokenizer has none; "
            "use a chat model's tokenizer (or set tokenizer.chat_template)"
        )
    if not isinstance(template, str):  # a dict of named templates: the default one renders
        template = str(template)
    kwargs = dict(template_kwargs or {})

    def render(messages: list[dict[str, Any]], generation_prompt: bool, **extra: Any) -> str:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False, **{**kwargs, **extra}
        )

    user = {"role": "user", "content": USER}
    answer = {"role": "assistant", "content": ANSWER}
    bare, with_gen = render([user], False), render([user], True)
    if not with_gen.startswith(bare) or with_gen == bare:
        raise ValueError(
            "the chat template's generation prompt is not text added after the last turn "
            f"({bare[-40:]!r} without it, {with_gen[-40:]!r} with it); the agent loop needs a template whose "
            "add_generation_prompt=True appends the assistant header"
        )
    generation_prompt = with_gen[len(bare) :]
    base = render([user, answer], False)
    at = base.find(ANSWER)
    if at < 0:
        raise ValueError("the chat template does not write the assistant's content; the agent loop cannot use it")
    turn_end = base[at + len(ANSWER) :]
    family = detect_family(template)
    quirks: list[str] = []
    eos = getattr(tokenizer, "eos_token", None) or ""
    if eos and turn_end.startswith(eos):
        quirks.append(f"the model's own end token {eos!r} ends its turn" + (f", the loop adds {turn_end[len(eos):]!r}" if turn_end[len(eos):] else ""))
    else:
        quirks.append(f"the end of turn {turn_end!r} is not the eos token {eos!r}: the loop adds it whole")
    bos = getattr(tokenizer, "bos_token", None)
    if bos and bare.startswith(bos):
        quirks.append("the template writes the bos token itself")
    if bare.find(USER) > 0 and "system" in bare[: bare.find(USER)]:
        quirks.append("a system turn the messages did not give")

    tools = _render_or_none(render, [user, answer, {"role": "tool", "content": TOOL_1}, {"role": "tool", "content": TOOL_2}], True)
    if tools is None or TOOL_1 not in tools or TOOL_2 not in tools:
        quirks.append("no tool role (tool turns refused or dropped by the template)")
    else:
        between = tools[tools.find(TOOL_1) + len(TOOL_1) : tools.find(TOOL_2)]
        merged = turn_end.strip() not in between if turn_end.strip() else False
        quirks.append("consecutive tool messages in one turn" if merged else "one turn per tool message")
        if "<tool_response>" in tools:
            quirks.append("tool results in <tool_response> inside a user turn")
        if "ipython" in tools:
            quirks.append("tool results under the ipython role")
        if f'"{TOOL_1}"' in tools:
            quirks.append("tool results JSON-encoded")
        if not tools.endswith(generation_prompt):
            raise ValueError("the chat template does not end a tool turn with its generation prompt; the agent loop cannot use it")

    thought = {"role": "assistant", "content": f"<think>\n{REASONING}\n</think>\n\n{ANSWER}"}
    in_chain = _render_or_none(render, [user, thought, {"role": "tool", "content": TOOL_1}], True)
    after_user = _render_or_none(render, [user, thought, {"role": "user", "content": USER}], True)
    if after_user is not None and REASONING not in after_user:
        kept = in_chain is not None and REASONING in in_chain
        quirks.append("reasoning of earlier turns dropped after a new user turn" + (" (kept within a tool chain)" if kept else "") + ": the trajectory keeps what the engine saw")
    thinking_switch = False
    if "enable_thinking" in template:
        on = render([user], True, enable_thinking=True)
        off = render([user], True, enable_thinking=False)
        if on != off:
            thinking_switch = True
            quirks.append(f"enable_thinking=false adds {off[len(on):]!r} to the generation prompt: tool turns follow the prompts' mode")
    report = TemplateReport(family, generation_prompt, turn_end, tuple(quirks), thinking_switch)
    key = (template, repr(sorted(kwargs.items())))
    if key not in _logged:
        _logged.add(key)
        logger.info(report.line())
    return report


def _render_or_none(render: Any, messages: list[dict[str, Any]], generation_prompt: bool) -> str | None:
    try:
        return render(messages, generation_prompt)
    except Exception:  # noqa: BLE001 - a template's own refusal (raise_exception) is a finding, not a failure
        return None
