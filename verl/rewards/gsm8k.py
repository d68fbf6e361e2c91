"""GSM8K: grade-school word problems whose answer is one number, written after ``####``.

Ground truths are the number after ``####`` in the dataset's solution ("72", "1,080",
"-3", "0.5"). Two extraction methods, as in the reference verl:

- ``strict``: the number right after the last ``####`` marker that has one (as the
  reference, which also takes the last). A currency sign, thousands separators and no space
  are allowed: ``####$1,080``; the reference needs exactly ``"#### "`` and a number.
- ``flexible``: the last number anywhere in the response.

Answers are compared as exact decimals, so "72.00" equals "72" (the reference compares
strings after removing ",", and counts "72.00" wrong); the whole response is read (the
reference reads only its last 300 characters). A malformed group such as "10,00" is not
1000 here (the reference drops every comma). ``rule_scoring=reference`` scores as the
reference does (``verl.rewards.reference``).
"""

from __future__ import annotations

import re

from verl.rewards.extract import NUMBER_PATTERN, as_text, last_number, normalize_minus, numbers_equal

METHODS = ("strict", "flexible")

_STRICT_RE = re.compile(r"####\s*\$?\s*(" + NUMBER_PATTERN + r")")


def extract_solution(solution_str: object, method: str = "strict") -> str | None:
    """The final answer of a GSM8K response by ``method`` ("strict" or "flexible"), or None."""
    if method not in METHODS:
        raise ValueError(f"gsm8k method={method!r} is not one of {METHODS}")
    text = normalize_minus(as_text(solution_str))
    if method == "flexible":
        return last_number(text)
    found = _STRICT_RE.findall(text)
    return found[-1] if found else None


def compute_score(
    solution_str: object,
    ground_truth: object,
    extra_info: dict | None = None,
    *,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """``score`` if the extracted answer equals ``ground_truth``, ``format_score`` if an answer
    was found but is wrong, 0.0 if none was found."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    return float(score) if numbers_equal(answer, ground_truth) else float(format_score)
