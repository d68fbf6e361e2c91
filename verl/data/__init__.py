"""Datasets (RL prompts, SFT, preference pairs), file reading, tokenizers and task converters."""

from verl.data.io import TableStore, detect_format, open_source, read_records, write_parquet
from verl.data.preference_dataset import PreferenceDataset
from verl.data.rl_dataset import (
    RLPromptDataset,
    build_dataloader,
    collate_fn,
    create_rl_dataset,
    load_dataset_class,
)
from verl.data.sampler import ResumableSampler, StatefulDataLoader
from verl.data.sft_dataset import SFTDataset, encode_messages, encode_prompt_response
from verl.data.tokenizer import ensure_pad_token, load_tokenizer

__all__ = [
    "PreferenceDataset",
    "RLPromptDataset",
    "ResumableSampler",
    "SFTDataset",
    "StatefulDataLoader",
    "TableStore",
    "build_dataloader",
    "collate_fn",
    "create_rl_dataset",
    "detect_format",
    "encode_messages",
    "encode_prompt_response",
    "ensure_pad_token",
    "load_dataset_class",
    "load_tokenizer",
    "open_source",
    "read_records",
    "write_parquet",
]
