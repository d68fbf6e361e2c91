"""Reference-compatible scoring: the reference verl 0.9.1's rule-based rewards, reproduced.

``reward_model.rule_scoring=reference`` scores with ``verl.rewards.reference_compute_score``
(:mod:`verl.rewards.registry`: these scorers by ``data_source``, :func:`reference_scorer`, and
ours where the reference has none) instead of our default scorers, so a run ported from the
reference verl sees the same reward for the same response (the same reward curve). Our defaults accept more correct answers (``\\boxed{2.0}``
for 2, ``1+x^2`` for ``x^2+1``, ``0.25`` for ``\\frac14``...); the differences are listed in
docs/rewards.md and in tests/rewards/test_reference_scores.py, whose corpus holds the scores
the reference wheel itself gave.

What the reference does, by ``data_source`` (facts read from its
``verl/utils/reward_score``; the code here is our own):

- ``openai/gsm8k``: only the last 300 characters are read; the answer is the last
  ``"#### "`` (one space) followed by ``-``, digits, ``.`` and ``,``; commas are removed and the
  result must equal the ground truth *as a string* ("9.00" is not "9"). 1.0 / 0.0.
- ``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``, ``HuggingFaceH4/MATH-500``: the
  last ``\\boxed{..}`` (or, if the text contains ``"\\boxed "`` anywhere, what follows the last
  ``"\\boxed "`` up to a ``$``); both sides go through the Hendrycks MATH string normaliser
  (``hendrycks_normalize``) and must be equal strings. ``\\fbox`` is found but never accepted.
  1.0 / 0.0.
- ``math_dapo``, ``math``, ``math_dapo_reasoning``, ``aime*``: the last 300 characters; the
  text after the last ``Answer:`` (case-insensitive, spaces and line breaks allowed around
  the colon) to the end of its line, Minerva-normalised (``minerva_normalize``) on both sides;
  without any ``Answer:``, the last ``\\boxed{..}`` within the final 100 of those characters,
  compared to the ground truth as a raw string. +1.0 / -1.0.
- ``numina_*``: PRIME's grader (``prime_compute_score``): a loose extraction (after the last
  "answer:"/"answer is", inside the last box, after the last "is "/"="...), then string
  normalisation, sympy equality of the difference, and a numeric check within a relative
  1e-4 that also accepts the ground truth times 100 or divided by 100. 1.0 / 0.0.
- ``hiyouga/geometry3k``: 0.9 x right + 0.1 x layout; right by the mathruler package's copy of
  PRIME's ``grade_answer`` on mathruler's box (the string "None" when there is none), layout
  when the whole response matches ``<think>.*</think>.*\\boxed{.*}.*``.
- Any other data source has no reference scorer (the reference raises); ours is used
  (``countdown``, ``verl/arithmetic``, ``gsm8k``).

Departures, each where the reference would run the model's text as Python: the reference
``eval``s an answer holding ``\\pi`` (after substituting a number) and a bracketed answer
against a matrix, and hands ``Matrix(...)`` answers to sympy's parser; here only arithmetic on
number literals is evaluated (``_safe_arith``) and ``Matrix(...)`` answers are not parsed.
The reference renders LaTeX to text with pylatexenc inside PRIME's normaliser; ``latex_to_text``
renders the commands that occur in answers the same way (see ``_SYMBOLS``), not every one.
The sympy check runs under a 10 s limit in-process (the reference: 10 s in a child process for
PRIME, none for mathruler).
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable
from typing import Any

from verl.rewards.timeout import time_limit

__all__ = [
    "REFERENCE_VERSION",
    "dapo_reference_score",
    "geo3k_accuracy",
    "geo3k_reference_score",
    "gsm8k_reference_score",
    "hendrycks_equivalent",
    "hendrycks_normalize",
    "latex_to_text",
    "math_reference_score",
    "minerva_normalize",
    "prime_compute_score",
    "prime_exact_equal",
    "prime_extract",
    "reference_data_source",
    "reference_scorer",
]

REFERENCE_VERSION = "0.9.1"
"""The reference verl release whose scorers this module reproduces (checked by the test corpus)."""


# ================================================================= shared: boxes and braces


def _brace_span_end(text: str, start: int) -> int | None:
    """Index of the "}" where the brace count started at ``start`` first returns to zero.

    Counting starts at 0 and is checked only after a closing brace, so a stray "}" before the
    first "{" drives the count negative (as the reference's scan does). None if it never closes.
    """
    depth = 0
    for i in range(start, len(text)):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


def _strip_box_command(boxed: str) -> str | None:
    """Content of a span that reads exactly ``\\boxed{...}``; None for anything else (``\\fbox``)."""
    if boxed.startswith("\\boxed{") and boxed.endswith("}"):
        return boxed[len("\\boxed{") : -1]
    return None


# ================================================================= GSM8K

_GSM8K_WINDOW = 300
_GSM8K_STRICT_RE = re.compile(r"#### (-?[0-9.,]+)")


def gsm8k_reference_score(solution_str: str, ground_truth: Any) -> float:
    """The reference's strict GSM8K scorer: 1.0 when the last "#### N" in the final 300
    characters, commas removed, is the ground truth string; else 0.0."""
    found = _GSM8K_STRICT_RE.findall(solution_str[-_GSM8K_WINDOW:])
    if not found:
        return 0.0
    return 1.0 if found[-1].replace(",", "") == ground_truth else 0.0


# ================================================================= MATH (Hendrycks normaliser)


class _NormaliseError(Exception):
    """The Hendrycks normaliser hit a shape it cannot handle (the caller then compares raw)."""


def _hendrycks_units(s: str) -> str:
    # A "\text{ " (with its space) starts a unit: keep what precedes it. Two of them is an error.
    if "\\text{ " not in s:
        return s
    parts = s.split("\\text{ ")
    if len(parts) != 2:
        raise _NormaliseError("more than one unit")
    return parts[0]


def _hendrycks_sqrt(s: str) -> str:
    # "\sqrt3" -> "\sqrt{3}": brace the single character that follows each bare \sqrt.
    pieces = s.split("\\sqrt")
    out = [pieces[0]]
    for piece in pieces[1:]:
        if not piece:
            raise _NormaliseError("\\sqrt at the end")
        out.append("\\sqrt" + (piece if piece[0] == "{" else "{" + piece[0] + "}" + piece[1:]))
    return "".join(out)


def _hendrycks_fracs(s: str) -> str:
    # "\frac12" -> "\frac{1}{2}", "\frac1{2}" -> "\frac{1}{2}"; a too-short "\frac" leaves s as is.
    pieces = s.split("\\frac")
    out = [pieces[0]]
    for piece in pieces[1:]:
        if not piece:
            raise _NormaliseError("\\frac at the end")
        if piece[0] == "{":
            out.append("\\frac" + piece)
            continue
        if len(piece) < 2:
            return s
        first, second, rest = piece[0], piece[1], piece[2:]
        if second == "{":
            out.append("\\frac{" + first + "}" + second + rest)
        else:
            out.append("\\frac{" + first + "}{" + second + "}" + rest)
    return "".join(out)


def _hendrycks_slash(s: str) -> str:
    # "3/4" -> "\frac{3}{4}" when both sides are integers that print back the same way.
    sides = s.split("/")
    if len(sides) != 2:
        return s
    try:
        num, den = int(sides[0]), int(sides[1])
    except ValueError:
        return s
    return f"\\frac{{{num}}}{{{den}}}" if f"{num}/{den}" == s else s


def _hendrycks_strip(s: str, *, drop_bare_percent: bool = False) -> str:
    """The Hendrycks MATH normaliser; raises ``_NormaliseError`` where it gives up.

    ``drop_bare_percent``: mathruler's copy (Geometry3K) drops every "%"; the others only "\\%".
    """
    for old, new in (
        ("\n", ""),
        ("\\!", ""),
        ("\\\\", "\\"),
        ("tfrac", "frac"),
        ("dfrac", "frac"),
        ("\\left", ""),
        ("\\right", ""),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("\\$", ""),
    ):
        s = s.replace(old, new)
    s = _hendrycks_units(s)
    if drop_bare_percent:
        s = s.replace("\\%", "").replace("%", "")
    else:
        s = s.replace("\\\\%", "").replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 3" -> " 3"
        s = sides[1]
    s = _hendrycks_sqrt(s)
    s = s.replace(" ", "")
    s = _hendrycks_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _hendrycks_slash(s)


def hendrycks_normalize(answer: str) -> str:
    """The Hendrycks MATH normal form of ``answer``; raises where that normaliser gives up."""
    return _hendrycks_strip(answer)


def _math_last_box(text: str) -> str | None:
    """The span the reference's MATH scorer treats as the final box (see the module docstring)."""
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    end = _brace_span_end(text, start)
    return None if end is None else text[start : end + 1]


def hendrycks_equivalent(answer: str, ground_truth: Any) -> bool:
    """The reference MATH scorer's equality: equal Hendrycks normal forms (raw equality where the
    normaliser gives up)."""
    try:
        return _hendrycks_strip(answer) == _hendrycks_strip(ground_truth)
    except Exception:  # the normaliser gave up (or the ground truth is not a string): compare raw
        return answer == ground_truth


def math_reference_score(solution_str: str, ground_truth: Any) -> float:
    """The reference's MATH scorer: 1.0 when the final box equals the ground truth after the
    Hendrycks normaliser on both sides, else 0.0."""
    span = _math_last_box(solution_str)
    if span is None:
        return 0.0
    if span.startswith("\\boxed "):
        answer = span[len("\\boxed ") :]
    else:
        answer = _strip_box_command(span)
        if answer is None:  # "\fbox{..}", or a span without its closing brace
            return 0.0
    return 1.0 if hendrycks_equivalent(answer, ground_truth) else 0.0


# ================================================================= DAPO / AIME (Minerva)

_DAPO_WINDOW = 300
_DAPO_BOX_WINDOW = 100
_MINERVA_ANSWER_RE = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)
_NO_ANSWER = "[INVALID]"

