"""The RL prompt dataset: verl-format records from parquet/arrow/jsonl, rollout-ready.

A record holds ``prompt`` (chat message list or string), ``data_source`` (which reward
function scores it), ``reward_model: {style, ground_truth}`` and ``extra_info``. Items are
left-padded to ``max_prompt_length`` so a batch goes to the rollout engine as is.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from verl.data.io import FieldCheck, TableStore, get_field, split_key
from verl.data.sampler import StatefulDataLoader
from verl.data.tokenizer import (
    TRUNCATION_MODES,
    encode_text,
    ensure_pad_token,
    prompt_to_text,
    truncate,
)
from verl.utils.logging import log_rank0, warn_once

logger = logging.getLogger(__name__)

# Columns read besides the prompt and reward-function key; absent or null ones read as empty,
# present ones must be objects.
_OPTIONAL_COLUMNS = ("reward_model", "extra_info")


def left_pad(ids: Sequence[int], length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """input_ids / attention_mask / position_ids, each [length], with ``ids`` at the right end.

    Position ids count real tokens from 0 (padding positions hold 0), the layout rollout
    engines and the trainer's logprob pass both expect.
    """
    assert len(ids) <= length, (len(ids), length)
    pad = length - len(ids)
    input_ids = torch.full((length,), pad_id, dtype=torch.long)
    input_ids[pad:] = torch.as_tensor(list(ids), dtype=torch.long)
    attention_mask = torch.zeros(length, dtype=torch.long)
    attention_mask[pad:] = 1
    position_ids = (attention_mask.cumsum(0) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}


def _object_array(values: list[Any]) -> np.ndarray:
    # np.array(list_of_lists) would build a 2-D array; fill a 1-D object array element-wise.
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def collate_fn(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack tensors ([B, ...]) and gather everything else into 1-D numpy object arrays [B]."""
    if not items:
        raise ValueError("collate_fn got an empty list of items")
    out: dict[str, Any] = {}
    for key in items[0]:
        values = [item[key] for item in items]
        if isinstance(values[0], torch.Tensor):
            out[key] = torch.stack(values)
        else:
            out[key] = _object_array(values)
    return out


def _config_field(cfg: Any, name: str) -> Any:
    try:
        return getattr(cfg, name)
    except AttributeError:
        raise ValueError(
            f"data config {type(cfg).__name__} has no field {name!r}, which the dataset needs"
        ) from None


