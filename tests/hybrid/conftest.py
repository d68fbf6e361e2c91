"""Tiny models of the memory-handoff tests (made once per session, in a temp dir)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny Qwen2 (hidden 64, 2 layers, 2 heads of 32, 2 KV heads: TP=2 splits them, and the CPU
    vLLM build runs it)."""
    from verl.data.tiny_model import TinyModelSpec, make_tiny_model

    out = tmp_path_factory.mktemp("tiny-qwen2")
    return make_tiny_model(str(out), TinyModelSpec(family="qwen2", kv_heads=2, corpus_lines=600, seed=1))


@pytest.fixture(scope="session")
def large_model_dir(tmp_path_factory) -> str:
    """A Qwen2 of 8.9M parameters (hidden 512, 2 layers, MLP 2048): ~36 MB of float32 weights, so
    its training state (weights, gradients, Adam's two moments: ~143 MB) stands out of RSS noise."""
    from verl.data.tiny_model import TinyModelSpec, make_tiny_model

    out = tmp_path_factory.mktemp("large-qwen2")
    spec = TinyModelSpec(family="qwen2", hidden=512, heads=16, kv_heads=2, corpus_lines=600, seed=2)
    return make_tiny_model(str(out), spec)
