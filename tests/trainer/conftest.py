"""Shared fixtures of the trainer tests: one tiny model and small arithmetic data files per session."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _environment_kept_per_test():
    """An entry point run in-process (``main_ppo.main``) sets process-wide defaults
    (``verl.trainer.startup.prepare_run``: TQDM_DISABLE, VLLM_CONFIGURE_LOGGING, ...): they end with its test."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny Qwen2 made by the project's tool.

    Hidden 64, 2 layers, 2 heads of 32, 2 KV heads (so TP=2 splits them), q/k/v bias.
    """
    from verl.data.tiny_model import TinyModelSpec, make_tiny_model

    out = tmp_path_factory.mktemp("tiny-qwen2")
    return make_tiny_model(str(out), TinyModelSpec(family="qwen2", kv_heads=2, corpus_lines=1500))


@pytest.fixture(scope="session")
def arithmetic_files(tmp_path_factory) -> dict[str, str]:
    """1-digit addition: ``train`` (4000 rows drawn from the 100-problem table), ``val`` (its first 64)."""
    from verl.data.io import write_parquet
    from verl.data.tasks import arithmetic

    out = tmp_path_factory.mktemp("arith")
    train, _ = arithmetic.generate_splits(train=4000, val=0, digits=1, seed=0)
    write_parquet(train, str(out / "train.parquet"))
    write_parquet(train[:64], str(out / "val.parquet"))
    return {"train": str(out / "train.parquet"), "val": str(out / "val.parquet")}


@pytest.fixture(scope="session")
def reward_model_dir(tiny_model_dir, tmp_path_factory) -> str:
    """A reward model on the policy's tokenizer: the tiny Qwen2's body with a score head."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    out = str(tmp_path_factory.mktemp("reward-model"))
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.num_labels = 1
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(out)
    for name in os.listdir(tiny_model_dir):
        if name.startswith("tokenizer") or name in ("special_tokens_map.json", "vocab.json", "merges.txt"):
            shutil.copy(os.path.join(tiny_model_dir, name), out)
    return out
