"""Countdown: combine the given numbers with + - * / and parentheses to hit a target.

The response puts its equation in ``<answer>...</answer>`` (the last pair counts), e.g.
``<answer>(6 - 2) * 5 + 1</answer>`` for numbers [1, 2, 5, 6] and target 21. A trailing
``= 21`` is allowed and ignored (the left-hand side is what is judged).

Rules checked, without ``eval``: the equation is parsed with ``ast`` and only integer
literals, the binary operators ``+ - * /`` and parentheses are accepted (no unary minus,
no ``**``, ``//``, names or calls); every given number is used exactly once (as a multiset);
the value, computed exactly with fractions, equals the target. Division by zero makes the
equation invalid.

The ground truth is ``{"target": int, "numbers": [int, ...]}`` (a JSON string of it, or
numpy arrays inside it as read from parquet, are accepted too).
"""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from fractions import Fraction

from verl.rewards.extract import last_answer_tag, normalize_minus

# Longer equations are refused before parsing (bounds ast's work and recursion depth); a
# real one with a handful of numbers is a few dozen characters.
MAX_EQUATION_CHARS = 500

_ALLOWED_CHARS_RE = re.compile(r"^[0-9+\-*/().\s]*$")
_OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


class InvalidEquation(ValueError):
    """The equation breaks the countdown rules (syntax, operators, numbers, division by zero)."""


def parse_ground_truth(ground_truth: object) -> tuple[Fraction, list[int]]:
    """``(target, numbers)`` from a countdown ground truth; ValueError naming what is wrong."""
    gt = ground_truth
    if isinstance(gt, (str, bytes)):
        try:
            gt = json.loads(gt)
        except json.JSONDecodeError as exc:
            raise ValueError(f"countdown ground_truth {ground_truth!r:.200} is not JSON: {exc}") from exc
    if not hasattr(gt, "get") or gt.get("target") is None or gt.get("numbers") is None:
        raise ValueError(
            f"countdown ground_truth must be a mapping with 'target' and 'numbers', got {ground_truth!r:.200}"
        )
    try:
        target = Fraction(int(gt["target"]))
        numbers = [int(n) for n in list(gt["numbers"])]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"countdown ground_truth has non-integer target/numbers: {ground_truth!r:.200}") from exc
    return target, numbers


def evaluate_equation(equation: str) -> tuple[Fraction, list[int]]:
    """Exact value of ``equation`` and the integer literals it uses; ``InvalidEquation`` otherwise."""
    equation = normalize_minus(equation).replace("\u00d7", "*").replace("\u00f7", "/")
    if "=" in equation:
        equation = equation.split("=", 1)[0]
    if len(equation) > MAX_EQUATION_CHARS:
        raise InvalidEquation(f"equation longer than {MAX_EQUATION_CHARS} characters")
    if not equation.strip() or not _ALLOWED_CHARS_RE.match(equation):
        raise InvalidEquation("only digits, + - * /, parentheses and spaces are allowed")
    try:
        tree = ast.parse(equation.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise InvalidEquation(f"not an arithmetic expression: {type(exc).__name__}") from exc
    used: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise InvalidEquation("division by zero")
            return _OPS[type(node.op)](left, right)
        # bool is an int subclass; the character filter already excludes True/False.
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        raise InvalidEquation(f"{type(node).__name__} is not allowed (only + - * / on the given numbers)")

    try:
        value = walk(tree.body)
    except RecursionError as exc:
        raise InvalidEquation("expression nested too deeply") from exc
    return value, used


def compute_score(
    solution_str: object,
    ground_truth: object,
    extra_info: dict | None = None,
    *,
    format_score: float = 0.1,
    score: float = 1.0,
) -> float:
    """``score`` for a valid equation hitting the target, ``format_score`` for an equation in
    ``<answer>`` tags that is invalid or misses, 0.0 with no ``<answer>`` at all (as TinyZero)."""
    target, numbers = parse_ground_truth(ground_truth)
    equation = last_answer_tag(solution_str)
    if equation is None:
        return 0.0
    try:
        value, used = evaluate_equation(equation)
    except InvalidEquation:
        return float(format_score)
    if Counter(used) != Counter(numbers):
        return float(format_score)
    return float(score) if value == target else float(format_score)
