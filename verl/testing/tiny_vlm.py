"""The tiny Qwen2.5-VL of :mod:`verl.data.tiny_vlm`, built once per process for tests of several files."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

__all__ = ["cached_tiny_vlm"]

_CACHED: dict[int, str] = {}


def cached_tiny_vlm(seed: int = 0) -> str:
    """A tiny VLM directory (``make_tiny_vlm`` with a small tokenizer corpus), built on the first call
    in this process and removed at exit."""
    from verl.data.tiny_vlm import TinyVLMSpec, make_tiny_vlm

    if seed not in _CACHED:
        root = tempfile.mkdtemp(prefix="verl-tiny-vlm-")
        atexit.register(shutil.rmtree, root, True)
        _CACHED[seed] = make_tiny_vlm(os.path.join(root, "tiny-qwen2.5-vl"), TinyVLMSpec(corpus_lines=500, seed=seed))
    return _CACHED[seed]