class RLPromptDataset(Dataset):
    """Prompts for rollout, read lazily from one or more data files.

    Each item: ``input_ids``, ``attention_mask``, ``position_ids`` (tensors [max_prompt_length],
    left-padded), ``raw_prompt_ids`` (the unpadded ids), ``data_source``, ``reward_model``,
    ``extra_info``, ``index`` (row in the concatenated files), ``uid``, and ``raw_prompt``
    (the message list) when ``return_raw_chat``.
    """

    def __init__(
        self,
        files: str | Sequence[str],
        tokenizer: Any,
        *,
        max_prompt_length: int = 1024,
        prompt_key: str = "prompt",
        reward_fn_key: str = "data_source",
        truncation: str = "error",
        filter_overlong_prompts: bool = False,
        apply_chat_template: bool = True,
        return_raw_chat: bool = False,
        extra_keys: Sequence[str] = (),
    ):
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation={truncation!r} is not one of {TRUNCATION_MODES}")
        if max_prompt_length <= 0:
            raise ValueError(f"data.max_prompt_length must be positive, got {max_prompt_length}")
        self.tokenizer = ensure_pad_token(tokenizer)
        self.max_prompt_length = max_prompt_length
        self.prompt_key = prompt_key
        self.reward_fn_key = reward_fn_key
        self.truncation = truncation
        self.apply_chat_template = apply_chat_template
        self.return_raw_chat = return_raw_chat
        self.extra_keys = tuple(extra_keys)
        columns = {split_key(k)[0] for k in (prompt_key, reward_fn_key, *self.extra_keys)}
        self.store = TableStore(files, columns=sorted(columns | set(_OPTIONAL_COLUMNS)))
        # Every row is checked now, so a bad one fails at load, not at the batch that holds it.
        self.store.check_fields(
            [
                FieldCheck(prompt_key, ("string", "messages")),
                FieldCheck(reward_fn_key, ("string",)),
                *(FieldCheck(k) for k in self.extra_keys),
                *(FieldCheck(k, ("dict",), nullable=True) for k in _OPTIONAL_COLUMNS),
            ]
        )
        self.files = [s.path for s in self.store.sources]
        if len(self.store) == 0:
            raise ValueError(f"data files {self.files} hold no rows")
        # Prompts truncated so far by this process (DataLoader workers count in their own copy).
        self.num_truncated = 0
        # Row indices into the store; None means every row in order (no filtering pass).
        self._rows: np.ndarray | None = None
        if filter_overlong_prompts:
            self._filter_overlong()

    @classmethod
    def from_config(cls, data_cfg: Any, tokenizer: Any, files: str | Sequence[str]) -> RLPromptDataset:
        """Build from a ``data`` config section (read by attribute name, duck-typed)."""
        return cls(
            files,
            tokenizer,
            max_prompt_length=_config_field(data_cfg, "max_prompt_length"),
            prompt_key=_config_field(data_cfg, "prompt_key"),
            reward_fn_key=_config_field(data_cfg, "reward_fn_key"),
            truncation=_config_field(data_cfg, "truncation"),
            filter_overlong_prompts=_config_field(data_cfg, "filter_overlong_prompts"),
            apply_chat_template=_config_field(data_cfg, "apply_chat_template"),
            return_raw_chat=_config_field(data_cfg, "return_raw_chat"),
        )

    def _prompt_text(self, prompt: Any, where: str) -> tuple[str, bool]:
        return prompt_to_text(
            self.tokenizer, prompt, apply_chat_template=self.apply_chat_template, where=where
        )

    def _filter_overlong(self) -> None:
        """One pass over the prompt column: keep rows whose prompt fits ``max_prompt_length``."""
        column, nested = split_key(self.prompt_key)
        keep: list[np.ndarray] = []
        base = 0
        dropped_per_file: dict[str, int] = {}
        for source, start, values in self.store.iter_column(self.prompt_key, batch_rows=1024):
            texts: dict[bool, list[str]] = {True: [], False: []}
            slots: dict[bool, list[int]] = {True: [], False: []}
            for k, value in enumerate(values):
                row = start + k
                where = f"{source.path}: row {row}"
                prompt = get_field({column: value}, self.prompt_key, path=source.path, row_index=row)
                text, templated = self._prompt_text(prompt, where)
                texts[templated].append(text)
                slots[templated].append(k)
            lengths = np.zeros(len(values), dtype=np.int64)
            for templated in (True, False):
                if texts[templated]:
                    enc = self.tokenizer(texts[templated], add_special_tokens=not templated)["input_ids"]
                    lengths[slots[templated]] = [len(ids) for ids in enc]
            ok = lengths <= self.max_prompt_length
            dropped_per_file[source.path] = dropped_per_file.get(source.path, 0) + int((~ok).sum())
            keep.append(base + np.nonzero(ok)[0])
            base += len(values)
        assert base == len(self.store), (base, len(self.store))
        rows = np.concatenate(keep) if keep else np.zeros(0, dtype=np.int64)
        dropped = len(self.store) - len(rows)
        log_rank0(
            logger,
            logging.INFO,
            "filter_overlong_prompts: dropped %d of %d prompts longer than %d tokens (%s)",
            dropped,
            len(self.store),
            self.max_prompt_length,
            ", ".join(f"{os.path.basename(p)}: {n}" for p, n in dropped_per_file.items()),
        )
        if len(rows) == 0:
            raise ValueError(
                f"no prompts left in {self.files}: all {dropped} rows were dropped by "
                f"filter_overlong_prompts "
                f"because they are longer than max_prompt_length={self.max_prompt_length} tokens; raise "
                f"data.max_prompt_length or check the prompt key {self.prompt_key!r}"
            )
        self._rows = rows

    def __len__(self) -> int:
        return len(self.store) if self._rows is None else len(self._rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < len(self):
            raise IndexError(f"index {i} out of range [0, {len(self)})")
        index = i if self._rows is None else int(self._rows[i])
        source, row_index = self.store.locate(index)
        row = source.row(row_index)
        where = f"{source.path}: row {row_index}"
        prompt = get_field(row, self.prompt_key, path=source.path, row_index=row_index)
        data_source = get_field(row, self.reward_fn_key, path=source.path, row_index=row_index)
        text, templated = self._prompt_text(prompt, where)
        ids = encode_text(self.tokenizer, text, templated=templated)
        if len(ids) > self.max_prompt_length:
            ids = truncate(ids, self.max_prompt_length, self.truncation, where=where)
            self.num_truncated += 1
            warn_once(
                logger,
                "prompts longer than max_prompt_length=%d are truncated (%s); the count is in "
                "dataset.num_truncated",
                self.max_prompt_length,
                self.truncation,
            )
        item: dict[str, Any] = left_pad(ids, self.max_prompt_length, self.tokenizer.pad_token_id)
        item["raw_prompt_ids"] = ids
        if self.return_raw_chat:
            item["raw_prompt"] = prompt
        item["data_source"] = data_source
        item["reward_model"] = row.get("reward_model") or {}
        item["extra_info"] = row.get("extra_info") or {}
        for key in self.extra_keys:
            item[key] = get_field(row, key, path=source.path, row_index=row_index)
        item["index"] = index
        item["uid"] = str(index)
        return item


def load_dataset_class(path: str, name: str) -> type[Dataset]:
    """Import class ``name`` from the Python file ``path``; it must subclass torch Dataset."""
    if not path or not os.path.isfile(path):
        raise ValueError(f"data.custom_cls.path={path!r} is not a Python file")
    module_name = f"verl_custom_dataset_{abs(hash(os.path.abspath(path)))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"data.custom_cls.path={path!r} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cls = getattr(module, name, None)
    if cls is None:
        raise ValueError(f"data.custom_cls.name={name!r} is not defined in {path}")
    if not (isinstance(cls, type) and issubclass(cls, Dataset)):
        raise ValueError(
            f"data.custom_cls {name!r} from {path} must be a subclass of torch.utils.data.Dataset, "
            f"got {cls!r}"
        )
    return cls


def create_rl_dataset(data_cfg: Any, tokenizer: Any, files: str | Sequence[str]) -> Dataset:
    """The dataset for ``files``: the user's ``data.custom_cls`` when set, else ``RLPromptDataset``.

    A custom class is built with its ``from_config(data_cfg, tokenizer, files)`` when it has
    one, else as ``cls(data_files=files, tokenizer=tokenizer, config=data_cfg)``.
    """
    custom = _config_field(data_cfg, "custom_cls")
    path = getattr(custom, "path", None) if custom is not None else None
    if not path:
        return RLPromptDataset.from_config(data_cfg, tokenizer, files)
    cls = load_dataset_class(path, _config_field(custom, "name"))
    log_rank0(logger, logging.INFO, "using custom dataset class %s from %s", cls.__name__, path)
    if hasattr(cls, "from_config"):
        return cls.from_config(data_cfg, tokenizer, files)
    return cls(data_files=files, tokenizer=tokenizer, config=data_cfg)


def build_dataloader(dataset: Dataset, data_cfg: Any, *, train: bool) -> StatefulDataLoader:
    """A resumable loader for the train (shuffled per ``data.shuffle``) or validation split.

    A validation batch size of None means the whole validation set in one batch.
    """
    if train:
        batch_size = _config_field(data_cfg, "train_batch_size")
    else:
        batch_size = _config_field(data_cfg, "val_batch_size") or len(dataset)
    return StatefulDataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=bool(_config_field(data_cfg, "shuffle")) if train else False,
        seed=_config_field(data_cfg, "seed"),
        num_workers=_config_field(data_cfg, "dataloader_num_workers"),
        drop_last=train,
        collate_fn=collate_fn,
    )
