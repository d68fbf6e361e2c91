"""GSM8K (``question``, ``answer`` ending in ``#### N``) to the verl format."""

from __future__ import annotations

import re
from typing import Any

from verl.data.tasks.common import make_record, require

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Solve it step by step, then write the final number after "####".'
_FINAL_RE = re.compile(r"####\s*(-?[0-9.,]+)")


def extract_final_answer(answer: str) -> str | None:
    """The number after the last ``####`` in a GSM8K solution, commas removed; None if absent."""
    matches = _FINAL_RE.findall(answer)
    if not matches:
        return None
    return matches[-1].replace(",", "").rstrip(".")


def convert_row(row: dict[str, Any], *, index: int, split: str, path: str) -> dict[str, Any]:
    """One GSM8K row as a verl record; a missing ``####`` answer names the file and row."""
    question = require(row, "question", path=path, index=index)
    answer = require(row, "answer", path=path, index=index)
    final = extract_final_answer(answer)
    if final is None:
        raise ValueError(f"{path}: row {index} field 'answer' has no final '#### <number>' line")
    return make_record(
        data_source=DATA_SOURCE,
        prompt=f"{question} {INSTRUCTION}",
        ground_truth=final,
        extra_info={"split": split, "index": index, "question": question, "answer": answer},
    )
