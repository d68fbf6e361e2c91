"""The streaming safetensors reader/writer against the safetensors library itself."""

from __future__ import annotations

import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from verl.models.safetensors_io import SafetensorsReader, SafetensorsWriter, check_weight_files
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


@pytest.mark.parametrize(
    ("keep", "pattern"),
    [
        (0, r"0 bytes, shorter than the 8-byte header length"),
        (5, r"5 bytes, shorter than the 8-byte header length"),
        (40, r"its header length \d+ runs past the end of the 40-byte file"),
        (-100, r"truncated: tensor 'a' ends at byte 16384 of the data section but the file holds 16284 data bytes"),
    ],
)
def test_truncated_file_is_refused_at_open_naming_it(tmp_path, keep, pattern):
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.randn(64, 64)}, str(path))
    os.truncate(path, keep if keep >= 0 else os.path.getsize(path) + keep)
    for check in (SafetensorsReader, check_weight_files):
        with pytest.raises(ValueError, match=re.escape(str(path)) + r": .*" + pattern + ".*Copy the file again"):
            check(str(tmp_path))


def test_corrupt_header_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    body = b"[1, 2]"
    path.write_bytes(len(body).to_bytes(8, "little") + body)
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file \(the header is a list"):
        SafetensorsReader(str(tmp_path))
    path.write_bytes((4).to_bytes(8, "little") + b"\xff\xfe{}")
    with pytest.raises(ValueError, match=r"the header is not JSON"):
        SafetensorsReader(str(tmp_path))
    body = b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}'
    path.write_bytes(len(body).to_bytes(8, "little") + body)
    with pytest.raises(ValueError, match=r"tensor 'a' has no valid data_offsets"):
        SafetensorsReader(str(tmp_path))


def test_a_file_shrunk_after_opening_is_a_clear_error(tmp_path):
    save_file({"a": torch.randn(64, 64)}, str(tmp_path / "model.safetensors"))
    path = tmp_path / "model.safetensors"
    reader = SafetensorsReader(str(tmp_path))
    os.truncate(path, os.path.getsize(path) - 100)
    with pytest.raises(ValueError, match="ends early"):
        reader.read("a")
    reader.close()


def test_weight_checks_of_a_directory(tmp_path):
    with pytest.raises(ValueError, match=r"no model weights \(\*\.safetensors\) found"):
        check_weight_files(str(tmp_path))
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    check_weight_files(str(tmp_path))  # transformers reads .bin; only safetensors are checked here
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json is not valid JSON \(line 1"):
        check_weight_files(str(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match=r"index\.json: no 'weight_map' object"):
        check_weight_files(str(tmp_path))


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


@pytest.mark.parametrize("max_shard_bytes", [2048, 1 << 20], ids=["sharded", "one-file"])
def test_written_files_get_the_umask_mode_not_0600(tmp_path, max_shard_bytes):
    # safetensors writes through a private temporary (0600); an exported model must be readable
    # by whoever may read the config beside it (0666 less the umask).
    old = os.umask(0o022)
    try:
        writer = SafetensorsWriter(str(tmp_path), max_shard_bytes=max_shard_bytes)
        writer.add_all((f"t{i}", torch.full((256,), float(i))) for i in range(5))
        files = writer.finish()
    finally:
        os.umask(old)
    assert files
    for name in files:
        assert os.stat(tmp_path / name).st_mode & 0o777 == 0o644, name
