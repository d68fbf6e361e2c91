"""MATH-style answers: ``\\boxed{}`` extraction and answer equivalence.

Equivalence (``math_equal``) is decided in two stages:

1. ``normalize_math_answer`` turns both answers into a canonical string (below); equal
   strings are equivalent. Cheap, and catches most matches.
2. Otherwise the math-verify package parses both into sympy and compares them symbolically
   (``\\sqrt{2}/2`` vs ``\\frac{1}{\\sqrt{2}}``, sets in any order, ``x=3`` vs ``3``), under a
   wall-clock limit (``verl.rewards.timeout``). If math-verify is missing, raises, or runs out
   of time, the answer counts as *not* equivalent and the normaliser's verdict stands.

The normaliser (documented here because a reward depends on it):

- unwrap an answer that is all one ``\\boxed{..}``/``\\fbox{..}``; drop ``$``, ``\\(``, ``\\)``, ``\\[``, ``\\]``, line breaks;
- drop spacing commands (``\\!``, ``\\,``, ``\\;``, ``\\:``, ``\\quad``, ``~``, ``\\ ``) and
  ``\\displaystyle``, ``\\left``/``\\right``;
- ``\\dfrac``/``\\tfrac`` -> ``\\frac``; ``\\frac12`` -> ``\\frac{1}{2}``; ``\\sqrt2`` -> ``\\sqrt{2}``;
- drop degree signs (``^\\circ``, ``^{\\circ}``, ``°``), percent signs and ``\\$``;
- a trailing ``\\text{..}`` (or ``\\mbox``, ``\\mathrm``) after an expression is a unit and is
  dropped (``5\\text{ cm}`` -> ``5``); a ``\\text{..}`` that is the whole answer is unwrapped;
- a leading ``x =`` (a short variable name and a single "=") is dropped;
- answers longer than ``MAX_ANSWER_CHARS`` are only stripped of whitespace (and math-verify
  does not see them);
- all whitespace and a trailing period are dropped; ``1{,}000`` and ``1,000`` -> ``1000``;
- a plain number, ``a/b`` or ``\\frac{a}{b}`` with integer parts becomes a reduced fraction
  ``p/q`` (or ``p``), so ``0.5``, ``.5``, ``1/2``, ``\\dfrac{1}{2}`` all read ``1/2``.
"""

from __future__ import annotations

import functools
import logging
import re
from fractions import Fraction

from verl.rewards import reference
from verl.rewards.extract import as_text, last_boxed, normalize_minus, whole_box
from verl.rewards.timeout import time_limit
from verl.utils.logging import warn_once

logger = logging.getLogger(__name__)

# Default limit for one math-verify comparison (its own default is 5 s).
DEFAULT_MATH_VERIFY_TIMEOUT_S = 5.0

# Longer answers are only stripped of whitespace and never handed to math-verify: real final
# answers are short, and this bounds the work on a pathological one (math-verify needs
# seconds for a 100 kB answer).
MAX_ANSWER_CHARS = 1000

_SPACING_RE = re.compile(r"\\[!,;:]|\\q?quad(?![A-Za-z])|~|\\ ")
_LEFT_RIGHT_RE = re.compile(r"\\(?:left|right)(?![A-Za-z])|\\displaystyle(?![A-Za-z])")
_FRAC_CMD_RE = re.compile(r"\\[dt]frac(?![A-Za-z])")
# \frac12, \frac1{2}, \frac{1}2  ->  \frac{1}{2}   (single-character arguments without braces)
_FRAC_SHORT_RE = re.compile(r"\\frac\s*(\{[^{}]*\}|[0-9A-Za-z])\s*(\{[^{}]*\}|[0-9A-Za-z])")
_SQRT_SHORT_RE = re.compile(r"\\sqrt\s*([0-9A-Za-z])")
_DEGREE_RE = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ(?![A-Za-z])|\\circ(?![A-Za-z])|°|\\degree(?![A-Za-z])")
_TEXT_CMD = r"\\(?:text|textbf|textit|mbox|mathrm|mathbf|operatorname)\s*"
_TRAILING_UNIT_RE = re.compile(r"^(.*?[^\s])\s*" + _TEXT_CMD + r"\{[^{}]*\}\s*$", re.DOTALL)
_TEXT_RE = re.compile(_TEXT_CMD + r"\{([^{}]*)\}")
_LEADING_VAR_RE = re.compile(r"^\s*[A-Za-z][A-Za-z0-9_]{0,2}\s*=\s*(?=\S)")
_THOUSANDS_RE = re.compile(r"^-?[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?$")
_DECIMAL_RE = re.compile(r"^-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)$")
_SLASH_FRAC_RE = re.compile(r"^(-?[0-9]+)/([0-9]+)$")
_BOX_FRAME_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_TEX_FRAC_RE = re.compile(r"^(-?)\\frac\{(-?[0-9]+)\}\{(-?[0-9]+)\}$")


