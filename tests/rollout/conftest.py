"""Tiny local models for the rollout tests (made once per session, in a temp dir)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """{"qwen2": dir, "llama": dir}: Qwen2 with tied embeddings, Llama untied (vLLM-CPU compatible shapes)."""
    from verl.data.tiny_model import TinyModelSpec, make_tiny_model

    root = tmp_path_factory.mktemp("rollout-models")
    # A smaller tokenizer corpus than the default keeps this fixture at a few seconds.
    qwen2 = TinyModelSpec(family="qwen2", tie_embeddings=True, corpus_lines=600, seed=1)
    llama = TinyModelSpec(family="llama", corpus_lines=600, seed=2)
    return {
        "qwen2": make_tiny_model(str(root / "qwen2"), qwen2),
        "llama": make_tiny_model(str(root / "llama"), llama),
    }


@pytest.fixture
def interrupt_generate(monkeypatch):
    """``interrupt_generate(engine, prompts)``: a vLLM generate interrupted after one engine step."""

    def interrupt(engine, prompts) -> None:
        llm = engine._llm

        def one_step_then_fail(**kwargs):
            llm.llm_engine.step()
            raise KeyboardInterrupt

        with monkeypatch.context() as patched:
            patched.setattr(llm, "wait_for_completion", one_step_then_fail)
            with pytest.raises(KeyboardInterrupt):
                engine.generate(prompts)

    return interrupt


@pytest.fixture(scope="module")
def one_thread():
    """Engines run with one torch thread: on a shared 2-core machine more threads spin and crawl."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
