"""Shared fixtures of the serving tests: one tiny model per session (the trainer tests' recipe, a
smaller tokenizer corpus)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny Qwen2 (hidden 64, 2 layers) with a ChatML chat template, made by the project's tool."""
    from verl.data.tiny_model import TinyModelSpec, make_tiny_model

    out = tmp_path_factory.mktemp("tiny-qwen2-serving")
    return make_tiny_model(str(out), TinyModelSpec(family="qwen2", kv_heads=2, corpus_lines=600))
