"""Shared helpers for the reward tests: a character tokenizer and rollout batches made from text."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from verl.protocol import Batch

PAD_ID = 0
EOS_ID = 1  # a special token: dropped when decoding with skip_special_tokens=True


class CharTokenizer:
    """Token id = Unicode code point + 2 (0 is padding, 1 is end-of-sequence)."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) + 2 for c in text]

    def batch_decode(self, ids: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        out = []
        for row in ids:
            chars = []
            for i in row:
                if i in (PAD_ID, EOS_ID):
                    if not skip_special_tokens:
                        chars.append("<pad>" if i == PAD_ID else "<eos>")
                    continue
                chars.append(chr(i - 2))
            out.append("".join(chars))
        return out


@pytest.fixture
def tokenizer() -> CharTokenizer:
    return CharTokenizer()


def make_batch(
    texts: Sequence[str],
    data_sources: Sequence[str],
    ground_truths: Sequence[Any],
    *,
    length: int | None = None,
    eos: bool = True,
    extra_infos: Sequence[Any] | None = None,
) -> Batch:
    """A right-padded rollout batch: responses [B, T] and response_mask [B, T] (EOS counted valid)."""
    tok = CharTokenizer()
    rows = [tok.encode(t) + ([EOS_ID] if eos else []) for t in texts]
    T = length if length is not None else max([len(r) for r in rows] + [1])
    responses = torch.full((len(rows), T), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for i, r in enumerate(rows):
        r = r[:T]
        responses[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    non_tensors: dict[str, Any] = {
        "data_source": list(data_sources),
        "reward_model": [{"style": "rule", "ground_truth": gt} for gt in ground_truths],
    }
    if extra_infos is not None:
        non_tensors["extra_info"] = list(extra_infos)
    return Batch(tensors={"responses": responses, "response_mask": mask}, non_tensors=non_tensors)