def _canonical_number(s: str) -> str | None:
    """``s`` as a reduced fraction "p/q" or integer "p" when it is a plain number; else None."""
    try:
        if _DECIMAL_RE.match(s):
            value = Fraction(s)
        elif m := _SLASH_FRAC_RE.match(s):
            value = Fraction(int(m.group(1)), int(m.group(2)))
        elif m := _TEX_FRAC_RE.match(s):
            value = Fraction(int(m.group(2)), int(m.group(3)))
            value = -value if m.group(1) else value
        else:
            return None
    except (ValueError, ZeroDivisionError):  # "1/0", or more digits than int() accepts
        return None
    return str(value)


def normalize_math_answer(answer: object) -> str:
    """A canonical string for a final math answer (rules in the module docstring); never raises."""
    s = normalize_minus(as_text(answer))
    if whole_box(s) is not None:  # "\boxed{5}" is 5; "\boxed{5}+1" is not
        s = last_boxed(s) or ""
    if len(s) > MAX_ANSWER_CHARS:
        return "".join(s.split())
    s = s.replace("\n", " ").replace("\\(", "").replace("\\)", "").replace("\\[", "").replace("\\]", "")
    s = s.replace("\\$", "").replace("$", "")
    s = _SPACING_RE.sub(" ", s)
    s = _LEFT_RIGHT_RE.sub("", s)
    s = _FRAC_CMD_RE.sub(r"\\frac", s)
    s = _DEGREE_RE.sub("", s)
    s = s.replace("\\%", "").replace("%", "")
    if m := _TRAILING_UNIT_RE.match(s):
        s = m.group(1)
    s = _TEXT_RE.sub(r"\1", s)
    if s.count("=") == 1:
        s = _LEADING_VAR_RE.sub("", s)
    s = "".join(s.split())
    s = s.rstrip(".")
    s = s.replace("{,}", ",")
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    s = _FRAC_SHORT_RE.sub(lambda m: "\\frac" + _braced(m.group(1)) + _braced(m.group(2)), s)
    s = _SQRT_SHORT_RE.sub(r"\\sqrt{\1}", s)
    return _canonical_number(s) or s


def _braced(arg: str) -> str:
    return arg if arg.startswith("{") else "{" + arg + "}"


@functools.cache
def _math_verify():
    """The math-verify module (imported on first use: it pulls in sympy, ~0.3 s)."""
    import math_verify
    import math_verify.grader
    import math_verify.parser

    # We pass timeout=None and bound the calls with time_limit instead (math-verify's own
    # SIGALRM would not nest with ours); its warning that nothing bounds them is untrue here.
    math_verify.parser.TIMEOUT_WARNING_SHOWN = True
    math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    return math_verify


@functools.lru_cache(maxsize=4096)
def _parse_for_verify(answer: str) -> tuple:
    """math-verify's parse of one answer (cached: a GRPO group shares its ground truth)."""
    mv = _math_verify()
    # A box inside an answer is only a frame ("\boxed{5}+1" is 6): math-verify, handed a box
    # within our box, would read the inner one as the answer.
    parsed = mv.parse(
        "\\boxed{" + _BOX_FRAME_RE.sub("", answer) + "}",
        extraction_config=[mv.LatexExtractionConfig(boxed_match_priority=0), mv.ExprExtractionConfig()],
        parsing_timeout=None,
    )
    return tuple(parsed)


def math_verify_equal(prediction: str, ground_truth: str, timeout_s: float | None) -> bool | None:
    """math-verify's verdict on two final answers; None when it cannot give one (not installed,
    an answer does not parse, an error, or more than ``timeout_s`` seconds)."""
    try:
        verify = _math_verify().verify
    except Exception as exc:  # not installed, or an install that fails to import
        warn_once(
            logger,
            "math-verify cannot be used (%s: %s): MATH answers are compared by the normaliser only",
            type(exc).__name__,
            exc,
        )
        return None
    verdict: bool | None = None
    try:
        with time_limit(timeout_s) as limit:
            gold = _parse_for_verify(ground_truth)
            pred = _parse_for_verify(prediction)
            if gold and pred:
                verdict = bool(verify(list(gold), list(pred), timeout_seconds=None))
    except Exception as exc:  # math-verify/sympy raise many types on odd input: fall back
        logger.debug("math-verify failed (%s) on %.200r vs %.200r", type(exc).__name__, prediction, ground_truth)
        return None
    if limit.expired:
        logger.debug("math-verify ran out of time on %.200r vs %.200r", prediction, ground_truth)
        return None
    return verdict


