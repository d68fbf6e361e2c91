"""Supervised fine-tuning data: prompt/response pairs or multi-turn chats with a loss mask.

Loss-mask convention: ``loss_mask[t] == 1`` when token ``t`` is a target (a response or
assistant token); the trainer scores it with the logits at position ``t - 1``. Prompt,
template headers ("<|im_start|>assistant\\n") and padding are 0.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from verl.data.io import FieldCheck, TableStore, get_field, split_key
from verl.data.tokenizer import (
    ensure_pad_token,
    has_chat_template,
    validate_conversation,
    validate_messages,
)
from verl.utils.logging import warn_once

logger = logging.getLogger(__name__)

SFT_TRUNCATION_MODES = ("error", "left", "right")


def _render(tokenizer: Any, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )


def _ids(tokenizer: Any, text: str, *, special: bool = False) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"]) if text else []


def _suffix(full: str, prefix: str, *, where: str) -> str:
    if not full.startswith(prefix):
        raise ValueError(
            f"{where}: the tokenizer's chat template is not prefix-stable (rendering more turns changed "
            f"the text of earlier ones), so assistant tokens cannot be located; use a template that "
            f"renders each turn independently"
        )
    return full[len(prefix) :]


def encode_prompt_response(
    tokenizer: Any, prompt: Any, response: str, *, apply_chat_template: bool = True, where: str = "sample"
) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids) of one pair; the response ids end with the end-of-turn token.

    With a chat template the response is the assistant turn as the template writes it
    (ending in its end-of-turn token); without one, the raw prompt gets the tokenizer's
    special tokens and the response is followed by eos.
    """
    if not isinstance(response, str):
        raise ValueError(f"{where}: response must be a string, got {type(response).__name__}")
    if apply_chat_template and has_chat_template(tokenizer):
        messages = (
            [{"role": "user", "content": prompt}]
            if isinstance(prompt, str)
            else validate_messages(prompt, where=where)
        )
        prompt_text = _render(tokenizer, messages, add_generation_prompt=True)
        full_text = _render(
            tokenizer, messages + [{"role": "assistant", "content": response}], add_generation_prompt=False
        )
        return _ids(tokenizer, prompt_text), _ids(tokenizer, _suffix(full_text, prompt_text, where=where))
    if not isinstance(prompt, str):
        messages = validate_messages(prompt, where=where)
        prompt = "\n".join(m["content"] for m in messages)
    return _ids(tokenizer, prompt, special=True), _ids(tokenizer, response) + [tokenizer.eos_token_id]


def encode_messages(tokenizer: Any, messages: Any, *, where: str = "sample") -> tuple[list[int], list[int]]:
    """(ids, loss mask) of a multi-turn chat; the mask is 1 on assistant turns' content and end token.

    Each turn is rendered incrementally through the chat template; the assistant header
    that the generation prompt adds stays 0 (the model never has to produce it).
    """
    if not has_chat_template(tokenizer):
        raise ValueError(f"{where}: multi-turn SFT needs a tokenizer with a chat template")
    messages = validate_conversation(messages, where=where)
    ids: list[int] = []
    mask: list[int] = []
    prev = ""
    for i, message in enumerate(messages):
        full = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if message["role"] == "assistant":
            with_header = _render(tokenizer, messages[:i], add_generation_prompt=True)
            header = _ids(tokenizer, _suffix(with_header, prev, where=where))
            body = _ids(tokenizer, _suffix(full, with_header, where=where))
            ids += header + body
            mask += [0] * len(header) + [1] * len(body)
        else:
            segment = _ids(tokenizer, _suffix(full, prev, where=where))
            ids += segment
            mask += [0] * len(segment)
        prev = full
    return ids, mask


