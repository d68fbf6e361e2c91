"""Format reward: does the whole response follow a required layout?

The default layout is the R1 one, ``<think>reasoning</think><answer>final answer</answer>``
with only whitespace around and between the two blocks, each tag exactly once. Any regex
can be given instead; it must match the *whole* response (``re.fullmatch``), and is compiled
once per (pattern, flags).
"""

from __future__ import annotations

import functools
import re

from verl.rewards.extract import as_text

# Inside a block, any text that does not open or close a think/answer tag (a tempered token:
# linear time, and "<answer>a</answer><answer>b</answer>" does not pass as one block).
_NO_TAG = r"(?:(?!</?(?:think|answer)>).)*"
THINK_ANSWER_PATTERN = r"\s*<think>" + _NO_TAG + r"</think>\s*<answer>" + _NO_TAG + r"</answer>\s*"


@functools.lru_cache(maxsize=64)
def _compile(pattern: str, flags: int) -> re.Pattern:
    try:
        return re.compile(pattern, flags)
    except re.error as exc:
        raise ValueError(f"format_reward pattern {pattern!r} is not a valid regex: {exc}") from exc


def format_reward(
    solution_str: object,
    pattern: str = THINK_ANSWER_PATTERN,
    *,
    score: float = 1.0,
    flags: int = re.DOTALL,
) -> float:
    """``score`` if ``pattern`` matches the whole response, else 0.0."""
    return float(score) if _compile(pattern, flags).fullmatch(as_text(solution_str)) else 0.0
