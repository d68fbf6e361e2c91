"""The RL prompt dataset: verl-format records from parquet/arrow/jsonl, rollout-ready.

A record holds ``prompt`` (chat message list or string), ``data_source`` (which reward
function scores it), ``reward_model: {style, ground_truth}`` and ``extra_info``. Items are
left-padded to ``max_prompt_length`` so a batch goes to the rollout engine as is.

The extension point is the reference verl's: ``RLHFDataset`` (also importable as
``verl.utils.dataset.RLHFDataset``) is built from the ``data`` config, and a subclass named by
``data.custom_cls.path/name`` overrides ``_read_files_and_tokenize`` to set ``self.dataframe``
from ``self.data_files`` (a ``datasets.Dataset``, a pyarrow Table or a ``TableStore``),
calling ``self.maybe_filter_out_long_prompts``; everything after (checks, templating,
padding, truncation) is the built-in dataset's. ``create_rl_dataset`` is the factory the
trainer calls.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import logging
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import Dataset

from verl.data.io import FieldCheck, FileSource, FrameSource, TableStore, get_field, is_frame, split_key
from verl.data.sampler import StatefulDataLoader
from verl.data.vlm import ImagePromptEncoder, load_image, pad_row_images
from verl.data.tokenizer import (
    TRUNCATION_MODES,
    encode_text,
    ensure_pad_token,
    prompt_to_text,
    template_renders_tools,
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
    if isinstance(cfg, Mapping):
        if name in cfg:
            return cfg[name]
    else:
        try:
            return getattr(cfg, name)
        except AttributeError:
            pass
    raise ValueError(f"data config {type(cfg).__name__} has no field {name!r}, which the dataset needs")


def _optional_field(section: Any, name: str) -> Any:
    """``section.name`` of a section whose fields default to None (``CustomClassConfig``), or None."""
    if section is None:
        return None
    return section.get(name) if isinstance(section, Mapping) else getattr(section, name, None)


class RLPromptDataset(Dataset):
    """Prompts for rollout, read lazily from one or more data files.

    Each item: ``input_ids``, ``attention_mask``, ``position_ids`` (tensors [max_prompt_length],
    left-padded), ``raw_prompt_ids`` (the unpadded ids), ``data_source``, ``reward_model``,
    ``extra_info``, ``index`` (the row in the concatenated files, or in ``self.dataframe`` as a
    subclass set it), ``uid``, and ``raw_prompt`` (the message list) when ``return_raw_chat``.
    With a ``processor`` (a vision-language model's :class:`~verl.data.vlm.ImagePromptEncoder`) each
    ``<image>`` of the prompt is the next image of the row's ``image_key`` column, widened to the
    model's image tokens (which count towards ``max_prompt_length``), and the item holds the
    images' ``mm_pixel_values`` / ``mm_image_grid_thw`` (``verl.data.vlm``); every image is opened and
    checked at load (missing, unreadable, above the pixel budget, placeholders that do not match).

    Loading is ``_read_files_and_tokenize()`` (see ``RLHFDataset`` for overriding it): by
    default ``self.dataframe`` is a ``TableStore`` over ``self.data_files``, which reads rows on
    demand within a byte budget. Every row's fields are checked before the dataset is used.
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
        tool_config_path: str | None = None,
        processor: ImagePromptEncoder | None = None,
        image_key: str = "images",
    ):
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation={truncation!r} is not one of {TRUNCATION_MODES}")
        if max_prompt_length <= 0:
            raise ValueError(f"data.max_prompt_length must be positive, got {max_prompt_length}")
        self.tokenizer = ensure_pad_token(tokenizer)
        # Config defaults name files under "~" (e.g. ~/data/gsm8k/train.parquet).
        paths = [files] if isinstance(files, (str, os.PathLike)) else list(files)
        self.data_files = [os.path.expanduser(os.fspath(p)) for p in paths]
        self.max_prompt_length = max_prompt_length
        self.prompt_key = prompt_key
        self.reward_fn_key = reward_fn_key
        self.truncation = truncation
        self.filter_overlong_prompts = filter_overlong_prompts
        self.apply_chat_template = apply_chat_template
        self.return_raw_chat = return_raw_chat
        self.extra_keys = tuple(extra_keys)
        self.tool_schemas = self._tool_schemas(tool_config_path)
        self.processor = processor
        self.image_key = image_key
        # Per source (by id): each row's images' patch counts, from the check at load (processor only).
        self._row_patches: dict[int, list[list[int]]] = {}
        self._max_patches = self._max_images = 0
        image_columns = (image_key,) if processor is not None else ()
        columns = {split_key(k)[0] for k in (prompt_key, reward_fn_key, *self.extra_keys, *image_columns)}
        self._columns = sorted(columns | set(_OPTIONAL_COLUMNS))
        self._checks = [
            FieldCheck(prompt_key, ("string", "messages")),
            FieldCheck(reward_fn_key, ("string",)),
            *(FieldCheck(k) for k in self.extra_keys),
            *(FieldCheck(k, ("dict",), nullable=True) for k in _OPTIONAL_COLUMNS),
        ]
        self._checked: list[FileSource] = []  # sources whose every row passed self._checks
        # Prompts truncated so far by this process (DataLoader workers count in their own copy).
        self.num_truncated = 0
        self.dataframe: Any = None
        self._read_files_and_tokenize()
        # Every row is checked now, so a bad one fails at load, not at the batch that holds it.
        self.store = self._checked_store(self.dataframe)
        if self.truncation == "error" and not self.filter_overlong_prompts:
            self._refuse_overlong_prompts(self.store)
        self.files = [s.path for s in self.store.sources]
        if len(self.store) == 0:
            if any(isinstance(source, FrameSource) for source in self.store.sources):
                raise ValueError(f"{type(self).__name__}.dataframe holds no rows (data files {self.data_files})")
            raise ValueError(f"data files {self.files} hold no rows")

    @classmethod
    def from_config(cls, data_cfg: Any, tokenizer: Any, files: str | Sequence[str]) -> RLPromptDataset:
        """Build from a ``data`` config section (read by attribute name, duck-typed)."""
        return cls(files, tokenizer, **_options(data_cfg))

    def _read_files_and_tokenize(self) -> None:
        """Set ``self.dataframe`` from ``self.data_files``, then drop overlong prompts if asked.

        The default reads lazily (a ``TableStore``); override it to read the files your way.
        """
        self.dataframe = TableStore(self.data_files, columns=self._columns)
        self.dataframe = self.maybe_filter_out_long_prompts(self.dataframe)

    def maybe_filter_out_long_prompts(self, dataframe: Any = None) -> Any:
        """``dataframe`` (default: ``self.dataframe``) without the rows whose prompt is longer than
        ``max_prompt_length`` tokens when ``filter_overlong_prompts`` is on, else as given.

        The result is of the same kind (``datasets.Dataset.select``, ``pyarrow.Table.take``,
        ``TableStore.select``). Given ``self.dataframe``, it also becomes ``self.dataframe``, so
        both ``self.dataframe = self.maybe_filter_out_long_prompts(self.dataframe)`` and the bare
        call filter. Rows are checked first (ValueError naming the row and field).
        """
        if dataframe is None:
            dataframe = self.dataframe
        store = self._checked_store(dataframe)
        if not self.filter_overlong_prompts:
            return dataframe
        keep = self._fitting_rows(store)
        if isinstance(dataframe, TableStore):
            kept = dataframe.select(keep)
        elif isinstance(dataframe, pa.Table):
            kept = dataframe.take(pa.array(keep, type=pa.int64()))
        else:  # datasets.Dataset
            kept = dataframe.select(keep.tolist())
        if dataframe is self.dataframe:
            self.dataframe = kept
        return kept

    def _checked_store(self, frame: Any) -> TableStore:
        """``frame`` as a TableStore, its rows checked once against the dataset's fields."""
        if isinstance(frame, TableStore):
            store = frame
        elif is_frame(frame):
            store = TableStore(FrameSource(frame, f"{type(self).__name__}.dataframe", columns=self._columns))
        elif frame is None:
            raise ValueError(
                f"{type(self).__name__}._read_files_and_tokenize did not set self.dataframe; set it from "
                f"self.data_files (e.g. datasets.load_dataset('arrow', data_files=self.data_files)['train'])"
            )
        else:
            hint = ""
            if type(frame).__name__ == "DatasetDict":
                hint = f" with splits {list(frame)}: take one, e.g. load_dataset(...)['train']"
            raise ValueError(
                f"{type(self).__name__}._read_files_and_tokenize set self.dataframe to a "
                f"{type(frame).__name__}{hint}; set it to a datasets.Dataset (e.g. datasets.load_dataset("
                f"'arrow', data_files=self.data_files)['train']), a pyarrow Table or a verl.data.TableStore"
            )
        unchecked = [s for s in store.sources if not any(s is c for c in self._checked)]
        if unchecked:
            TableStore(unchecked).check_fields(self._checks)
            if self.processor is not None:
                for source in unchecked:
                    self._check_images(source)
            self._checked.extend(unchecked)
        return store

    def _check_images(self, source: FileSource) -> None:
        """Open every image of ``source`` once: a ValueError naming the file, row and key for a missing or
        unreadable image, one above the processor's pixel budget, or a prompt whose ``<image>`` placeholders
        do not match its images; keeps each row's patch counts (for prompt lengths and the batch's width)."""
        base_dir = os.path.dirname(os.path.abspath(source.path))
        column, _ = split_key(self.prompt_key)
        patches: list[list[int]] = []
        prompts = source.iter_column(column, 1024)
        image_batches = source.iter_column(self.image_key, 1024)
        try:
            first = next(image_batches, None)  # opens the file: a missing column is named here
        except ValueError as exc:
            if f"no column {self.image_key!r}" not in str(exc):
                raise
            raise ValueError(f"{exc}: data.image_key={self.image_key!r} names the column of the rows' images (a "
                             "vision-language model's data); set data.image_key to the column that holds them") from None
        for values in itertools.chain([] if first is None else [first], image_batches):
            for value, prompt in zip(values, next(prompts)):
                counts = self.processor.row_patches(value, prompt, row_where=f"{source.path}: row {len(patches)}",
                                                    image_key=self.image_key, prompt_key=self.prompt_key,
                                                    base_dir=base_dir)
                patches.append(counts)
                self._max_patches = max(self._max_patches, sum(counts))
                self._max_images = max(self._max_images, len(counts))
        self._row_patches[id(source)] = patches

    def _with_images(self, text: str, source: FileSource, row: int, where: str) -> str:
        """``text`` with its ``<image>`` placeholders widened to the row's image tokens (a processor's dataset)."""
        if self.processor is None:
            return text
        return self.processor.expand(text, self._row_patches[id(source)][row], where=where)

    def _tool_schemas(self, path: str | None) -> list[dict[str, Any]] | None:
        """The schemas of ``data.tool_config_path``'s tools, for the chat template's ``tools=``
        (None without a file, or when the template does not write tools: a warning says so)."""
        if not path:
            return None
        from verl.tools import load_tool_config

        try:
            schemas = [t.schema for t in load_tool_config(os.path.expanduser(path))]
        except ValueError as exc:
            raise ValueError(f"data.tool_config_path: {exc}") from exc
        if not (self.apply_chat_template and template_renders_tools(self.tokenizer, schemas)):
            logger.warning(
                "data.tool_config_path=%s: the tokenizer's chat template does not render tools (or "
                "data.apply_chat_template is off); prompts are rendered without the tool schemas",
                path,
            )
            return None
        return schemas

    def _prompt_text(self, prompt: Any, where: str) -> tuple[str, bool]:
        return prompt_to_text(
            self.tokenizer, prompt, apply_chat_template=self.apply_chat_template, where=where, tools=self.tool_schemas
        )

    def _prompt_lengths(self, store: TableStore) -> Iterator[tuple[Any, np.ndarray, np.ndarray]]:
        """One pass over the prompt column of ``store``: (source, rows within its file [n], prompt
        lengths in tokens [n]) per batch, as ``__getitem__`` encodes them."""
        column, _ = split_key(self.prompt_key)
        for source, file_rows, values in store.iter_column(self.prompt_key, batch_rows=1024):
            texts: dict[bool, list[str]] = {True: [], False: []}
            slots: dict[bool, list[int]] = {True: [], False: []}
            for k, (row, value) in enumerate(zip(file_rows.tolist(), values)):
                where = f"{source.path}: row {row}"
                prompt = get_field({column: value}, self.prompt_key, path=source.path, row_index=row)
                text, templated = self._prompt_text(prompt, where)
                texts[templated].append(self._with_images(text, source, row, where))
                slots[templated].append(k)
            lengths = np.zeros(len(values), dtype=np.int64)
            for templated in (True, False):
                if texts[templated]:
                    enc = self.tokenizer(texts[templated], add_special_tokens=not templated)["input_ids"]
                    lengths[slots[templated]] = [len(ids) for ids in enc]
            yield source, file_rows, lengths

    def _refuse_overlong_prompts(self, store: TableStore) -> None:
        """``truncation="error"`` without the filter: every prompt must fit, checked at load (a
        ValueError naming the first rows and how many), not when the batch holding one is drawn
        after the models and engines started."""
        over: list[str] = []
        count = 0
        for source, file_rows, lengths in self._prompt_lengths(store):
            for k in np.nonzero(lengths > self.max_prompt_length)[0].tolist():
                count += 1
                if len(over) < 3:
                    over.append(f"{source.path}: row {int(file_rows[k])} ({int(lengths[k])} tokens)")
        if count:
            raise ValueError(
                f"{count} of {len(store)} prompts are longer than data.max_prompt_length={self.max_prompt_length} "
                f"tokens and data.truncation=error: {'; '.join(over)}{' ...' if count > len(over) else ''}; raise "
                "data.max_prompt_length, set data.filter_overlong_prompts=true to drop them, or set data.truncation "
                "to left, right or middle"
            )

    def _fitting_rows(self, store: TableStore) -> np.ndarray:
        """One pass over the prompt column: the rows of ``store`` whose prompt fits ``max_prompt_length``."""
        keep: list[np.ndarray] = []
        base = 0
        dropped_per_file: dict[str, int] = {}
        for source, _, lengths in self._prompt_lengths(store):
            ok = lengths <= self.max_prompt_length
            dropped_per_file[source.path] = dropped_per_file.get(source.path, 0) + int((~ok).sum())
            keep.append(base + np.nonzero(ok)[0])
            base += len(lengths)
        assert base == len(store), (base, len(store))
        rows = np.concatenate(keep) if keep else np.zeros(0, dtype=np.int64)
        dropped = len(store) - len(rows)
        log_rank0(
            logger,
            logging.INFO,
            "filter_overlong_prompts: dropped %d of %d prompts longer than %d tokens (%s)",
            dropped,
            len(store),
            self.max_prompt_length,
            ", ".join(f"{os.path.basename(p)}: {n}" for p, n in dropped_per_file.items()),
        )
        if len(rows) == 0:
            raise ValueError(
                f"no prompts left in {[s.path for s in store.sources]}: all {dropped} rows were dropped by "
                f"filter_overlong_prompts "
                f"because they are longer than max_prompt_length={self.max_prompt_length} tokens; raise "
                f"data.max_prompt_length or check the prompt key {self.prompt_key!r}"
            )
        return rows

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < len(self):
            raise IndexError(f"index {i} out of range [0, {len(self)})")
        index = self.store.origin(i)
        source, row_index = self.store.locate(i)
        row = source.row(row_index)
        where = f"{source.path}: row {row_index}"
        prompt = get_field(row, self.prompt_key, path=source.path, row_index=row_index)
        data_source = get_field(row, self.reward_fn_key, path=source.path, row_index=row_index)
        text, templated = self._prompt_text(prompt, where)
        images = None
        if self.processor is not None:
            base_dir = os.path.dirname(os.path.abspath(source.path))
            entries = row.get(self.image_key) or []
            images = self.processor.pixels(
                [load_image(e, where=f"{where}: {self.image_key}[{i}]", base_dir=base_dir) for i, e in enumerate(entries)]
            ) if len(entries) else (None, None)
            text = self._with_images(text, source, row_index, where)
        ids = encode_text(self.tokenizer, text, templated=templated)
        if len(ids) > self.max_prompt_length and images is not None and images[1] is not None:
            raise ValueError(
                f"{where}: {len(ids)} tokens with its images, above data.max_prompt_length={self.max_prompt_length}; "
                "a prompt with images is not truncated (it would cut image tokens): raise data.max_prompt_length "
                "or set data.filter_overlong_prompts=true"
            )
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
        if images is not None:
            dim = images[0].shape[-1] if images[0] is not None else self._pixel_dim()
            item.update(pad_row_images(*images, patches=self._max_patches, images=self._max_images, dim=dim))
        item["index"] = index
        item["uid"] = str(index)
        return item

    def _pixel_dim(self) -> int:
        """Values per patch of the image processor (channels x temporal patch x patch x patch)."""
        ip = self.processor.image_processor
        return 3 * int(ip.temporal_patch_size) * int(ip.patch_size) ** 2