# Plain substring edits, in order (the Minerva paper's normaliser, as the reference applies it).
_MINERVA_REPLACE = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
# Substrings deleted, in order: unit words and LaTeX decorations.
_MINERVA_DELETE = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots",
    "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds",
    "meters", "meals", "edges", "students", "childrentickets", "multiples", "\\text{s}",
    "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}",
    "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)  # fmt: skip
_MINERVA_REGEX_EDITS = (
    (re.compile(r"(.*?)\$(.*?)\$(.*)"), r"$\2$"),  # keep only the first $...$ of a line
    (re.compile(r"\\text\{(.*?)\}"), r"\1"),
    (re.compile(r"\\textbf\{(.*?)\}"), r"\1"),
    (re.compile(r"\\overline\{(.*?)\}"), r"\1"),
    (re.compile(r"\\boxed\{(.*)\}"), r"\1"),
    (re.compile(r"frac([^{])(.)"), r"frac{\1}{\2}"),
    (re.compile(r"sqrt([^{])"), r"sqrt{\1}"),
)


def minerva_normalize(answer: str) -> str:
    """The Minerva normal form used by DAPO's scorer (the reference's ``normalize_final_answer``)."""
    s = answer.split("=")[-1]
    for old, new in _MINERVA_REPLACE:
        s = s.replace(old, new)
    for gone in _MINERVA_DELETE:
        s = s.replace(gone, "")
    for pattern, repl in _MINERVA_REGEX_EDITS:
        s = pattern.sub(repl, s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def _dapo_last_box(text: str) -> str | None:
    """Content of the last ``\\boxed{`` (exactly that spelling) that closes; else None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    end = _brace_span_end(text, start)
    return None if end is None else text[start + len("\\boxed{") : end]


def dapo_reference_score(solution_str: str, ground_truth: Any) -> dict[str, Any]:
    """The reference's DAPO scorer: ``{"score": +1.0 / -1.0, "acc": bool, "pred": str}``."""
    text = solution_str[-_DAPO_WINDOW:]
    lines = _MINERVA_ANSWER_RE.findall(text)
    pred = minerva_normalize(lines[-1] if lines else _NO_ANSWER)
    if pred != _NO_ANSWER:
        correct = pred == minerva_normalize(ground_truth)
    else:
        boxed = _dapo_last_box(text[-_DAPO_BOX_WINDOW:])
        correct = boxed is not None and boxed == ground_truth
        pred = boxed if boxed is not None else pred
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


# ================================================================= Numina (PRIME's grader)

# --- LaTeX to plain text, as pylatexenc renders it for PRIME's normaliser

_SYMBOLS: dict[str, str] = {
    # spacing and delimiters that vanish
    "left": "", "right": "", "displaystyle": "", "textstyle": "", "big": "", "Big": "", "bigl": "",
    "bigr": "", "quad": "  ", "qquad": "    ",
    # operators and relations
    "cdot": "\u00b7", "times": "\u00d7", "div": "\u00f7", "pm": "\u00b1", "mp": "\u2213",
    "infty": "\u221e", "cup": "\u222a", "cap": "\u2229", "setminus": "\u2216", "le": "\u2264",
    "leq": "\u2264", "ge": "\u2265", "geq": "\u2265", "ne": "\u2260", "neq": "\u2260",
    "approx": "\u2248", "sim": "\u223c", "circ": "\u2218", "degree": "\u00b0", "in": "\u2208",
    "mid": "|", "to": "\u2192", "rightarrow": "\u2192", "emptyset": "\u2205", "varnothing": "\u2205",
    "angle": "\u2220", "perp": "\u22a5", "parallel": "\u2225", "prime": "\u2032",
    "dots": "\u2026", "ldots": "\u2026", "cdots": "\u22ef", "lfloor": "\u230a", "rfloor": "\u230b",
    "lceil": "\u2308", "rceil": "\u2309",
    # Greek letters
    "alpha": "\u03b1", "beta": "\u03b2", "gamma": "\u03b3", "delta": "\u03b4", "epsilon": "\u03f5",
    "varepsilon": "\u03b5", "theta": "\u03b8", "lambda": "\u03bb", "mu": "\u03bc", "pi": "\u03c0",
    "rho": "\u03c1", "sigma": "\u03c3", "tau": "\u03c4", "phi": "\u03d5", "varphi": "\u03c6",
    "omega": "\u03c9", "Gamma": "\u0393", "Delta": "\u0394", "Theta": "\u0398", "Lambda": "\u039b",
    "Pi": "\u03a0", "Sigma": "\u03a3", "Phi": "\u03a6", "Omega": "\u03a9",
    # function names print as themselves
    **{name: name for name in (
        "log", "ln", "lg", "exp", "sin", "cos", "tan", "cot", "sec", "csc", "arcsin", "arccos",
        "arctan", "sinh", "cosh", "tanh", "min", "max", "gcd", "lcm", "det", "lim", "deg",
    )},
}  # fmt: skip
# Commands whose braced argument prints as plain text.
_TEXT_LIKE = frozenset(
    ("text", "textbf", "textit", "textrm", "mathrm", "operatorname", "emph", "mbox", "overline", "underline",
     "boxed", "fbox", "hbox", "mathit")
)  # fmt: skip
# One-character commands: "\," is a space, "\{" a brace...
_SHORT_COMMANDS = {",": " ", ";": " ", ":": " ", " ": " ", "!": "", "{": "{", "}": "}", "%": "%",
                   "$": "$", "&": "&", "_": "_", "#": "#", "\\": "\n", "(": "", ")": "", "[": "", "]": ""}  # fmt: skip


# Groups nested deeper than this are not rendered (the answer then stays as written, as when
# pylatexenc fails in the reference); it keeps the reader far from Python's recursion limit.
_MAX_LATEX_DEPTH = 100


_COMMAND_RE = re.compile(r"\\([A-Za-z]+)\s*")  # a named command eats the spaces after it


class _TooDeep(Exception):
    pass


class _LatexReader:
    """A small recursive renderer of LaTeX to text (the subset that shows up in final answers)."""

    def __init__(self, text: str) -> None:
        self.s = text
        self.i = 0
        self.depth = 0

    def render(self, stop_at_close: bool = False) -> str:
        self.depth += 1
        if self.depth > _MAX_LATEX_DEPTH:
            raise _TooDeep
        try:
            return self._render(stop_at_close)
        finally:
            self.depth -= 1

    def _render(self, stop_at_close: bool) -> str:
        out: list[str] = []
        while self.i < len(self.s):
            ch = self.s[self.i]
            if ch == "}" and stop_at_close:
                self.i += 1
                return "".join(out)
            out.append(self._node())
        return "".join(out)

    def _node(self) -> str:
        ch = self.s[self.i]
        if ch == "\\":
            return self._command()
        if ch == "{":
            self.i += 1
            return self.render(stop_at_close=True)
        if ch == "}":  # a stray closing brace prints nothing
            self.i += 1
            return ""
        if ch == "$":  # math-mode delimiters print nothing
            self.i += 1
            return ""
        self.i += 1
        return ch

    def _argument(self) -> str:
        """One argument: a braced group, a command, or one character (spaces before it skipped)."""
        while self.i < len(self.s) and self.s[self.i].isspace():
            self.i += 1
        if self.i >= len(self.s):
            return ""
        return self._node()

    def _command(self) -> str:
        m = _COMMAND_RE.match(self.s, self.i)
        if m is None:
            nxt = self.s[self.i + 1 : self.i + 2]
            self.i += 1 + len(nxt)
            return _SHORT_COMMANDS.get(nxt, "")
        name = m.group(1)
        self.i = m.end()
        if name == "frac":
            num = self._argument()
            den = self._argument()
            return f"{num}/{den}"
        if name == "sqrt":
            if self.s.startswith("[", self.i):  # an index, "\sqrt[3]{x}", is dropped
                close = self.s.find("]", self.i)
                self.i = len(self.s) if close < 0 else close + 1
            return f"\u221a({self._argument()})"
        if name in _TEXT_LIKE:
            return self._argument() if self.s.startswith("{", self.i) else ""
        return _SYMBOLS.get(name, "")


def latex_to_text(latex: str) -> str | None:
    """Plain text of a LaTeX answer, rendered as pylatexenc's ``latex_to_text`` renders it;
    None when braces nest deeper than ``_MAX_LATEX_DEPTH``."""
    try:
        return _LatexReader(latex).render()
    except _TooDeep:
        return None


# --- the extraction (PRIME's match_answer)

_LEAD_MARKERS = ("answer:", "answer is", "answers are")
_TRAIL_MARKERS = ("is answer", "is the answer", "are answers", "are the answers")
_LAST_MARKERS = ("be ", "is ", "are ", "=", ": ", "get ", "be\n", "is\n", "are\n", ":\n", "get\n")


def _prime_last_box(text: str) -> str | None:
    """What is inside the first brace group after the last ``\\boxed`` (or ``\\fbox``), stripped."""
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    # The count runs from the command itself, so a "}" before the first "{" unbalances it.
    end = _brace_span_end(text, start)
    if end is None:
        return None
    return text[text.find("{", start) + 1 : end].strip()


def prime_extract(response: str) -> str:
    """The part of a response PRIME's grader judges (it does not need a box or a marker)."""
    for marker in _LEAD_MARKERS:
        at = response.lower().rfind(marker)
        if at >= 0:
            response = response[at + len(marker) :].strip()
    for marker in _TRAIL_MARKERS:
        at = response.lower().rfind(marker)
        if at >= 0:
            response = response[:at].strip()
    boxed = _prime_last_box(response)
    if boxed:
        response = boxed
    if ". " in response:
        response = response[: response.lower().rfind(". ")].strip()
    for marker in _LAST_MARKERS:
        at = response.lower().rfind(marker)
        if at >= 0:
            response = response[at + len(marker) :].strip()
    return response


# --- grade_answer: string normal forms, then sympy on each tuple element

_UNIT_WORDS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week",
               "month", "year", "foot", "feet", "inch", "yard", "liter")  # fmt: skip
