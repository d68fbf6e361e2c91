"""Supervised fine-tuning data: prompt/response pairs or multi-turn chats with a loss mask.

Loss-mask convention: ``loss_mask[t] == 1`` when token ``t`` is a target (a response or
assistant token); the trainer scores it with the logits at position ``t - 1``. Prompt,
template headers ("<|im_start|>assistant\\n") and padding are 0.

A vision-language model's data (``processor``, a :class:`~verl.data.vlm.ImagePromptEncoder`): each
row's ``image_key`` column holds its images, the prompt one ``<image>`` per image (the RL data's
layout, ``verl.data.vlm``); each placeholder becomes the model's image tokens and the item carries
the images' ``mm_pixel_values`` / ``mm_image_grid_thw`` (``verl.protocol.images``), which the engine
hands to the model's forward with the row.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from verl.data.io import FieldCheck, TableStore, get_field, split_key
from verl.data.vlm import ImagePromptEncoder, load_image, pad_row_images
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
    tokenizer: Any, prompt: Any, response: str, *, apply_chat_template: bool = True, where: str = "sample",
    expand: Callable[[str], str] | None = None,
) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids) of one pair; the response ids end with the end-of-turn token.

    With a chat template the response is the assistant turn as the template writes it
    (ending in its end-of-turn token); without one, the raw prompt gets the tokenizer's
    special tokens and the response is followed by eos. ``expand`` rewrites the rendered
    prompt text before it is tokenized (a VLM's ``<image>`` placeholders to its image tokens).
    """
    expand = expand or (lambda text: text)
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
        response_text = _suffix(full_text, prompt_text, where=where)
        return _ids(tokenizer, expand(prompt_text)), _ids(tokenizer, response_text)
    if not isinstance(prompt, str):
        messages = validate_messages(prompt, where=where)
        prompt = "\n".join(m["content"] for m in messages)
    return _ids(tokenizer, expand(prompt), special=True), _ids(tokenizer, response) + [tokenizer.eos_token_id]


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

    With ``processor`` (a vision-language model's :class:`~verl.data.vlm.ImagePromptEncoder`; prompt and
    response rows only) every row's images (``image_key``) are opened and checked at load (missing or
    unreadable, above the pixel budget, placeholders not matching the images: a ValueError naming the
    file, row and key), and items also hold ``mm_pixel_values`` [N, D] and ``mm_image_grid_thw`` [K, 3]
    (N, K: the file's widest row). A row whose tokens with its images exceed ``max_length`` is refused
    whatever ``truncation`` says: cutting would cut image tokens.
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
        processor: ImagePromptEncoder | None = None,
        image_key: str = "images",
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
        if processor is not None and messages_key:
            raise ValueError(
                "multi-turn SFT (data.multiturn.enable) of a vision-language model is not supported; write the rows "
                "as prompt/response pairs (data.prompt_key, data.response_key) with their images in data.image_key"
            )
        keys = [messages_key] if messages_key else [prompt_key, response_key]
        self._keys = keys
        self.processor, self.image_key = processor, image_key
        image_columns = [image_key] if processor is not None else []
        self.store = TableStore(files, columns=sorted({split_key(k)[0] for k in [*keys, *image_columns]}))
        # Every row is checked now, so a bad one fails at load, not at the batch that holds it.
        if messages_key:
            self.store.check_fields([FieldCheck(messages_key, ("conversation",))])
        else:
            self.store.check_fields(
                [FieldCheck(prompt_key, ("string", "messages")), FieldCheck(response_key, ("string",))]
            )
        if len(self.store) == 0:
            raise ValueError(f"SFT data files {[s.path for s in self.store.sources]} hold no rows")
        self._row_patches: list[list[int]] = []
        self._max_patches = self._max_images = 0
        if processor is not None:
            self._check_images()

    def _images(self, i: int) -> tuple[list[Any], str]:
        """The opened images of row ``i`` and the row's location."""
        source, j = self.store.locate(i)
        where = f"{source.path}: row {j}: {self.image_key}"
        row = source.row(j)
        self._check_image_column(source.path, row)
        value = row[self.image_key]
        if value is None:
            value = []
        if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__len__"):
            raise ValueError(f"{where}: a list of images, got a {type(value).__name__}; write a list")
        base_dir = os.path.dirname(os.path.abspath(source.path))
        return [load_image(e, where=f"{where}[{k}]", base_dir=base_dir) for k, e in enumerate(value)], where

    def _check_image_column(self, path: str, row: dict[str, Any]) -> None:
        if self.image_key not in row:
            raise ValueError(
                f"{path}: no column {self.image_key!r}: data.image_key names the column of the rows' images "
                "(model.path is a vision-language model); set data.image_key to the column that holds them"
            )

    def _check_images(self) -> None:
        """Open every row's images once (module docstring); keeps their patch counts and the widest row's."""
        for i in range(len(self.store)):
            source, j = self.store.locate(i)
            row = source.row(j)
            self._check_image_column(source.path, row)
            counts = self.processor.row_patches(
                row[self.image_key], get_field(row, self.prompt_key, path=source.path, row_index=j),
                row_where=f"{source.path}: row {j}", image_key=self.image_key, prompt_key=self.prompt_key,
                base_dir=os.path.dirname(os.path.abspath(source.path)),
            )
            self._row_patches.append(counts)
            self._max_patches = max(self._max_patches, sum(counts))
            self._max_images = max(self._max_images, len(counts))

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
            expand = None
            if self.processor is not None:
                patches = self._row_patches[i]
                expand = lambda text: self.processor.expand(text, patches, where=where)  # noqa: E731
            p, r = encode_prompt_response(
                self.tokenizer, prompt, response, apply_chat_template=self.apply_chat_template, where=where,
                expand=expand,
            )
            ids, mask = p + r, [0] * len(p) + [1] * len(r)
        return ids, mask, where

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"index {i} out of range [0, {len(self)})")
        ids, mask, where = self.encode(i)
        if self.processor is not None and self._row_patches[i] and len(ids) > self.max_length:
            raise ValueError(
                f"{where}: {len(ids)} tokens with its images, above data.max_length={self.max_length}; a row with "
                "images is not truncated (it would cut image tokens): raise data.max_length"
            )
        item = pack_sequence(
            ids,
            mask,
            max_length=self.max_length,
            pad_id=self.tokenizer.pad_token_id,
            truncation=self.truncation,
            where=where,
        )
        if self.processor is not None:
            images, _ = self._images(i)
            pixels, grid = self.processor.pixels(images) if images else (None, None)
            item.update(pad_row_images(pixels, grid, patches=self._max_patches, images=self._max_images,
                                       dim=self._pixel_dim()))
        return item

    def _pixel_dim(self) -> int:
        """Values per patch of the image processor (channels x temporal patch x patch x patch)."""
        ip = self.processor.image_processor
        return 3 * int(ip.temporal_patch_size) * int(ip.patch_size) ** 2
