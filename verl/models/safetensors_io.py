"""Streaming reads and writes of Hugging Face safetensors checkpoints.

Reads go through ``safe_open(...).get_slice``, so a caller that needs one tensor-parallel
shard of a tensor reads only those bytes. Writes buffer at most one output file
(``max_shard_bytes``) before flushing it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from verl.models.weight_mapping import HFPiece

logger = logging.getLogger(__name__)

# Files that travel with a model besides its weights: config, tokenizer, generation defaults.
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


def copy_side_files(src_dir: str, dst_dir: str, *, include_config: bool = True) -> list[str]:
    """Copy config/tokenizer/generation files present in ``src_dir``; returns the names copied."""
    copied = []
    for name in SIDE_FILES:
        if name == "config.json" and not include_config:
            continue
        src = os.path.join(src_dir, name)
        if os.path.isfile(src):
            shutil.copy2(src, os.path.join(dst_dir, name))
            copied.append(name)
    return copied


class SafetensorsReader:
    """Lazy, slice-level access to the tensors of a Hugging Face safetensors checkpoint dir."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        index_path = os.path.join(model_dir, "model.safetensors.index.json")
        self._file_of: dict[str, str] = {}
        if os.path.isfile(index_path):
            with open(index_path, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            missing = sorted({fn for fn in weight_map.values() if not os.path.isfile(os.path.join(model_dir, fn))})
            if missing:
                raise ValueError(
                    f"{index_path} lists files that are not in {model_dir}: {', '.join(missing)} "
                    "(a partial download or copy?); restore them."
                )
            self._file_of = {name: os.path.join(model_dir, fn) for name, fn in weight_map.items()}
        else:
            files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
            if not files:
                other = [f for f in os.listdir(model_dir) if f.endswith((".bin", ".pt", ".pth"))]
                hint = (
                    f" It has {', '.join(other)}: re-save the model with save_pretrained(safe_serialization=True)."
                    if other
                    else ""
                )
                raise ValueError(f"{model_dir}: no *.safetensors weights found.{hint}")
            for fn in files:
                path = os.path.join(model_dir, fn)
                with safe_open(path, framework="pt") as f:
                    for name in f.keys():
                        self._file_of[name] = path
        self._handles: dict[str, object] = {}

    def _handle(self, path: str):
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt")
        return self._handles[path]

    def names(self) -> list[str]:
        """All tensor names in the checkpoint."""
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor ``name`` without reading it."""
        return tuple(self._handle(self._path(name)).get_slice(name).get_shape())

    def _path(self, name: str) -> str:
        if name not in self._file_of:
            raise ValueError(
                f"{self.model_dir}: tensor '{name}' is missing from the checkpoint (a partial copy, or a "
                "config.json that does not match the weights)."
            )
        return self._file_of[name]

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor ``name``."""
        return self._handle(self._path(name)).get_tensor(name)

    def read_piece(self, piece: HFPiece) -> torch.Tensor:
        """Only the rows/columns of ``piece``, checking the stored shape against the config."""
        sl = self._handle(self._path(piece.name)).get_slice(piece.name)
        shape = tuple(sl.get_shape())
        if shape != piece.full_shape:
            raise ValueError(
                f"{self.model_dir}: tensor '{piece.name}' has shape {shape} but config.json implies "
                f"{piece.full_shape}; the weights do not belong to this config."
            )
        index = [slice(None)] * len(shape)
        index[piece.dim] = slice(piece.start, piece.stop)
        return sl[tuple(index)]

    def close(self) -> None:
        """Drop open file handles."""
        self._handles.clear()


class SafetensorsWriter:
    """Writes (name, tensor) pairs into size-capped safetensors files plus an index.

    Files are written as ``model-XXXXX.safetensors`` while streaming and renamed to the
    Hugging Face ``model-XXXXX-of-YYYYY.safetensors`` scheme (or ``model.safetensors`` when
    there is only one) by :meth:`finish`.
    """

    def __init__(self, out_dir: str, *, max_shard_bytes: int = 2 * 1024**3) -> None:
        self.out_dir = out_dir
        self.max_shard_bytes = max_shard_bytes
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._files: list[tuple[str, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one tensor; flushes a file when the size cap would be exceeded."""
        if name in self._buffer or any(name in names for _, names in self._files):
            raise ValueError(f"tensor '{name}' written twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffer_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        # clone: safetensors needs contiguous, unshared storage.
        self._buffer[name] = tensor.detach().to("cpu").contiguous().clone()
        self._buffer_bytes += nbytes
        self.total_bytes += nbytes

    def add_all(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Queue every pair of ``items``."""
        for name, tensor in items:
            self.add(name, tensor)

    def _flush(self) -> None:
        if not self._buffer:
            return
        fn = f"model-{len(self._files) + 1:05d}.safetensors"
        save_file(self._buffer, os.path.join(self.out_dir, fn), metadata={"format": "pt"})
        self._files.append((fn, list(self._buffer)))
        self._buffer = {}
        self._buffer_bytes = 0

    def finish(self) -> list[str]:
        """Flush, give files their final names, write the index; returns the file names."""
        self._flush()
        n = len(self._files)
        if n == 1:
            os.replace(os.path.join(self.out_dir, self._files[0][0]), os.path.join(self.out_dir, "model.safetensors"))
            return ["model.safetensors"]
        weight_map = {}
        final = []
        for i, (fn, names) in enumerate(self._files):
            new = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.out_dir, fn), os.path.join(self.out_dir, new))
            final.append(new)
            weight_map.update({name: new for name in names})
        with open(os.path.join(self.out_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, f, indent=2)
        return final