_UNIT_RES = tuple(re.compile(word + r"(es)?(s)? *(\^[0-9]+)?") for word in _UNIT_WORDS)
_MATHRULER_UNIT_RES = _UNIT_RES[:-1]  # mathruler's list lacks "liter"
_WHOLE_TEXT_RE = re.compile(r"^\\text\{(?P<text>.+?)\}$")
_THOUSANDS_COMMA_RE = re.compile(r"(\d),(\d\d\d)($|\D)")
_PRIME_FRAC_RE = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")
_SYMPY_REFUSED = ("^{", "^(")
_SYMPY_REFUSED_RES = (re.compile(r"\^[0-9]+\^"), re.compile(r"\^[0-9][0-9]+"))
_SYMPY_TIMEOUT_S = 10.0
_UNICODE_TO_SYMPY = (("\u221a", "sqrt"), ("\u03c0", "pi"), ("\u221e", "inf"), ("\u222a", "U"),
                     ("\u00b7", "*"), ("\u00d7", "*"))  # fmt: skip


def _prime_mathd(answer: str, mathruler: bool = False) -> str:
    """PRIME's first normal form: a whole ``\\text{..}`` unwrapped, then the Hendrycks normaliser."""
    answer = answer.strip()
    try:
        m = _WHOLE_TEXT_RE.search(answer)
        if m is not None:
            answer = m.group("text").strip()
        return _hendrycks_strip(answer, drop_bare_percent=mathruler)
    except Exception:
        return answer