def _options(data_cfg: Any) -> dict[str, Any]:
    """RLPromptDataset's keyword arguments from a ``data`` config section."""
    names = (
        "max_prompt_length",
        "prompt_key",
        "reward_fn_key",
        "truncation",
        "filter_overlong_prompts",
        "apply_chat_template",
        "return_raw_chat",
    )
    out = {name: _config_field(data_cfg, name) for name in names}
    out["tool_config_path"] = _optional_field(data_cfg, "tool_config_path")  # absent from older mapping configs
    image_key = _optional_field(data_cfg, "image_key")  # absent from older mapping configs: the dataset's default
    if image_key is not None:
        out["image_key"] = image_key
    return out


class RLHFDataset(RLPromptDataset):
    """The reference verl's RL dataset and its extension point, over ``RLPromptDataset``.

    Built as ``RLHFDataset(data_files, tokenizer, config)`` from the ``data`` config (the
    ``DataConfig`` section or a mapping with the same keys). To read data your own way, subclass
    it, override ``_read_files_and_tokenize(self)`` to set ``self.dataframe`` from
    ``self.data_files`` and call ``self.maybe_filter_out_long_prompts(self.dataframe)``, and name
    the class in ``data.custom_cls.path`` / ``data.custom_cls.name``::

        class MyDataset(RLHFDataset):
            def _read_files_and_tokenize(self):
                self.dataframe = datasets.load_dataset("arrow", data_files=self.data_files)["train"]
                self.dataframe = self.maybe_filter_out_long_prompts(self.dataframe)

    ``self.dataframe`` may be a ``datasets.Dataset``, a pyarrow Table or a ``TableStore``; it
    is read once, after ``_read_files_and_tokenize``, and items are the built-in dataset's.
    ``processor`` (a vision-language model's transformers processor or
    :class:`~verl.data.vlm.ImagePromptEncoder`) reads the rows' ``images`` with their ``<image>``
    placeholders. Departures from the reference: no ``max_samples`` (refused when set), no videos,
    and every option the dataset reads must be in ``config`` (the defaults live in ``DataConfig`` only).
    """

    def __init__(self, data_files: str | Sequence[str], tokenizer: Any, config: Any, processor: Any = None,
                 max_samples: int = -1):
        if processor is not None and not isinstance(processor, ImagePromptEncoder):
            if getattr(processor, "image_processor", None) is None or getattr(processor, "tokenizer", None) is None:
                raise ValueError(
                    f"{type(self).__name__}: processor of type {type(processor).__name__} has no image_processor and "
                    "tokenizer; pass the vision-language model's processor (AutoProcessor) or processor=None"
                )
            processor = ImagePromptEncoder.from_processor(processor)
        if max_samples not in (-1, None):
            raise ValueError(
                f"{type(self).__name__}: max_samples={max_samples} is not supported; select the rows in "
                f"_read_files_and_tokenize (e.g. self.dataframe.select(range(n)))"
            )
        self.config = config
        super().__init__(data_files, tokenizer, processor=processor, **_options(config))

    @classmethod
    def from_config(cls, data_cfg: Any, tokenizer: Any, files: str | Sequence[str]) -> RLHFDataset:
        """Build as the reference factory does: ``cls(data_files=files, tokenizer=tokenizer, config=data_cfg)``."""
        return cls(data_files=files, tokenizer=tokenizer, config=data_cfg)


