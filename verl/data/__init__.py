"""Datasets (RL prompts, SFT, preference pairs), file reading, tokenizers and task converters.

Names are imported on first use, so the preprocessing tools (which need only pyarrow) start
without importing torch.
"""

import importlib
from typing import Any

_LAZY = {
    "FrameSource": "verl.data.io",
    "TableStore": "verl.data.io",
    "detect_format": "verl.data.io",
    "open_source": "verl.data.io",
    "read_records": "verl.data.io",
    "write_parquet": "verl.data.io",
    "PreferenceDataset": "verl.data.preference_dataset",
    "RLHFDataset": "verl.data.rl_dataset",
    "RLPromptDataset": "verl.data.rl_dataset",
    "build_dataloader": "verl.data.rl_dataset",
    "collate_fn": "verl.data.rl_dataset",
    "create_rl_dataset": "verl.data.rl_dataset",
    "load_dataset_class": "verl.data.rl_dataset",
    "ResumableSampler": "verl.data.sampler",
    "StatefulDataLoader": "verl.data.sampler",
    "SFTDataset": "verl.data.sft_dataset",
    "encode_messages": "verl.data.sft_dataset",
    "encode_prompt_response": "verl.data.sft_dataset",
    "ensure_pad_token": "verl.data.tokenizer",
    "load_tokenizer": "verl.data.tokenizer",
    "TinyModelSpec": "verl.data.tiny_model",
    "make_tiny_model": "verl.data.tiny_model",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'verl.data' has no attribute {name!r}")
