"""The token ids of the turns the agent loop adds (tool and user turns), from the tokenizer's chat
template: :class:`ToolTurnEncoder`. Shared by the loop (:mod:`verl.rollout.agent.loop`) and a custom
agent loop's :class:`~verl.rollout.agent.agents.Conversation`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ToolTurnEncoder"]


class ToolTurnEncoder:
    """Token ids of a tool turn, from the tokenizer's chat template.

    The template renders a fixed two-turn conversation with and without the tool messages (and
    the next generation prompt); the added text, preceded by what the template writes after an
    assistant turn's content (ChatML: ``<|im_end|>\\n``) minus the part the model sampled itself
    (its end-of-turn token), is the tool turn. Its text starts right after a special token, so it
    is tokenized on its own.
    """

    _BASE = ({"role": "user", "content": "question"}, {"role": "assistant", "content": "answer"})

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the agent loop renders tool turns with the tokenizer's chat template, and this tokenizer has none; "
                "use a chat model's tokenizer (or set tokenizer.chat_template)"
            )
        self.tokenizer = tokenizer
        self.base_text = self._render(list(self._BASE), generation_prompt=False)
        content = self._BASE[-1]["content"]
        at = self.base_text.rfind(content)
        if at < 0:
            raise ValueError("the chat template does not write the assistant's content; the agent loop cannot use it")
        self.turn_end = self.base_text[at + len(content) :]
        """What the template writes after an assistant turn's content (ChatML: ``<|im_end|>\\n``)."""
        eos = tokenizer.eos_token or ""
        self.after_eos = self.turn_end[len(eos) :] if eos and self.turn_end.startswith(eos) else self.turn_end
        """The part of :attr:`turn_end` after the model's own end token (ChatML: ``\\n``)."""
        self.eos_token_id = tokenizer.eos_token_id

    def _render(self, messages: list[dict[str, Any]], *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)

    def open_with(self, prompt_ids: Sequence[int], text: str) -> list[int]:
        """``prompt_ids`` (a prompt rendered with the generation prompt) with the user turn ``text``
        after its last turn, as the template writes it: the trailing generation-prompt ids are
        taken off and the user turn, then the generation prompt, are added, tokenized on their own.

        The dataset's prompt ids are kept as they are. The added text is what the template adds to
        a fixed one-turn conversation when a user turn follows; the check below makes sure that it
        starts on a token boundary (ChatML: ``<|im_start|>``, a special token), so its ids do not
        depend on what precedes."""
        first = [{"role": "user", "content": "question"}]
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

    def encode(self, messages: Sequence[Mapping[str, Any]], *, model_ended_turn: bool) -> list[int]:
        """Ids of the turn made of ``messages`` (``{"role": "tool", "content": ...}`` each) and the
        next generation prompt. ``model_ended_turn``: the model's last sampled id was its end-of-turn
        (eos) token; otherwise the template's whole end-of-turn text is added first."""
        full = self._render([*self._BASE, *messages], generation_prompt=True)
        if not full.startswith(self.base_text):
            raise ValueError(
                "the chat template renders earlier turns differently once a tool turn follows; the agent loop "
                "needs a template that appends turns (tool turns are tokenized as an appended suffix)"
            )
        text = (self.after_eos if model_ended_turn else self.turn_end) + full[len(self.base_text) :]
        return list(self.tokenizer.encode(text, add_special_tokens=False))