def _drop_thousands_commas(s: str) -> str:
    while True:
        nxt = _THOUSANDS_COMMA_RE.sub(r"\1\2\3", s)
        if nxt == s:
            return s
        s = nxt


def _is_float(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def _near_int(x: float) -> bool:
    try:
        return abs(x - round(x)) <= 1e-7
    except (OverflowError, ValueError, TypeError):
        return False


def _str_near_int(s: str) -> bool:
    try:
        return _near_int(float(_drop_thousands_commas(s)))
    except ValueError:
        return False


def _prime_normalize(expr: str, mathruler: bool = False) -> str:
    """PRIME's second normal form (units, ``$``/``%``, LaTeX rendered to text, lower case).

    ``mathruler``: the variant of the mathruler package (Geometry3K), which also drops spaces
    and braces at the end, and does not know "liter".
    """
    m = _WHOLE_TEXT_RE.search(expr)
    if m is not None:
        expr = m.group("text")
    expr = expr.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    expr = expr.replace(" or ", " , ").replace(" and ", " , ")
    expr = expr.replace("million", "*10^6").replace("billion", "*10^9").replace("trillion", "*10^12")
    for unit_re in _MATHRULER_UNIT_RES if mathruler else _UNIT_RES:
        expr = unit_re.sub("", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr and expr[0] == "{" and expr[-1] == "}":
        expr = expr[1:-1]
    expr = re.sub(r",\\! *", "", expr)
    if _is_float(expr) and _near_int(float(expr)):
        expr = str(round(float(expr)))
    if "\\" in expr:
        text = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
        text = latex_to_text(text)
        if text is not None:  # as the reference, an answer that fails to render stays as it is
            for char, name in _UNICODE_TO_SYMPY:
                text = text.replace(char, name)
            expr = text.strip()
    expr = re.sub("- *", "-", expr)
    expr = re.sub(r"([0-9]) +([0-9])", r"\1+\2", expr)  # "7 3/4" is 7+3/4
    if mathruler:
        expr = expr.replace(" ", "").replace("{", "").replace("}", "")
    expr = expr.lower()
    if _str_near_int(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def _split_elements(expr: str) -> list[str]:
    """Elements of a tuple or interval ("(1,2)" -> ["1", "2"]); anything else is one element."""
    expr = _drop_thousands_commas(expr)
    if not expr:
        return []
    brackets = "()[]"
    if len(expr) > 2 and expr[0] in brackets and expr[-1] in brackets and not any(b in expr[1:-1] for b in brackets):
        return [part.strip() for part in expr[1:-1].split(",")]
    return [expr]


def _sympy_allowed(expr: str) -> bool:
    letters = {ch for ch in expr.replace("sqrt", "").replace("frac", "") if ch.isalpha()}
    if len(letters) > 2 or any(bad in expr for bad in _SYMPY_REFUSED):
        return False
    return not any(r.search(expr) for r in _SYMPY_REFUSED_RES)


def _sympy_difference_is_zero(gold: str, given: str, timeout_s: float | None = _SYMPY_TIMEOUT_S) -> bool:
    """Whether sympy simplifies ``(gold)-(given)`` to 0 (implicit multiplication allowed)."""
    expr = f"({gold})-({given})"
    if not _sympy_allowed(expr):
        return False
    from sympy import simplify
    from sympy.parsing import sympy_parser

    verdict = False
    with time_limit(timeout_s):
        try:
            parsed = sympy_parser.parse_expr(
                expr.replace("^", "**"),
                transformations=sympy_parser.standard_transformations
                + (sympy_parser.implicit_multiplication_application,),
            )
            verdict = simplify(parsed) == 0
        except Exception:  # sympy raises many types on text it cannot read
            verdict = False
    return bool(verdict)


def _prime_grade(
    given: str, gold: str, sympy_timeout_s: float | None = _SYMPY_TIMEOUT_S, mathruler: bool = False
) -> bool:
    """PRIME's ``grade_answer``: equal normal forms, or sympy equality element by element
    (``mathruler``: that package's copy of it, which Geometry3K uses)."""
    if _prime_mathd(gold, mathruler) == _prime_mathd(given, mathruler):
        return True
    gold_n, given_n = _prime_normalize(gold, mathruler), _prime_normalize(given, mathruler)
    if gold_n == given_n:
        return True
    if not given_n:
        return False
    gold_parts, given_parts = _split_elements(gold_n), _split_elements(given_n)
    if len(gold_parts) != len(given_parts):
        return False
    if len(gold_parts) > 1 and (gold_n[0] != given_n[0] or gold_n[-1] != given_n[-1]):
        return False
    for gold_part, given_part in zip(gold_parts, given_parts):
        if _PRIME_FRAC_RE.search(gold_part) and _PRIME_FRAC_RE.search(given_part):
            ok = gold_part == given_part  # fractions must be written reduced, as the ground truth is
        elif _str_near_int(gold_part) != _str_near_int(given_part):
            ok = False  # an integer ground truth needs an integer answer
        else:
            ok = _sympy_difference_is_zero(gold_part, given_part, sympy_timeout_s)
        if not ok:
            return False
    return True


# --- math_equal: a numeric check with tolerance, then tuples, intervals and matrices


class _GiveUp(Exception):
    """Where the reference's checker raises: the whole comparison is then "not equal"."""


_ARITH_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}  # fmt: skip


def _safe_arith(text: str) -> Any:
    """The value of ``text`` if it is arithmetic on number literals (or lists of them); else raise."""

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float, complex):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = value(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITH_BINOPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large to evaluate safely")
            return _ARITH_BINOPS[type(node.op)](left, right)
        if isinstance(node, (ast.List, ast.Tuple)):
            items = [value(e) for e in node.elts]
            return items if isinstance(node, ast.List) else tuple(items)
        raise ValueError(f"{type(node).__name__} is not evaluated")

    return value(ast.parse(text.strip(), mode="eval").body)


def _substitute_pi(s: str, pi: float) -> Any:
    # "2\pi" -> "2*3.14..", "\pi" -> "1*3.14..", then evaluated when it is plain arithmetic.
    at = s.find("\\pi")
    while at != -1:
        factor = f"*{pi}" if at > 0 and s[at - 1].isdigit() else f"1*{pi}"
        s = s[:at] + factor + s[at + 3 :]
        at = s.find("\\pi", at + 1)
    try:
        return _safe_arith(s)
    except Exception:
        return s


def _grader_normalize(answer: Any, pi: float) -> Any:
    if isinstance(answer, str):
        if re.match(r"\$\d+(\.\d+)?", answer):
            return answer[1:]
        if re.match(r"^\d+(\.\d+)?%$", answer) or re.match(r"^\d+(\.\d+)?\\%$", answer):
            return answer.replace("\\%", "").replace("%", "")
        if "_" in answer:  # a base subscript, "1011_2": the digits read as a decimal number
            try:
                return int(float(answer.split("_")[0]))
            except ValueError as exc:
                raise _GiveUp from exc
        if "\\pi" in answer:
            return _substitute_pi(answer, pi)
    return answer


def _as_number(x: Any) -> float | None:
    s = str(x)
    try:
        return float(s.replace("{,}", "") if "{,}" in s else s.replace(",", ""))
    except ValueError:
        return None


_INTERVAL_CONSTRUCTORS = (
    (re.compile(r"^Interval\((.*)\)$"), "[", "]"),
    (re.compile(r"^Interval\.Ropen\((.*)\)$"), "[", ")"),
    (re.compile(r"^Interval\.Lopen\((.*)\)$"), "(", "]"),
    (re.compile(r"^Interval\.open\((.*)\)$"), "(", ")"),
)


def _strip_interval_constructor(pred: str) -> str:
    # sympy's printed intervals read as brackets: "Interval.Ropen(1, 2)" -> "[1, 2)".
    for pattern, opening, closing in _INTERVAL_CONSTRUCTORS:
        if m := pattern.match(pred):
            return opening + m.group(1) + closing
    return pred


def _grader_equal(
    prediction: Any, reference: Any, pi: float = math.pi, *, rel_tol: float = 1e-4, percent: bool = True
) -> bool:
    """PRIME's ``math_equal`` without its symbolic stage (in 0.9.1 that stage always says no).

    ``rel_tol`` and ``percent`` are the reference's numeric leniency (a relative 1e-4, and the
    ground truth times or divided by 100); our default scorer calls it with 0 and False.
    """
    # all([...]) below, not all(...): every element is compared (and may raise), as in the reference.
    again = {"rel_tol": rel_tol, "percent": percent}
    prediction = _grader_normalize(prediction, pi)
    reference = _grader_normalize(reference, pi)
    if isinstance(prediction, str) and len(prediction) > 1000:
        prediction = prediction[:1000]
    if isinstance(prediction, str) and isinstance(reference, str):
        if prediction.strip().lower() == reference.strip().lower():
            return True
        if prediction.replace(" ", "") == reference.replace(" ", ""):
            return True
    pred_num, ref_num = _as_number(prediction), _as_number(reference)
    if pred_num is not None and ref_num is not None:
        # The ground truth, or it read as a percentage either way, within a relative 1e-4.
        candidates = (ref_num / 100, ref_num, ref_num * 100) if percent else (ref_num,)
        return any(math.isclose(c, pred_num, rel_tol=rel_tol) for c in candidates)
    if not prediction and prediction not in (0, False):
        return False
    reference, prediction = str(reference).strip(), str(prediction).strip()
    prediction = _strip_interval_constructor(prediction)
    pred_s, ref_s = prediction, reference
    if (prediction.startswith("[") and prediction.endswith("]") and not reference.startswith("(")) or (
        prediction.startswith("(") and prediction.endswith(")") and not reference.startswith("[")
    ):
        pred_s, ref_s = pred_s.strip("[]()"), ref_s.strip("[]()")
    for brace in "{}()":
        pred_s, ref_s = pred_s.replace(brace, ""), ref_s.replace(brace, "")
    if pred_s == ref_s:
        return True
    if (
        prediction
        and reference
        and prediction[0] in "(["
        and prediction[-1] in ")]"
        and prediction[0] == reference[0]
        and prediction[-1] == reference[-1]
    ):
        pred_parts, ref_parts = prediction[1:-1].split(","), reference[1:-1].split(",")
        if len(pred_parts) == len(ref_parts) and all([_grader_equal(p, r, **again) for p, r in zip(pred_parts, ref_parts)]):  # noqa: C419
            return True
    if "," in prediction and "," in reference:
        pred_parts = [p.strip() for p in prediction.split(",")]
        ref_parts = [r.strip() for r in reference.split(",")]
        if len(pred_parts) == len(ref_parts):
            return all([_grader_equal(p, r, **again) for p, r in zip(pred_parts, ref_parts)])  # noqa: C419
    if prediction.startswith("Point"):
        if not reference:
            raise _GiveUp
        if reference[0] == "(" and reference[-1] == ")":
            pred_parts = prediction[prediction.find("(") + 1 : -1].split(",")
            ref_parts = reference[1:-1].split(",")
            if len(pred_parts) == len(ref_parts) and all([_grader_equal(p, r, **again) for p, r in zip(pred_parts, ref_parts)]):  # noqa: C419
                return True
    if "\\begin{pmatrix}" in reference and prediction.startswith("[") and prediction.endswith("]"):
        try:
            rows = _safe_arith(prediction)
        except Exception as exc:
            raise _GiveUp from exc
        if isinstance(rows, list):
            body = reference
            for affix in ("\\\\begin{pmatrix}", "\\begin{pmatrix}"):
                body = body.removeprefix(affix)
            for affix in ("\\\\end{pmatrix}", "\\end{pmatrix}"):
                body = body.removesuffix(affix)
            ref_rows = [row.split("&") if "&" in row else row for row in body.split("\\")]
            try:
                if len(rows) == len(ref_rows) and all([_grader_equal(p, r, **again) for r, p in zip(ref_rows, rows)]):  # noqa: C419
                    return True
            except Exception:  # as the reference: a row that cannot be compared means "not equal"
                return False
    return False


def prime_exact_equal(given: str, ground_truth: str, sympy_timeout_s: float | None = _SYMPY_TIMEOUT_S) -> bool:
    """PRIME's verdict without its numeric leniency: equal normal forms, sympy equality, or
    numerically *equal* (not within 1e-4, and not off by a factor of 100). Never raises."""
    try:
        return _prime_grade(given, ground_truth, sympy_timeout_s) or _grader_equal(given, ground_truth, rel_tol=0.0, percent=False)
    except Exception:  # _GiveUp, or an error where the reference's checker errs too
        return False


def prime_compute_score(solution_str: str, ground_truth: Any) -> float:
    """The reference's Numina scorer (PRIME's grader): 1.0 if correct, else 0.0."""
    solution_str, ground_truth = str(solution_str), str(ground_truth)
    given = prime_extract(solution_str)
    if _prime_grade(given, ground_truth):
        return 1.0
    try:
        if "\\pi" in given or "\\pi" in ground_truth:
            correct = any([_grader_equal(given, ground_truth, pi=p) for p in (math.pi, 3.14)])  # noqa: C419
        else:
            correct = _grader_equal(given, ground_truth)
    except Exception:  # _GiveUp, or an error where the reference's checker errs too
        correct = False
    return 1.0 if correct else 0.0


# ================================================================= Geometry3K (mathruler)

_GEO3K_LAYOUT_RE = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)
_GEO3K_FORMAT_WEIGHT = 0.1


def _mathruler_box(text: str) -> str:
    """mathruler's box: the content after the last ``\\boxed{`` up to its closing brace,
    stripped; the *string* "None" when there is none or it never closes."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return "None"
    depth = 0
    for i in range(start + len("\\boxed{"), len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth < 0:
                return text[start + len("\\boxed{") : i].strip()
    return "None"


def geo3k_accuracy(
    solution_str: str,
    ground_truth: Any,
    *,
    max_answer_chars: int | None = None,
    sympy_timeout_s: float | None = _SYMPY_TIMEOUT_S,
) -> bool:
    """Whether the reference's Geometry3K scorer counts the answer right (mathruler's grader).

    ``max_answer_chars``: a longer boxed answer counts as wrong without grading (None: no limit,
    as the reference)."""
    answer = _mathruler_box(solution_str)
    if max_answer_chars is not None and len(answer) > max_answer_chars:
        return False
    try:
        return _prime_grade(answer, str(ground_truth), sympy_timeout_s, mathruler=True)
    except Exception:  # an error in the grader means "not right"
        return False


def geo3k_reference_score(solution_str: str, ground_truth: Any) -> float:
    """The reference's Geometry3K scorer: 0.9 x right + 0.1 x the think-then-box layout."""
    accuracy = 1.0 if geo3k_accuracy(solution_str, ground_truth) else 0.0
    layout = 1.0 if _GEO3K_LAYOUT_RE.fullmatch(solution_str) else 0.0
    return (1.0 - _GEO3K_FORMAT_WEIGHT) * accuracy + _GEO3K_FORMAT_WEIGHT * layout


