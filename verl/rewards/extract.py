"""Answer extraction shared by the rule-based scorers.

Every function here takes any object (``None``, bytes, a number) and returns a string or
``None``; none of them raises, and every regex is linear in the input length, so a
multi-megabyte response costs milliseconds.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# A number as people write it in an answer: an optional minus sign (not one that is a binary
# minus after a digit, letter or closing bracket: "5-3" ends in 3, not -3), digits with
# optional thousands separators in groups of three ("1,234,567"; "1,2,3" is three numbers),
# an optional fraction part. ASCII digits only. Unicode minus signs are mapped to "-" first.
NUMBER_PATTERN = (
    r"(?:(?<![0-9A-Za-z)\]}])-)?(?<![0-9.])(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)(?:\.[0-9]+)?"
    r"|(?<![0-9])\.[0-9]+"
)
_NUMBER_RE = re.compile(NUMBER_PATTERN)
_UNICODE_MINUS = str.maketrans({"\u2212": "-", "\u2013": "-", "\u2012": "-", "\uff0d": "-"})

_BOX_COMMAND_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# What brace matching looks at: an escaped brace or backslash (skipped as a unit) or a brace.
_BRACE_TOKEN_RE = re.compile(r"\\[\\{}]|[{}]")
# The argument of "\boxed 5$": up to the closing "$" or the end of the line.
_TEX_ARG_RE = re.compile(r"[^$\n]*")
# "\boxed{\boxed{...}}" is unwrapped at most this deep (bounds the work on adversarial nesting).
_MAX_BOX_UNWRAP = 8


def as_text(value: object) -> str:
    """``value`` as a string: ``None`` -> "", bytes decoded leniently, anything else ``str()``."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", errors="replace")
    try:
        return str(value)
    except Exception:  # a user object whose __str__ raises still gets a score
        return ""


def normalize_minus(text: str) -> str:
    """Map the Unicode minus and dash look-alikes to ASCII "-"."""
    return text.translate(_UNICODE_MINUS)


def find_numbers(text: object) -> list[str]:
    """Every number in ``text``, left to right, as written (commas kept)."""
    return _NUMBER_RE.findall(normalize_minus(as_text(text)))


def last_number(text: object) -> str | None:
    """The last number in ``text`` (see ``NUMBER_PATTERN``), or None."""
    numbers = find_numbers(text)
    return numbers[-1] if numbers else None


def to_decimal(text: object) -> Decimal | None:
    """Parse a written number ("1,234", "$5", "-0.50", " 72 ") exactly; None if it is not one.

    Thousands separators, a currency "$" and surrounding spaces are ignored; exponents,
    "inf" and "nan" are refused, so every result is finite and exact.
    """
    s = normalize_minus(as_text(text)).strip().replace(",", "").replace("$", "").replace(" ", "")
    if not s or not re.fullmatch(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)", s):
        return None
    try:
        return Decimal(s)
    except InvalidOperation:  # pragma: no cover - the regex admits only valid literals
        return None


def numbers_equal(a: object, b: object) -> bool:
    """Exact numeric equality of two written numbers ("1,000.0" == "1000"); False if either is not one."""
    x, y = to_decimal(a), to_decimal(b)
    return x is not None and y is not None and x == y


def _skip_braced(text: str, open_at: int) -> int | None:
    """Index just past the "}" matching the "{" at ``open_at``; None when unbalanced.

    ``\\{`` and ``\\}`` (literal braces in LaTeX) do not count; ``\\\\`` (a line break) is
    skipped as a unit, so the brace after it does.
    """
    depth = 0
    for tok in _BRACE_TOKEN_RE.finditer(text, open_at):
        ch = tok.group(0)
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return tok.end()
    return None


def _box_argument(text: str, after: int) -> tuple[str | None, int]:
    """The argument of a box command ending at ``after`` and where to search on.

    Returns ``(argument, next_pos)``: "{...}" or, TeX-style, "\\boxed 5$" (up to "$" or the line
    end); ``(None, after)`` when there is no argument ("\\boxed$"), ``(None, -1)`` when the
    "{" is never closed.
    """
    i = after
    while i < len(text) and text[i] in " \t":
        i += 1
    if i < len(text) and text[i] == "{":
        end = _skip_braced(text, i)
        return (None, -1) if end is None else (text[i + 1 : end - 1], end)
    if i == after:  # "\boxed5" or "\boxed$": not an argument we can trust
        return None, after
    match = _TEX_ARG_RE.match(text, i)
    arg = match.group(0).strip()
    return (arg or None), match.end()


def last_boxed(text: object) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (``\\boxed 5`` too), or None.

    Braces nest (``\\boxed{\\frac{1}{2}}`` -> ``\\frac{1}{2}``); when the last box is not closed
    (a truncated response) the result is None rather than an earlier box, because the final
    answer is what is judged. A box wrapping only another box is unwrapped.
    """
    s = as_text(text)
    # Walk the top-level boxes left to right, skipping over each one's argument, so that a box
    # nested in another ("\boxed{\boxed{5}+1}") is never mistaken for the final answer.
    content = None
    pos = 0
    while (m := _BOX_COMMAND_RE.search(s, pos)) is not None:
        content, pos = _box_argument(s, m.end())
        if content is None and pos < 0:  # unclosed: it swallows the rest of the response
            return None
    for _ in range(_MAX_BOX_UNWRAP):
        if content is None:
            break
        # Unwrap only a box that is the whole content ("\boxed{\boxed{5}}", not "\boxed{5}+1").
        inner = whole_box(content)
        if inner is None:
            break
        content = inner
    return content.strip() if content is not None else None


def whole_box(text: str) -> str | None:
    """The content of ``text`` when all of it is one ``\\boxed{...}``/``\\fbox{...}``; else None."""
    stripped = text.strip()
    command = _BOX_COMMAND_RE.match(stripped)
    brace = stripped.find("{", command.end()) if command else -1
    if brace < 0 or stripped[command.end() : brace].strip() or _skip_braced(stripped, brace) != len(stripped):
        return None
    return stripped[brace + 1 : -1]


def last_answer_tag(text: object) -> str | None:
    """Content of the last ``<answer>...</answer>`` pair, stripped, or None."""
    s = as_text(text)
    end = s.rfind("</answer>")
    start = s.rfind("<answer>", 0, end) if end >= 0 else -1
    return s[start + len("<answer>") : end].strip() if start >= 0 else None


def answer_after_marker(text: object, marker: str) -> str | None:
    """What follows the last ``marker`` (e.g. "Answer:", "####") up to the end of its line, or None.

    The marker is matched case-insensitively; a trailing period and surrounding spaces are dropped.
    """
    s = as_text(text)
    if not marker:
        return None
    last = None
    for last in re.finditer(re.escape(marker), s, flags=re.IGNORECASE):
        pass
    if last is None:
        return None
    rest = s[last.end() :].split("\n", 1)[0].strip()
    if rest.endswith("."):
        rest = rest[:-1].rstrip()
    return rest or None
