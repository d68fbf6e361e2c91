"""The streaming safetensors reader/writer against the safetensors library itself."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from verl.models.safetensors_io import SafetensorsReader, SafetensorsWriter
from verl.models.weight_mapping import HFPiece


def test_reader_slices_match_safetensors(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(7, 5, generator=gen),
        "b": torch.randn(6, 4, generator=gen).to(torch.bfloat16),
        "c": torch.randn(9, generator=gen).half(),
        "d": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    reader = SafetensorsReader(str(tmp_path))
    assert set(reader.names()) == set(tensors)
    for name, expected in tensors.items():
        assert torch.equal(reader.read(name), expected)
    rows = HFPiece(name="a", full_shape=(7, 5), dim=0, start=2, stop=6)
    cols = HFPiece(name="b", full_shape=(6, 4), dim=1, start=1, stop=3)
    assert torch.equal(reader.read_piece(rows), tensors["a"][2:6])
    assert torch.equal(reader.read_piece(cols), tensors["b"][:, 1:3])
    with pytest.raises(ValueError, match="implies"):
        reader.read_piece(HFPiece(name="a", full_shape=(7, 6), dim=0, start=0, stop=1))
    with pytest.raises(ValueError, match="missing from the checkpoint"):
        reader.read("nope")
    reader.close()


def test_truncated_file_is_a_clear_error(tmp_path):
    save_file({"a": torch.randn(64, 64)}, str(tmp_path / "model.safetensors"))
    path = tmp_path / "model.safetensors"
    os.truncate(path, os.path.getsize(path) - 100)
    with pytest.raises(ValueError, match="ends early"):
        SafetensorsReader(str(tmp_path)).read("a")


def test_writer_shards_and_indexes(tmp_path):
    tensors = {f"t{i}": torch.full((256,), float(i)) for i in range(5)}  # 1 KiB each
    writer = SafetensorsWriter(str(tmp_path), max_shard_bytes=2048)
    writer.add_all(tensors.items())
    files = writer.finish()
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    loaded = {}
    for fn in files:
        loaded.update(load_file(str(tmp_path / fn)))
    assert set(loaded) == set(tensors) and all(torch.equal(loaded[k], v) for k, v in tensors.items())
    assert torch.equal(SafetensorsReader(str(tmp_path)).read("t3"), tensors["t3"])