def load_dataset_class(path: str | None, name: str | None) -> type[Dataset]:
    """Import class ``name`` from the Python file ``path``; it must subclass torch Dataset.

    The file is imported once per process as a module of its own (registered in sys.modules,
    so classes and dataclasses in it behave as in any module).
    """
    if not path or not os.path.isfile(os.path.expanduser(path)):
        raise ValueError(
            f"data.custom_cls.path={path!r} is not a Python file; point it at the .py file that defines "
            f"your dataset class, or unset it for the built-in dataset"
        )
    path = os.path.abspath(os.path.expanduser(path))
    if not name:
        raise ValueError(f"data.custom_cls.name is not set; set it to the dataset class defined in {path}")
    module_name = "verl_custom_dataset_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"data.custom_cls.path={path!r} cannot be imported as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
    cls = getattr(module, name, None)
    if cls is None:
        classes = sorted(k for k, v in vars(module).items() if isinstance(v, type) and v.__module__ == module_name)
        raise ValueError(
            f"data.custom_cls.name={name!r} is not defined in {path} (classes there: {classes}); "
            f"set it to your dataset class's name"
        )
    if not (isinstance(cls, type) and issubclass(cls, Dataset)):
        raise ValueError(
            f"data.custom_cls {name!r} from {path} must be a subclass of torch.utils.data.Dataset, "
            f"got {cls!r}; subclass verl.utils.dataset.RLHFDataset and override _read_files_and_tokenize"
        )
    return cls