# ================================================================= dispatch

_REFERENCE_TABLE: dict[str, Callable[[str, Any], float | dict[str, Any]]] = {
    "openai/gsm8k": gsm8k_reference_score,
    "lighteval/MATH": math_reference_score,
    "DigitalLearningGmbH/MATH-lighteval": math_reference_score,
    "HuggingFaceH4/MATH-500": math_reference_score,
    "math_dapo": dapo_reference_score,
    "math": dapo_reference_score,
    "math_dapo_reasoning": dapo_reference_score,
    "hiyouga/geometry3k": geo3k_reference_score,
    **{
        f"numina_{name}": prime_compute_score
        for name in ("aops_forum", "synthetic_math", "amc_aime", "synthetic_amc", "cn_k12", "olympiads")
    },
}


def reference_data_source(data_source: str) -> bool:
    """Whether the reference verl has a rule-based scorer of its own for ``data_source``."""
    return reference_scorer(data_source) is not None


def reference_scorer(data_source: str) -> Callable[[str, Any], float | dict[str, Any]] | None:
    """The reference verl's own scorer ``fn(solution_str, ground_truth)`` for ``data_source``, or None
    where it has none (``verl.rewards.reference_compute_score`` then scores with ours)."""
    fn = _REFERENCE_TABLE.get(data_source)
    if fn is None and isinstance(data_source, str) and data_source.startswith("aime"):
        fn = dapo_reference_score
    return fn
