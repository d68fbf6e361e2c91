"""MATH (``problem``, ``solution`` with ``\\boxed{}``, ``level``, ``type``) to the verl format."""

from __future__ import annotations

from typing import Any

from verl.data.tasks.common import make_record, require

DATA_SOURCE = "lighteval/MATH"
INSTRUCTION = "Reason step by step and put the final answer in \\boxed{}."


def last_boxed_content(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with nested braces; None if absent."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start)
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def convert_row(row: dict[str, Any], *, index: int, split: str, path: str) -> dict[str, Any]:
    """One MATH row as a verl record; a solution without a closed box names the file and row."""
    problem = require(row, "problem", path=path, index=index)
    solution = require(row, "solution", path=path, index=index)
    answer = last_boxed_content(solution)
    if answer is None:
        raise ValueError(f"{path}: row {index} field 'solution' has no closed \\boxed{{...}} answer")
    return make_record(
        data_source=DATA_SOURCE,
        prompt=f"{problem} {INSTRUCTION}",
        ground_truth=answer,
        extra_info={
            "split": split,
            "index": index,
            "question": problem,
            "answer": solution,
            "level": row.get("level"),
            "type": row.get("type"),
        },
    )
