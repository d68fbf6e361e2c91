"""verl.utils.checksum: whole-file XXH3-128 in chunks, threads, the split over ranks."""

from __future__ import annotations

import os

import pytest
import xxhash

import verl.utils.checksum as checksum
from verl.utils.checksum import checksum_files, file_checksum


@pytest.mark.parametrize("size", [0, 1, 15, 16, 17, 33, 64])
def test_chunked_digest_equals_the_digest_of_the_whole_file(tmp_path, monkeypatch, size):
    # 16-byte chunks: sizes on both sides of a chunk boundary and several chunks.
    monkeypatch.setattr(checksum, "_CHUNK_BYTES", 16)
    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    got = file_checksum(str(tmp_path / "f"))
    assert (got.size, got.digest, got.error) == (size, xxhash.xxh3_128(data).hexdigest(), None)


def test_unreadable_file_is_reported_not_raised(tmp_path):
    got = file_checksum(str(tmp_path / "missing"))
    assert got.digest is None and got.size == -1 and "FileNotFoundError" in got.error


def test_threads_give_the_same_answer_in_the_same_order(tmp_path):
    rels = []
    for i in range(23):
        rel = os.path.join(f"d{i % 3}", f"f{i}")
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_bytes(os.urandom(i * 101))
        rels.append(rel)
    rels.append("missing")
    one = checksum_files(str(tmp_path), rels, threads=1)
    many = checksum_files(str(tmp_path), rels, threads=4)
    assert list(one) == list(many) == rels and one == many
    assert one["missing"].digest is None


def test_split_over_ranks_is_complete_disjoint_and_balanced(tmp_path):
    sizes = [900, 10, 500, 400, 300, 200, 100, 0]
    rels = [f"f{i}" for i in range(len(sizes))]
    for rel, size in zip(rels, sizes):
        (tmp_path / rel).write_bytes(b"x" * size)
    shares = checksum._split(str(tmp_path), rels + ["missing"], 3)
    flat = sorted(r for share in shares for r in share)
    assert flat == sorted(rels + ["missing"])
    loads = [sum(os.path.getsize(tmp_path / r) for r in share if r != "missing") for share in shares]
    # Largest first, each to the least loaded rank (ties to the lower rank), by hand:
    # 900 | 500 | 400, then 300 -> rank 2, 200 -> 1, 100 -> 1, 10 -> 2, 0s -> 2.
    assert loads == [900, 800, 710]
    assert checksum._split(str(tmp_path), list(reversed(rels)), 3) == checksum._split(str(tmp_path), rels, 3)
