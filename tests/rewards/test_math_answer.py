"""Answer extraction, the math normaliser, and math-verify with its fallbacks."""

from __future__ import annotations

import time

import pytest

from verl.rewards import math_answer
from verl.rewards.extract import answer_after_marker, find_numbers, last_answer_tag, last_boxed, to_decimal
from verl.rewards.math_answer import math_equal, normalize_math_answer


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so \boxed{\frac{1}{2}} and \boxed{3}", "3"),
        (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{\sqrt{2}}{2}"),
        (r"\boxed{\boxed{5}}", "5"),
        (r"\boxed{\boxed{5}+1}", r"\boxed{5}+1"),  # a box inside an answer is not the answer
        (r"\fbox{x}", "x"),
        (r"\boxed 5$ ok", "5"),
        (r"\boxed{ 12 }", "12"),
        (r"\boxed{12", None),
        (r"\boxed{3} then \boxed{12", None),  # the final box is truncated
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),  # escaped braces do not count
        (r"\boxed{a\\}", "a\\\\"),  # "\\" is a line break, the brace after it closes the box
        (r"\boxedfoo{3}", None),
        (r"\boxed{4} and \boxed$", None),
        ("no box", None),
        ("", None),
        (None, None),
        (b"\\boxed{7}", "7"),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_numbers_tags_and_markers():
    text = "5-3 is 2, -4 and 1,234,567 and 1,2,3 and $1,000.50. x2 \u22127 .5 1,2345 72."
    assert find_numbers(text) == ["5", "3", "2", "-4", "1,234,567", "1", "2", "3", "1,000.50", "2", "-7", ".5", "1", "2345", "72"]
    assert last_answer_tag("<answer> a </answer> <answer>b</answer>") == "b"
    assert last_answer_tag("<answer>x") is None
    assert answer_after_marker("Answer: 5\nANSWER:  72.  \nmore", "answer:") == "72"
    assert answer_after_marker("no marker", "Answer:") is None
    assert to_decimal("$1,234.50") == to_decimal("1234.5")
    for not_a_number in ("1e5", "nan", "inf", "", "1.2.3", None):
        assert to_decimal(not_a_number) is None


@pytest.mark.timeout(60)
def test_extraction_is_linear_on_adversarial_input():
    # Quadratic scans would take hours on these; the timeout marker is the assertion.
    last_boxed("\\boxed{" * 200_000)
    last_boxed("\\boxed{1}" * 200_000)
    last_boxed("\\boxed{" * 100_000 + "}" * 100_000)
    last_answer_tag("<answer>" * 200_000)
    find_numbers("1," * 500_000)
    normalize_math_answer("\\text{" * 100_000)


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (r"\frac{1}{2}", "1/2"),
        ("0.5", "1/2"),
        (".5", "1/2"),
        ("2/4", "1/2"),
        (r"\dfrac12", "1/2"),
        (r"-\frac{3}{6}", "-1/2"),
        ("5.000", "5"),
        ("1,000", "1000"),
        ("1{,}000", "1000"),
        (r"5\text{ cm}", "5"),
        (r"\text{Tuesday}", "Tuesday"),
        (r"72^\circ", "72"),
        (r"72^{\circ}", "72"),
        ("72\u00b0", "72"),
        (r"50\%", "50"),
        (r"\$18.90", "189/10"),
        ("x = 3", "3"),
        ("y=2x+3", "2x+3"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"\sqrt2", r"\sqrt{2}"),
        (r"\boxed{7}", "7"),
        ("$7$.", "7"),
        ("1/0", "1/0"),  # not a number: left as text, never a crash
        ("", ""),
    ],
)
def test_normalizer(answer, expected):
    assert normalize_math_answer(answer) == expected


@pytest.mark.parametrize(
    ("a", "b", "normaliser_only"),
    [
        (r"\frac{1}{2}", "0.5", True),
        (r"\frac{1}{2}", "1/2", True),
        (r"\dfrac{1}{2}", r"\frac12", True),
        (r"5 \text{ cm}", "5", True),
        (r"\sqrt{2}/2", r"\frac{1}{\sqrt{2}}", False),
        (r"\{1,2\}", r"\{2,1\}", False),
        ("10^{400}", "1" + "0" * 400, False),
        (r"x^2+2x+1", r"(x+1)^2", False),
    ],
)
def test_equivalences(a, b, normaliser_only):
    assert math_equal(a, b) and math_equal(b, a)
    assert math_equal(a, b, use_math_verify=False) is normaliser_only


@pytest.mark.parametrize(("a", "b"), [("2", "3"), (r"\frac{1}{3}", "0.33"), ("x", "y"), ("", "0"), (None, "0")])
def test_non_equivalences(a, b):
    assert not math_equal(a, b)


def test_math_verify_failure_falls_back_to_the_normaliser(monkeypatch):
    def broken():
        raise RuntimeError("math-verify exploded")

    math_answer._parse_for_verify.cache_clear()
    monkeypatch.setattr(math_answer, "_math_verify", broken)
    assert math_answer.math_verify_equal("1", "1", timeout_s=1.0) is None
    assert math_equal(r"\frac{1}{2}", "0.5")  # the normaliser still decides
    assert not math_equal(r"\sqrt{2}/2", r"\frac{1}{\sqrt{2}}")  # symbolic: needs math-verify


def test_math_verify_missing_falls_back(monkeypatch):
    def missing():
        raise ImportError("No module named 'math_verify'")

    monkeypatch.setattr(math_answer, "_math_verify", missing)
    assert math_answer.math_verify_equal("1", "1", timeout_s=1.0) is None
    assert math_equal(r"\dfrac{1}{2}", "1/2")


@pytest.mark.timeout(30)
def test_math_verify_timeout_gives_a_verdict(monkeypatch):
    real = math_answer._math_verify()

    class SlowMathVerify:
        parse = real.parse
        LatexExtractionConfig = real.LatexExtractionConfig
        ExprExtractionConfig = real.ExprExtractionConfig

        @staticmethod
        def verify(*args, **kwargs):
            while True:  # a sympy comparison that never ends, in Python code the timer can stop
                time.sleep(0.01)

    monkeypatch.setattr(math_answer, "_math_verify", lambda: SlowMathVerify)
    start = time.monotonic()
    assert math_answer.math_verify_equal(r"\sqrt{2}", r"\sqrt{3}", timeout_s=0.3) is None
    assert not math_equal(r"\sqrt{2}", r"\sqrt{3}", timeout_s=0.3)
    elapsed = time.monotonic() - start
    # Two 0.3 s limits plus parsing (under a second quiet; room for a loaded machine): a broken limit
    # would spin until the test's timeout.
    assert elapsed < 30.0
