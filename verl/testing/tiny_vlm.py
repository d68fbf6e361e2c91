"""The tiny Qwen2.5-VL (or Qwen3-VL) of :mod:`verl.data.tiny_vlm`, built once per process for tests of several files."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

__all__ = ["cached_tiny_vlm"]

_CACHED: dict[tuple[int, str], str] = {}


def cached_tiny_vlm(seed: int = 0, family: str = "qwen2_5_vl") -> str:
    """A tiny VLM directory (``make_tiny_vlm`` with a small tokenizer corpus; ``family`` qwen2_5_vl or qwen3_vl),
    built on the first call in this process and removed at exit."""
    from verl.data.tiny_vlm import TinyVLMSpec, make_tiny_vlm

    if (seed, family) not in _CACHED:
        root = tempfile.mkdtemp(prefix="verl-tiny-vlm-")
        atexit.register(shutil.rmtree, root, True)
        name = "tiny-qwen2.5-vl" if family == "qwen2_5_vl" else f"tiny-{family.replace('_', '-')}"
        _CACHED[seed, family] = make_tiny_vlm(
            os.path.join(root, name), TinyVLMSpec(corpus_lines=500, seed=seed, family=family)
        )
    return _CACHED[seed, family]
