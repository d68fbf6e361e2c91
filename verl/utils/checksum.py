"""Content checksums of files: XXH3-128 of each whole file, streamed in chunks, in parallel.

- Within a process, files hash on a thread pool: xxhash's ``update`` and file reads release
  the GIL, so threads hash concurrently.
- With torch.distributed initialised, :func:`checksum_files` is collective: the files are
  split over the ranks (largest first, to the least loaded rank; the same split on every
  rank), each rank hashes its share, and the results are all-gathered, so every rank returns
  the same complete answer (and a failure to read one file is reported, not raised, so no
  rank is left waiting in the gather).

Why XXH3-128: it guards against corruption (bit rot, a truncated or overwritten copy), not
against tampering, and it is fast enough that verifying a checkpoint costs little next to
loading it. Measured on a development machine (2 cores shared with other work, best of 3-5):
in memory, xxh3_128 9.4 GB/s per thread against blake2b 0.8 GB/s; ``checksum_files`` on 8
files of 128 MiB in the page cache 9.5 GB/s with 1 thread and 15.4 GB/s with 2, while
``torch.load`` of the same files took 0.74 s (1.45 GB/s): verifying adds about a tenth.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import xxhash

__all__ = ["ALGORITHM", "FileDigest", "checksum_files", "file_checksum"]

ALGORITHM = "xxh3_128"
"""Name of the hash, as recorded next to the digests (hex, 32 characters)."""

_CHUNK_BYTES = 8 << 20
_MAX_THREADS = 8


@dataclass(frozen=True)
class FileDigest:
    """One file's size and checksum, or why it could not be read."""

    size: int
    """Bytes read (-1 when the file could not be read)."""
    digest: str | None
    """Hex XXH3-128 of the whole file; None when it could not be read."""
    error: str | None = None
    """The OSError text when the file could not be read."""


def file_checksum(path: str) -> FileDigest:
    """XXH3-128 of the file at ``path``, read in 8 MiB chunks (never raises OSError: see ``error``)."""
    hasher = xxhash.xxh3_128()
    buf = bytearray(_CHUNK_BYTES)
    view = memoryview(buf)
    size = 0
    try:
        with open(path, "rb", buffering=0) as f:
            while True:
                n = f.readinto(buf)
                if not n:
                    break
                hasher.update(view[:n])
                size += n
    except OSError as exc:
        return FileDigest(size=-1, digest=None, error=f"{type(exc).__name__}: {exc.strerror or exc}")
    return FileDigest(size=size, digest=hasher.hexdigest())


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _split(root: str, rels: Sequence[str], world: int) -> list[list[str]]:
    """Files per rank, balanced by size: largest first, each to the least loaded rank."""
    sizes = {}
    for rel in rels:
        try:
            sizes[rel] = os.path.getsize(os.path.join(root, rel))
        except OSError:
            sizes[rel] = 0
    loads = [0] * world
    shares: list[list[str]] = [[] for _ in range(world)]
    for rel in sorted(rels, key=lambda r: (-sizes[r], r)):
        rank = min(range(world), key=lambda r: (loads[r], r))
        shares[rank].append(rel)
        loads[rank] += sizes[rel]
    return shares


def checksum_files(
    root: str,
    rels: Sequence[str],
    *,
    threads: int | None = None,
    distributed: bool = True,
) -> dict[str, FileDigest]:
    """``{rel: FileDigest}`` for each path ``rel`` relative to ``root``.

    Collective over the default group when torch.distributed is initialised and
    ``distributed`` is True: every rank must call it with the same ``rels`` and gets the same
    result. ``threads``: hashing threads on this rank (default: up to 8, at most the CPU count).
    """
    rels = list(rels)
    dist = _dist() if distributed else None
    world = dist.get_world_size() if dist is not None else 1
    mine = _split(root, rels, world)[dist.get_rank()] if world > 1 else rels
    workers = max(1, min(threads or min(_MAX_THREADS, os.cpu_count() or 1), len(mine) or 1))
    if workers == 1:
        local = {rel: file_checksum(os.path.join(root, rel)) for rel in mine}
    else:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="checksum") as pool:
            digests = pool.map(lambda rel: file_checksum(os.path.join(root, rel)), mine)
            local = dict(zip(mine, digests, strict=True))
    if world == 1:
        return local
    gathered: list[dict[str, FileDigest] | None] = [None] * world
    dist.all_gather_object(gathered, local)
    out: dict[str, FileDigest] = {}
    for part in gathered:
        out.update(part or {})
    return {rel: out[rel] for rel in rels}
