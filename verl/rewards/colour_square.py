"""The synthetic visual task of the vision-language demo (data_source ``"verl/colour_square"``).

Task: an image shows one coloured square on a grey background; the prompt asks which of a few
colours it is; the ground truth is the colour's name (``"red"``). The response's first word
(letters only, any case) is judged: 1.0 when it is the ground truth, else 0.0. The control set
(``"verl/colour_square_blank"``: the same prompts with the square left out of the image) is
scored the same way, so a model that reads the image scores at chance there.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

DATA_SOURCE = "verl/colour_square"
BLANK_DATA_SOURCE = "verl/colour_square_blank"

_WORD = re.compile(r"[A-Za-z]+")


def first_word(solution_str: object) -> str | None:
    """The response's first run of letters, lower-cased, or None."""
    if not isinstance(solution_str, str):
        return None
    match = _WORD.search(solution_str)
    return match.group(0).lower() if match else None


def compute_score(solution_str: object, ground_truth: object, extra_info: Mapping[str, Any] | None = None) -> float:
    """1.0 when the response's first word is ``ground_truth`` (case-insensitive), else 0.0."""
    return 1.0 if first_word(solution_str) == str(ground_truth).strip().lower() else 0.0
