"""The synthetic arithmetic task of the tiny demo (data_source ``"verl/arithmetic"``).

Task: the prompt asks for one integer, e.g. ``"What is 123+456?"``; the ground truth is the
integer as a string (``"579"``; negative results as ``"-12"``).

Answer format (the data generator writes SFT targets with ``format_arithmetic_answer``):
the response ends with a line ``Answer: <integer>``, e.g. ``"123+456 = 579\\nAnswer: 579"``.

Which number is judged, first match wins:

1. the number after the last ``Answer:`` (case-insensitive);
2. else the number after the last ``####`` (GSM8K style);
3. else the last integer anywhere in the response.

The first number after a marker counts (``Answer: 579 (since 123+456)`` reads 579); a marker
whose line holds no number is passed over. Thousands
separators are accepted (``1,234``). The score is 1.0 if that number equals the ground truth
exactly, else 0.0; a non-integer answer ("579.5") is wrong.
"""

from __future__ import annotations

from verl.rewards.extract import answer_after_marker, find_numbers, last_number, numbers_equal

DATA_SOURCE = "verl/arithmetic"
ANSWER_PREFIX = "Answer:"
# The instruction a prompt may append so a model knows the format.
ANSWER_INSTRUCTION = f'End with a line "{ANSWER_PREFIX} <integer>".'
_MARKERS = (ANSWER_PREFIX, "####")


def format_arithmetic_answer(value: int) -> str:
    """The canonical final line for ``value``: ``"Answer: 579"``."""
    return f"{ANSWER_PREFIX} {int(value)}"


def extract_answer(solution_str: object) -> str | None:
    """The number that is judged (rules in the module docstring), as written, or None."""
    for marker in _MARKERS:
        rest = answer_after_marker(solution_str, marker)
        if rest is not None:
            numbers = find_numbers(rest)
            if numbers:
                return numbers[0]
    return last_number(solution_str)


def compute_score(
    solution_str: object,
    ground_truth: object,
    extra_info: dict | None = None,
    *,
    score: float = 1.0,
) -> float:
    """``score`` if the judged number equals the integer ``ground_truth``, else 0.0."""
    answer = extract_answer(solution_str)
    if answer is None or "." in answer:
        return 0.0
    return float(score) if numbers_equal(answer, ground_truth) else 0.0