def pack_sequence(
    ids: Sequence[int], mask: Sequence[int], *, max_length: int, pad_id: int, truncation: str, where: str
) -> dict[str, torch.Tensor]:
    """Truncate and right-pad one sequence to ``max_length``.

    Returns input_ids, attention_mask, position_ids, loss_mask, each [max_length].
    ``truncation``: "right" cuts the end, "left" cuts the start (keeping the response),
    "error" refuses sequences that do not fit.
    """
    assert len(ids) == len(mask), (len(ids), len(mask))
    if len(ids) > max_length:
        if truncation == "error":
            raise ValueError(
                f"{where}: {len(ids)} tokens exceed max_length={max_length}; raise max_length or set "
                f"truncation to left or right"
            )
        if truncation == "right":
            ids, mask = ids[:max_length], mask[:max_length]
        elif truncation == "left":
            ids, mask = ids[len(ids) - max_length :], mask[len(mask) - max_length :]
        else:
            raise ValueError(f"unknown SFT truncation {truncation!r}; choose from {SFT_TRUNCATION_MODES}")
        if not any(mask):
            warn_once(logger, "%s: truncation to %d tokens removed every response token", where, max_length)
    n = len(ids)
    input_ids = torch.full((max_length,), pad_id, dtype=torch.long)
    input_ids[:n] = torch.as_tensor(list(ids), dtype=torch.long)
    attention_mask = torch.zeros(max_length, dtype=torch.long)
    attention_mask[:n] = 1
    loss_mask = torch.zeros(max_length, dtype=torch.long)
    loss_mask[:n] = torch.as_tensor(list(mask), dtype=torch.long)
    position_ids = torch.arange(max_length, dtype=torch.long)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "loss_mask": loss_mask,
    }


class SFTDataset(Dataset):
    """SFT samples from parquet/arrow/jsonl, right-padded to ``max_length``.

    Two record shapes: ``prompt_key`` + ``response_key`` (the prompt a string or message
    list, the response a string; dotted keys reach nested fields, e.g. the verl RL format's
    ``extra_info.answer``), or ``messages_key`` (a chat whose assistant turns are learnt).
    Items: input_ids, attention_mask, position_ids, loss_mask, each [max_length].
    """

    def __init__(
        self,
        files: str | Sequence[str],
        tokenizer: Any,
        *,
        max_length: int = 1024,
        prompt_key: str = "prompt",
        response_key: str = "response",
        messages_key: str | None = None,
        truncation: str = "error",
        apply_chat_template: bool = True,
    ):
        if truncation not in SFT_TRUNCATION_MODES:
            raise ValueError(f"SFT truncation={truncation!r} is not one of {SFT_TRUNCATION_MODES}")
        if max_length <= 0:
            raise ValueError(f"max_length must be positive, got {max_length}")
        self.tokenizer = ensure_pad_token(tokenizer)
        self.max_length = max_length
        self.prompt_key, self.response_key, self.messages_key = prompt_key, response_key, messages_key
        self.truncation = truncation
        self.apply_chat_template = apply_chat_template
        keys = [messages_key] if messages_key else [prompt_key, response_key]
        self._keys = keys
        self.store = TableStore(files, columns=sorted({split_key(k)[0] for k in keys}))
        # Every row is checked now, so a bad one fails at load, not at the batch that holds it.
        if messages_key:
            self.store.check_fields([FieldCheck(messages_key, ("conversation",))])
        else:
            self.store.check_fields(
                [FieldCheck(prompt_key, ("string", "messages")), FieldCheck(response_key, ("string",))]
            )
        if len(self.store) == 0:
            raise ValueError(f"SFT data files {[s.path for s in self.store.sources]} hold no rows")

    def __len__(self) -> int:
        return len(self.store)

    def encode(self, i: int) -> tuple[list[int], list[int], str]:
        """Unpadded (ids, loss mask, location) of row ``i``."""
        source, j = self.store.locate(i)
        row = source.row(j)
        where = f"{source.path}: row {j}"
        if self.messages_key:
            messages = get_field(row, self.messages_key, path=source.path, row_index=j)
            ids, mask = encode_messages(self.tokenizer, messages, where=where)
        else:
            prompt = get_field(row, self.prompt_key, path=source.path, row_index=j)
            response = get_field(row, self.response_key, path=source.path, row_index=j)
            p, r = encode_prompt_response(
                self.tokenizer, prompt, response, apply_chat_template=self.apply_chat_template, where=where
            )
            ids, mask = p + r, [0] * len(p) + [1] * len(r)
        return ids, mask, where

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"index {i} out of range [0, {len(self)})")
        ids, mask, where = self.encode(i)
        return pack_sequence(
            ids,
            mask,
            max_length=self.max_length,
            pad_id=self.tokenizer.pad_token_id,
            truncation=self.truncation,
            where=where,
        )