def math_equal(
    prediction: object,
    ground_truth: object,
    *,
    use_math_verify: bool = True,
    timeout_s: float | None = DEFAULT_MATH_VERIFY_TIMEOUT_S,
) -> bool:
    """Whether two final answers are the same (normaliser first, then math-verify); never raises."""
    pred, gold = as_text(prediction).strip(), as_text(ground_truth).strip()
    if not pred or not gold:
        return False
    if normalize_math_answer(pred) == normalize_math_answer(gold):
        return True
    if not use_math_verify or max(len(pred), len(gold)) > MAX_ANSWER_CHARS:
        return False
    return bool(math_verify_equal(pred, gold, timeout_s))


def compute_score(
    solution_str: object,
    ground_truth: object,
    extra_info: dict | None = None,
    *,
    use_math_verify: bool = True,
    timeout_s: float | None = DEFAULT_MATH_VERIFY_TIMEOUT_S,
) -> float:
    """MATH / MATH-500: 1.0 if the last ``\\boxed{}`` answer equals ``ground_truth``, else 0.0
    (also 0.0 with no box, or when the last box is unclosed).

    Equal means ``math_equal``, or equal under the Hendrycks normaliser the reference verl uses
    (so every answer the reference accepts from that box is accepted here too).
    """
    answer = last_boxed(solution_str)
    if answer is None:
        return 0.0
    if math_equal(answer, ground_truth, use_math_verify=use_math_verify, timeout_s=timeout_s):
        return 1.0
    return 1.0 if reference.hendrycks_equivalent(answer, as_text(ground_truth)) else 0.0


# "Answer:" as DAPO's prompt asks for it; spaces and line breaks may surround the colon.
_DAPO_ANSWER_RE = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)


def extract_dapo_answer(solution_str: object) -> str | None:
    """The DAPO-style final answer, or None: the rest of the line after the last "Answer:" (a
    ``\\boxed{}`` there is unwrapped, a final period dropped), else the last ``\\boxed{}``."""
    text = as_text(solution_str)
    lines = _DAPO_ANSWER_RE.findall(text)
    if not lines:
        return last_boxed(text)
    line = lines[-1].strip()
    if line.endswith("."):
        line = line[:-1].rstrip()
    boxed = last_boxed(line)
    return boxed if boxed is not None else (line or None)


def compute_score_dapo(
    solution_str: object,
    ground_truth: object,
    extra_info: dict | None = None,
    *,
    use_math_verify: bool = True,
    timeout_s: float | None = DEFAULT_MATH_VERIFY_TIMEOUT_S,
) -> dict:
    """DAPO-Math / AIME: +1.0 if the final answer (``extract_dapo_answer``) is correct, -1.0
    otherwise (no answer included), as in DAPO. Returns ``{"score", "acc", "pred"}``.

    Correct means ``math_equal``, or correct by the reference verl's own DAPO scorer (which reads
    only the last 300 characters, Minerva-normalises the "Answer:" line, and compares a box as a
    raw string), so every answer it accepts is accepted here too.
    """
    pred = extract_dapo_answer(solution_str)
    correct = pred is not None and math_equal(pred, ground_truth, use_math_verify=use_math_verify, timeout_s=timeout_s)
    if not correct and isinstance(solution_str, str) and isinstance(ground_truth, str):
        correct = bool(reference.dapo_reference_score(solution_str, ground_truth)["acc"])
    return {"score": 1.0 if correct else -1.0, "acc": bool(correct), "pred": "" if pred is None else pred[:200]}


def compute_score_numina(
    solution_str: object,
    ground_truth: object,
    extra_info: dict | None = None,
    *,
    use_math_verify: bool = True,
    timeout_s: float | None = DEFAULT_MATH_VERIFY_TIMEOUT_S,
) -> float:
    """NuminaMath sources: 1.0 if the final answer is correct, else 0.0.

    The answer is the last closed ``\\boxed{}``, else what PRIME's extraction (which the
    reference verl uses for these sources) finds: the text after the last "answer is"/"Answer:",
    "=", "is "... Correct means ``math_equal``, or PRIME's grader without its numeric leniency
    (``reference.prime_exact_equal``): the reference also counts 0.5 right for 50 and 3.1416 for
    ``\\pi`` (within 1e-4, or off by a factor of 100); that we do not.
    """
    text, gold = as_text(solution_str), as_text(ground_truth)
    extracted = reference.prime_extract(text)
    answer = last_boxed(text)
    if answer is None:
        answer = extracted
    if math_equal(answer, gold, use_math_verify=use_math_verify, timeout_s=timeout_s):
        return 1.0
    if max(len(extracted), len(gold)) > MAX_ANSWER_CHARS:  # sympy would only spend the time limit on it
        return 0.0
    return 1.0 if reference.prime_exact_equal(extracted, gold, sympy_timeout_s=timeout_s) else 0.0
