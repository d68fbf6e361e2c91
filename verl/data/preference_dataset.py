"""Preference pairs (prompt, chosen, rejected) for DPO-style training."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from verl.data.io import TableStore, get_field, split_key
from verl.data.sft_dataset import SFT_TRUNCATION_MODES, encode_prompt_response, pack_sequence
from verl.data.tokenizer import ensure_pad_token


def response_text(value: Any, *, where: str) -> str:
    """A chosen/rejected answer as text: a string, or the last assistant turn of a message list.

    Public preference sets store either form (the list form repeats the prompt turns).
    """
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        for message in reversed(value):
            if isinstance(message, dict) and message.get("role") == "assistant":
                content = message.get("content")
                if not isinstance(content, str):
                    raise ValueError(
                        f"{where}: assistant content is {type(content).__name__}, expected a string"
                    )
                return content
        raise ValueError(f"{where}: the message list has no assistant turn")
    raise ValueError(f"{where}: expected a string or a message list, got {type(value).__name__}")



def _open_store(files, keys: dict[str, str]) -> TableStore:
    """The rows of ``files`` with the columns ``keys`` names (each checked), refused when empty."""
    store = TableStore(files, columns=sorted({split_key(k)[0] for k in keys.values()}))
    store.require_columns(list(keys.values()))
    if len(store) == 0:
        raise ValueError(f"preference data files {[s.path for s in store.sources]} hold no rows")
    return store

class PreferenceDataset(Dataset):
    """Pairs of responses to one prompt; both sides share the prompt tokens.

    Items: ``chosen_input_ids``, ``chosen_attention_mask``, ``chosen_position_ids``,
    ``chosen_loss_mask`` and the same four for ``rejected_``, each [max_length],
    right-padded; the loss masks cover only response tokens.
    """

    def __init__(
        self,
        files: str | Sequence[str],
        tokenizer: Any,
        *,
        max_length: int = 1024,
        prompt_key: str = "prompt",
        chosen_key: str = "chosen",
        rejected_key: str = "rejected",
        truncation: str = "error",
        apply_chat_template: bool = True,
    ):
        if truncation not in SFT_TRUNCATION_MODES:
            raise ValueError(f"truncation={truncation!r} is not one of {SFT_TRUNCATION_MODES}")
        self.tokenizer = ensure_pad_token(tokenizer)
        self.max_length = max_length
        self.keys = {"prompt": prompt_key, "chosen": chosen_key, "rejected": rejected_key}
        self.truncation = truncation
        self.apply_chat_template = apply_chat_template
        self.store = _open_store(files, self.keys)

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"index {i} out of range [0, {len(self)})")
        source, j = self.store.locate(i)
        row = source.row(j)
        fields = {name: get_field(row, key, path=source.path, row_index=j) for name, key in self.keys.items()}
        item: dict[str, torch.Tensor] = {}
        for side in ("chosen", "rejected"):
            where = f"{source.path}: row {j} ({self.keys[side]})"
            prompt_ids, response_ids = encode_prompt_response(
                self.tokenizer,
                fields["prompt"],
                response_text(fields[side], where=where),
                apply_chat_template=self.apply_chat_template,
                where=where,
            )
            packed = pack_sequence(
                prompt_ids + response_ids,
                [0] * len(prompt_ids) + [1] * len(response_ids),
                max_length=self.max_length,
                pad_id=self.tokenizer.pad_token_id,
                truncation=self.truncation,
                where=where,
            )
            item.update({f"{side}_{k}": v for k, v in packed.items()})
        return item


PAIR_SIDES = ("chosen", "rejected")


class PreferencePairDataset(Dataset):
    """Preference pairs in the rollout layout, for DPO on the RL trainer's roles (``data.pairs``).

    Each item holds, for ``side`` in chosen/rejected: ``{side}_input_ids``,
    ``{side}_attention_mask``, ``{side}_position_ids`` [max_prompt_length + max_response_length]
    (the prompt left-padded to ``max_prompt_length``, the response right-padded to
    ``max_response_length``, as a rollout lays out a sample) and ``{side}_response_mask``
    [max_response_length]; plus ``uid`` (the row). A prompt or response longer than its budget
    is an error naming the row (raise ``data.max_prompt_length``/``max_response_length``).
    """

    def __init__(
        self,
        files: str | Sequence[str],
        tokenizer: Any,
        *,
        max_prompt_length: int,
        max_response_length: int,
        prompt_key: str = "prompt",
        apply_chat_template: bool = True,
    ):
        self.tokenizer = ensure_pad_token(tokenizer)
        self.max_prompt_length, self.max_response_length = max_prompt_length, max_response_length
        self.keys = {"prompt": prompt_key, "chosen": "chosen", "rejected": "rejected"}
        self.apply_chat_template = apply_chat_template
        self.store = _open_store(files, self.keys)

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < len(self):
            raise IndexError(f"index {i} out of range [0, {len(self)})")
        source, j = self.store.locate(i)
        row = source.row(j)
        fields = {name: get_field(row, key, path=source.path, row_index=j) for name, key in self.keys.items()}
        item: dict[str, Any] = {"uid": str(self.store.origin(i))}
        p, r, pad = self.max_prompt_length, self.max_response_length, self.tokenizer.pad_token_id
        for side in PAIR_SIDES:
            where = f"{source.path}: row {j} ({self.keys[side]})"
            prompt_ids, response_ids = encode_prompt_response(
                self.tokenizer,
                fields["prompt"],
                response_text(fields[side], where=where),
                apply_chat_template=self.apply_chat_template,
                where=where,
            )
            if len(prompt_ids) > p or len(response_ids) > r:
                raise ValueError(
                    f"{where}: {len(prompt_ids)} prompt and {len(response_ids)} response tokens do not fit "
                    f"data.max_prompt_length={p} / data.max_response_length={r}; raise them"
                )
            ids = torch.full((p + r,), pad, dtype=torch.long)
            mask = torch.zeros(p + r, dtype=torch.long)
            ids[p - len(prompt_ids) : p] = torch.as_tensor(prompt_ids, dtype=torch.long)
            ids[p : p + len(response_ids)] = torch.as_tensor(response_ids, dtype=torch.long)
            mask[p - len(prompt_ids) : p + len(response_ids)] = 1
            item[f"{side}_input_ids"] = ids
            item[f"{side}_attention_mask"] = mask
            item[f"{side}_position_ids"] = (mask.cumsum(0) - 1).clamp(min=0)
            item[f"{side}_response_mask"] = mask[p:].clone()
        return item