def create_rl_dataset(data_cfg: Any, tokenizer: Any, files: str | Sequence[str], *,
                      processor: ImagePromptEncoder | None = None) -> Dataset:
    """The dataset for ``files``: the user's ``data.custom_cls`` when set, else ``RLPromptDataset``
    (with ``processor``, a vision-language model's, reading the rows' images).

    A custom class is built with its ``from_config(data_cfg, tokenizer, files)`` when it has
    one (``RLHFDataset`` subclasses do: ``cls(data_files=files, tokenizer=tokenizer,
    config=data_cfg)``), else as ``cls(data_files=files, tokenizer=tokenizer, config=data_cfg)``;
    a processor goes to it as ``processor=`` (the reference's argument).
    """
    custom = _config_field(data_cfg, "custom_cls")
    path = _optional_field(custom, "path")
    if not path:
        if processor is not None:
            return RLPromptDataset(files, tokenizer, processor=processor, **_options(data_cfg))
        return RLPromptDataset.from_config(data_cfg, tokenizer, files)
    cls = load_dataset_class(path, _optional_field(custom, "name"))
    log_rank0(logger, logging.INFO, "using custom dataset class %s from %s", cls.__name__, path)
    if processor is not None:
        return cls(data_files=files, tokenizer=tokenizer, config=data_cfg, processor=processor)
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
