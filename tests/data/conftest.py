"""Shared fixtures: one tiny model + tokenizer made by the project's own tool, per session."""

from __future__ import annotations

import pytest

from verl.data.tiny_model import TinyModelSpec, make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny llama (hidden 64, 2 layers) with a trained tokenizer; ~4 s to make."""
    out = tmp_path_factory.mktemp("tiny-llama")
    return make_tiny_model(str(out), TinyModelSpec(family="llama", corpus_lines=1500))


@pytest.fixture()
def tokenizer(tiny_model_dir):
    """A fresh tokenizer per test (tests may change its pad token or template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)
