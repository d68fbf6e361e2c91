"""The token ids of the turns the agent loop adds (tool and user turns), from the tokenizer's chat
template: :class:`ToolTurnEncoder`. Shared by the loop (:mod:`verl.rollout.agent.loop`) and a custom
agent loop's :class:`~verl.rollout.agent.agents.Conversation`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from verl.rollout.agent.templates import ANSWER, USER, TemplateReport, check_template

__all__ = ["ToolTurnEncoder"]


class ToolTurnEncoder:
    """Token ids of a tool turn, from the tokenizer's chat template.

    The template renders a fixed two-turn conversation followed by the tool messages and the next
    generation prompt; the text after the assistant turn's content is the template's end of turn
    (ChatML: ``<|im_end|>\\n``), then the tool turn. Minus the part the model sampled itself (its
    end-of-turn token), that text is the tool turn. Only what follows the assistant's content is
    read, so a template that renders earlier turns differently once more turns follow (Qwen3 drops
    reasoning, or an empty think block) still gives the text the model reads next. It starts right
    after a special token, so it is tokenized on its own.

    ``template_kwargs``: extra arguments of ``apply_chat_template`` (``enable_thinking``); for a
    template with such a switch, :meth:`follow_prompts` sets it from the prompts themselves.
    Construction runs :func:`verl.rollout.agent.templates.check_template` (one log line).
    """

    _BASE = ({"role": "user", "content": USER}, {"role": "assistant", "content": ANSWER})

    def __init__(self, tokenizer: Any, template_kwargs: Mapping[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self.report: TemplateReport = check_template(tokenizer, self.template_kwargs)
        self.turn_end = self.report.turn_end
        """What the template writes after an assistant turn's content (ChatML: ``<|im_end|>\\n``)."""
        eos = tokenizer.eos_token or ""
        self.after_eos = self.turn_end[len(eos) :] if eos and self.turn_end.startswith(eos) else self.turn_end
        """The part of :attr:`turn_end` after the model's own end token (ChatML: ``\\n``)."""
        self.eos_token_id = tokenizer.eos_token_id

    def follow_prompts(self, prompts: Sequence[Sequence[int]]) -> None:
        """For a template whose generation prompt has a switch (Qwen3's ``enable_thinking``): set
        it as the prompts were rendered, read from their last ids, so tool turns end with the same
        generation prompt. Prompts that end with neither variant leave it as it is; prompts that
        disagree are refused."""
        if not self.report.thinking_switch or not prompts:
            return
        first = [dict(self._BASE[0])]
        encode = functools.partial(self.tokenizer.encode, add_special_tokens=False)
        ends = {}
        for mode in (False, True):  # the longer one (thinking off) first: it ends with more
            bare = self._render(first, generation_prompt=False, enable_thinking=mode)
            ends[mode] = list(encode(self._render(first, generation_prompt=True, enable_thinking=mode)[len(bare) :]))
        seen = set()
        for p in prompts:
            for mode, ids in ends.items():
                if ids and len(p) >= len(ids) and list(p[len(p) - len(ids) :]) == ids:
                    seen.add(mode)
                    break
        if len(seen) > 1:
            raise ValueError(
                "the prompts of one batch were rendered with enable_thinking both true and false; the agent loop "
                "continues every conversation in one mode: render all prompts alike"
            )
        if seen:
            self.template_kwargs["enable_thinking"] = seen.pop()

    def _render(self, messages: list[dict[str, Any]], *, generation_prompt: bool, **extra: Any) -> str:
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False, **{**self.template_kwargs, **extra}
        )

    def open_with(self, prompt_ids: Sequence[int], text: str) -> list[int]:
        """``prompt_ids`` (a prompt rendered with the generation prompt) with the user turn ``text``
        after its last turn, as the template writes it: the trailing generation-prompt ids are
        taken off and the user turn, then the generation prompt, are added, tokenized on their own.

        The dataset's prompt ids are kept as they are. The added text is what the template adds to
        a fixed one-turn conversation when a user turn follows; the check below makes sure that it
        starts on a token boundary (ChatML: ``<|im_start|>``, a special token), so its ids do not
        depend on what precedes."""
        first = [dict(self._BASE[0])]
        try:
            base = self._render(first, generation_prompt=False)
            with_gen = self._render(first, generation_prompt=True)
            full = self._render([*first, {"role": "user", "content": text}], generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - a template's own refusal (e.g. roles must alternate)
            raise ValueError(
                f"the chat template refuses a user turn after the prompt's last turn ({exc}); an interaction's "
                "opening text needs a template that accepts it: return None from start_interaction and put the "
                "text into the dataset's prompt instead"
            ) from exc
        if not (with_gen.startswith(base) and full.startswith(base)):
            raise ValueError(
                "the chat template renders earlier turns differently once a user turn follows; an interaction's "
                "opening text needs a template that appends turns"
            )
        encode = self.tokenizer.encode
        gen_ids = list(encode(with_gen[len(base) :], add_special_tokens=False))
        turn = full[len(base) :]
        turn_ids = list(encode(turn, add_special_tokens=False))
        if list(encode(full, add_special_tokens=False)) != list(encode(base, add_special_tokens=False)) + turn_ids:
            raise ValueError(
                "the chat template's user turn does not start on a token boundary, so its ids would depend on the "
                "prompt's last tokens; an interaction's opening text cannot be added token-exactly with this template"
            )
        if len(prompt_ids) < len(gen_ids) or list(prompt_ids[len(prompt_ids) - len(gen_ids) :]) != gen_ids:
            raise ValueError(
                f"the prompt ids do not end with the chat template's generation prompt {with_gen[len(base):]!r}; an "
                "interaction's opening text is added before it (render prompts with add_generation_prompt=True)"
            )
        return list(prompt_ids[: len(prompt_ids) - len(gen_ids)]) + turn_ids

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """An upper bound on the characters of text one token stands for: the longest vocabulary entry
        (byte-level BPE spells a token one character per byte, SentencePiece one per character), twice
        over for a normalizer that folds two characters into one (NFC). ``n`` tokens of a text hold at
        most ``n * max_chars_per_token`` of its characters, so a text longer than that has more than
        ``n`` tokens and only that much of it need be tokenized to keep ``n``."""
        return 2 * max(len(piece) for piece in self.tokenizer.get_vocab())

    def surely_over(self, messages: Sequence[Mapping[str, Any]], tokens: int) -> bool:
        """True when the contents of ``messages`` alone hold more than ``tokens`` tokens, judged by
        their length (:attr:`max_chars_per_token`) without tokenizing them."""
        return sum(len(str(m["content"])) for m in messages) > tokens * self.max_chars_per_token

    def encode(self, messages: Sequence[Mapping[str, Any]], *, model_ended_turn: bool,
               expand: Callable[[str], str] | None = None) -> list[int]:
        """Ids of the turn made of ``messages`` (``{"role": "tool", "content": ...}`` each) and the
        next generation prompt. ``model_ended_turn``: the model's last sampled id was its end-of-turn
        (eos) token; otherwise the template's whole end-of-turn text is added first. ``expand``: applied
        to the turn's text before it is tokenized (tool images: each image slot to its vision span,
        ``verl.rollout.agent.images``)."""
        full = self._render([*self._BASE, *messages], generation_prompt=True)
        at = full.find(ANSWER)
        tail = full[at + len(ANSWER) :] if at >= 0 else ""
        if at < 0 or not tail.startswith(self.turn_end):
            raise ValueError(
                "the chat template writes an assistant turn's end differently once a tool or user turn follows "
                f"(expected {self.turn_end!r}); the agent loop cannot add turns token-exactly with this template"
            )
        text = (self.after_eos if model_ended_turn else self.turn_end) + tail[len(self.turn_end) :]
        if expand is not None:
            text = expand(text)
        return list(self.tokenizer.encode(text, add_special_tokens=False))
