"""A table of real-looking responses per data source, scored through the registry."""

from __future__ import annotations

import json

import numpy as np
import pytest

from verl.rewards import default_compute_score, format_arithmetic_answer, gsm8k
from verl.rewards import arithmetic as arithmetic_scorer
from verl.rewards.countdown import InvalidEquation, evaluate_equation, parse_ground_truth

BIG = "1" + "0" * 400  # 10**400: more digits than any float, fewer than int()'s 4300-digit cap
HUGE = "9" * 5000  # more digits than int() parses by default: compared as exact decimals

GSM8K_CASES = [
    # (response, ground truth, expected score)
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether 48+24 = 72.\n#### 72", "72", 1.0),
    ("She pays 1,000 + 80.\n#### $1,080", "1080", 1.0),
    ("#### 1,080", "1,080", 1.0),
    ("The total is 72.00 dollars.\n#### 72.00", "72", 1.0),
    ("#### 71", "72", 0.0),
    ("The answer is 72.", "72", 0.0),  # strict: no "####" marker
    ("#### 5\nWait, I made a mistake.\n#### 72", "72", 1.0),  # the last marker counts
    ("#### 72\nWait, no.\n#### 5", "72", 0.0),
    ("#### \u22123", "-3", 1.0),  # Unicode minus
    ("#### -3", "3", 0.0),
    (f"#### {BIG}", BIG, 1.0),
    (f"#### {BIG}", BIG + "1", 0.0),
    ("#### \uff17\uff12", "72", 0.0),  # fullwidth digits are not read as numbers
    ("#### seventy-two", "72", 0.0),
    ("####", "72", 0.0),
    ("", "72", 0.0),
    (None, "72", 0.0),
]


@pytest.mark.parametrize("data_source", ["openai/gsm8k", "gsm8k"])
@pytest.mark.parametrize(("response", "ground_truth", "expected"), GSM8K_CASES)
def test_gsm8k_strict_table(data_source, response, ground_truth, expected):
    actual = default_compute_score(data_source, response, ground_truth)
    assert actual == expected


@pytest.mark.parametrize(
    ("response", "expected_answer"),
    [
        ("so she has 72 apples.", "72"),
        ("1,234 apples then 5 more", "5"),
        ("it costs $1,234.", "1,234"),
        ("5-3 = 2", "2"),
        ("the change is -3", "-3"),
        ("x = .5", ".5"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_gsm8k_flexible_extraction(response, expected_answer):
    assert gsm8k.extract_solution(response, method="flexible") == expected_answer


def test_gsm8k_format_score_and_score_params():
    assert gsm8k.compute_score("#### 71", "72", format_score=0.1) == 0.1  # answered, wrong
    assert gsm8k.compute_score("no marker", "72", format_score=0.1) == 0.0  # nothing to judge
    assert gsm8k.compute_score("#### 72", "72", score=2.0) == 2.0
    assert gsm8k.compute_score("so 72", "72", method="flexible") == 1.0
    assert gsm8k.compute_score("so 72", "72", method="strict") == 0.0
    with pytest.raises(ValueError, match="method='loose'"):
        gsm8k.compute_score("#### 72", "72", method="loose")


MATH_CASES = [
    (r"The sum is $\frac{1}{2}$, so the answer is $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}", 1.0),
    (r"$\boxed{0.5}$", r"\frac{1}{2}", 1.0),
    (r"$\boxed{\dfrac{1}{2}}$", "1/2", 1.0),
    (r"$\boxed{\tfrac12}$", r"\frac{1}{2}", 1.0),
    (r"First \boxed{1}, then on reflection \boxed{2}.", "2", 1.0),  # the last box counts
    (r"First \boxed{1}, then on reflection \boxed{2}.", "1", 0.0),
    (r"\boxed{\boxed{7}}", "7", 1.0),
    (r"\fbox{7}", "7", 1.0),
    (r"The answer is \boxed 7$.", "7", 1.0),
    (r"$\boxed{5 \text{ cm}}$", "5", 1.0),
    (r"$\boxed{72^\circ}$", "72", 1.0),
    (r"$\boxed{50\%}$", "50", 1.0),
    (r"$\boxed{\$18.90}$", "18.90", 1.0),
    (r"$\boxed{x = 3}$", "3", 1.0),
    (r"$\boxed{\sqrt{2}/2}$", r"\frac{\sqrt{2}}{2}", 1.0),  # needs math-verify (symbolic)
    (r"$\boxed{\frac{1}{\sqrt{2}}}$", r"\frac{\sqrt{2}}{2}", 1.0),
    (r"$\boxed{\{2, 1\}}$", r"\{1,2\}", 1.0),
    (r"$\boxed{\left( 3, \frac{\pi}{2} \right)}$", r"\left( 3, \frac{\pi}{2} \right)", 1.0),
    (rf"$\boxed{{10^{{400}}}}$", BIG, 1.0),
    (r"$\boxed{\text{(C)}}$", r"\text{(C)}", 1.0),
    (r"$\boxed{3}$", "4", 0.0),
    (r"$\boxed{\frac{1}{3}}$", "0.33", 0.0),
    (r"The answer is $\frac{1}{2}$.", r"\frac{1}{2}", 0.0),  # no box
    (r"\boxed{\frac{1}{2}", r"\frac{1}{2}", 0.0),  # truncated: the last box never closes
    (r"\boxed{3} and finally \boxed{4", "3", 0.0),
    (r"\boxed{}", "0", 0.0),
    ("\\boxed{\u03c0}", r"\pi", 1.0),  # Unicode pi
    ("", "1", 0.0),
    (None, "1", 0.0),
]


@pytest.mark.parametrize(("response", "ground_truth", "expected"), MATH_CASES)
def test_math_table(response, ground_truth, expected):
    for data_source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"):
        actual = default_compute_score(data_source, response, ground_truth)
        assert actual == expected, data_source


DAPO_CASES = [
    ("Let me compute... so the total is 204.\nAnswer: 204", "204", 1.0),
    ("Answer: 204.", "204", 1.0),
    (r"Answer: $\boxed{204}$", "204", 1.0),
    ("Answer: 1/2", r"\frac{1}{2}", 1.0),
    ("Answer: 7\n...wait.\nAnswer: 204", "204", 1.0),
    ("Answer: 203", "204", -1.0),
    ("the answer is 204", "204", -1.0),  # no "Answer:" line and no box
    (r"so the total is $\boxed{204}$.", "204", 1.0),  # no "Answer:" line: the last box (as the reference)
    (r"first $\boxed{7}$, then $\boxed{204}$", "204", 1.0),
    (r"so the total is $\boxed{203}$.", "204", -1.0),
    ("Answer : 204", "204", 1.0),  # spaces and a line break may surround the colon, as in the reference
    ("Answer:\n204", "204", 1.0),
    ("", "204", -1.0),
]


@pytest.mark.parametrize("data_source", ["math_dapo", "math", "aime24", "aime_2025"])
@pytest.mark.parametrize(("response", "ground_truth", "expected"), DAPO_CASES)
def test_dapo_math_table(data_source, response, ground_truth, expected):
    actual = default_compute_score(data_source, response, ground_truth)
    assert actual["score"] == expected
    assert actual["acc"] is (expected > 0)
    assert isinstance(actual["pred"], str)


COUNTDOWN_GT = {"target": 21, "numbers": [1, 2, 5, 6]}
COUNTDOWN_CASES = [
    ("<think>6-2=4, 4*5=20, 20+1=21</think>\n<answer>(6 - 2) * 5 + 1</answer>", COUNTDOWN_GT, 1.0),
    ("<answer>(6-2)*5+1 = 21</answer>", COUNTDOWN_GT, 1.0),  # a trailing "= target" is allowed
    ("<answer>1 + 5 * (6 - 2)</answer>", COUNTDOWN_GT, 1.0),
    ("<answer>(6-2)*5+1 \u00d7 1</answer>", COUNTDOWN_GT, 0.1),  # 1 used twice
    ("<answer>6*5-6-2-1</answer>", COUNTDOWN_GT, 0.1),  # 6 reused: 21, but breaks the rules
    ("<answer>(6-2)*5</answer>", COUNTDOWN_GT, 0.1),  # 1 missing (and 20)
    ("<answer>5*6</answer>", {"target": 30, "numbers": [1, 5, 6]}, 0.1),  # hits 30 but 1 unused
    ("<answer>(4+5)/(3-3)</answer>", {"target": 4, "numbers": [3, 3, 4, 5]}, 0.1),  # divides by 0
    ("<answer>(6-2*5+1</answer>", COUNTDOWN_GT, 0.1),  # unbalanced parenthesis
    ("<answer>__import__('os').system('true')</answer>", COUNTDOWN_GT, 0.1),  # code, not arithmetic
    ("<answer>6**2-15</answer>", {"target": 21, "numbers": [6, 2, 15]}, 0.1),  # ** is not allowed
    ("<answer>6//2</answer>", {"target": 3, "numbers": [6, 2]}, 0.1),  # // is not allowed
    ("<answer>-1+6*5-2*4</answer>", {"target": 21, "numbers": [1, 6, 5, 2, 4]}, 0.1),  # unary minus
    ("<answer>2.5*2</answer>", {"target": 5, "numbers": [2, 2]}, 0.1),  # non-integer literal
    ("<answer>1_0+1</answer>", {"target": 11, "numbers": [10, 1]}, 0.1),  # "1_0" is Python, not a number
    ("<answer>6/4*2</answer>", {"target": 3, "numbers": [6, 4, 2]}, 1.0),  # exact fractions: 3/2*2
    ("<answer>1/3+1/3+1/3</answer>", {"target": 1, "numbers": [1, 3, 1, 3, 1, 3]}, 1.0),  # 1/3 thrice is exactly 1
    (f"<answer>{BIG}+1</answer>", {"target": int(BIG) + 1, "numbers": [int(BIG), 1]}, 1.0),
    ("<answer>5+5</answer> then <answer>(6-2)*5+1</answer>", COUNTDOWN_GT, 1.0),  # the last pair counts
    ("<answer>(6-2)*5+1</answer> then <answer>5+5</answer>", COUNTDOWN_GT, 0.1),
    ("<answer></answer>", COUNTDOWN_GT, 0.1),
    ("(6 - 2) * 5 + 1", COUNTDOWN_GT, 0.0),  # no answer tags: no format credit either
    ("<answer>(6-2)*5+1", COUNTDOWN_GT, 0.0),  # unclosed tag
    ("", COUNTDOWN_GT, 0.0),
    (None, COUNTDOWN_GT, 0.0),
]


@pytest.mark.parametrize(("response", "ground_truth", "expected"), COUNTDOWN_CASES)
def test_countdown_table(response, ground_truth, expected):
    assert default_compute_score("countdown", response, ground_truth) == expected


def test_countdown_ground_truth_forms():
    numpy_gt = {"target": np.int64(21), "numbers": np.array([1, 2, 5, 6])}  # as read from parquet
    json_gt = json.dumps(COUNTDOWN_GT)
    for gt in (numpy_gt, json_gt):
        assert default_compute_score("countdown", "<answer>(6-2)*5+1</answer>", gt) == 1.0
    for bad in ({"target": 21}, "not json", {"target": "x", "numbers": [1]}, None):
        with pytest.raises(ValueError, match="countdown ground_truth"):
            parse_ground_truth(bad)


def test_countdown_evaluator_rejects_long_and_deep_input():
    with pytest.raises(InvalidEquation, match="longer than"):
        evaluate_equation("1+" * 400 + "1")
    # Within the cap the deepest nestings still evaluate (no RecursionError reaches the caller).
    assert evaluate_equation("(" * 200 + "1" + ")" * 200) == (1, [1])
    assert evaluate_equation("1+" * 249 + "1") == (250, [1] * 250)
    assert evaluate_equation("(((1)))+2") == (3, [1, 2])


ARITHMETIC_CASES = [
    ("123+456 = 579\nAnswer: 579", "579", 1.0),
    ("Answer: 579.", "579", 1.0),
    ("answer:579", "579", 1.0),  # marker is case-insensitive, space optional
    ("Answer: 579 (because 123+456)", "579", 1.0),  # the first number after the marker
    ("#### 579", "579", 1.0),
    ("579", "579", 1.0),  # no marker: the last integer
    ("123+456 is 579", "579", 1.0),
    ("I first thought 578.\nAnswer: 579", "579", 1.0),
    ("Answer: 580\nActually it is 579", "579", 0.0),  # the marker wins over a later number
    ("Answer: 578", "579", 0.0),
    ("Answer: -12", "-12", 1.0),
    ("Answer: \u221212", "-12", 1.0),
    ("Answer: 1,234", "1234", 1.0),
    ("Answer: 579.5", "579", 0.0),
    ("Answer: 579.0", "579", 0.0),  # integers only
    ("Answer: five hundred", "500", 0.0),
    (f"Answer: {HUGE}", HUGE, 1.0),
    (f"Answer: {HUGE}", HUGE[:-1] + "8", 0.0),
    ("", "579", 0.0),
    (None, "579", 0.0),
]


@pytest.mark.parametrize(("response", "ground_truth", "expected"), ARITHMETIC_CASES)
def test_arithmetic_table(response, ground_truth, expected):
    assert default_compute_score("verl/arithmetic", response, ground_truth) == expected


@pytest.mark.parametrize("value", [0, 7, -5, 579, 10**30])
def test_arithmetic_canonical_answer_round_trips(value):
    response = f"The result is {value}.\n" + format_arithmetic_answer(value)
    assert response.endswith(f"{arithmetic_scorer.ANSWER_PREFIX} {value}")
    assert default_compute_score("verl/arithmetic", response, str(value)) == 1.0
    assert default_compute_score("verl/arithmetic", response, str(value + 1)) == 0.0


def test_arithmetic_records_from_the_data_task_score_one():
    """The data helper's generated records, answered with their reference responses, score 1."""
    tasks = pytest.importorskip("verl.data.tasks.arithmetic")
    train, _ = tasks.generate_splits(train=20, val=0, digits=3, ops=("+", "-", "*"), seed=1)
    for record in train:
        response = record["extra_info"]["answer"]
        ground_truth = record["reward_model"]["ground_truth"]
        assert default_compute_score(record["data_source"], response, ground_truth) == 1.0
        assert default_compute_score(record["data_source"], "Answer: 0.5", ground_truth) == 0.0


GEO3K_CASES = [
    (r"<think>The angles add to 180.</think> So $\boxed{30}$.", "30", 1.0),
    (r"So $\boxed{30}$.", "30", 0.9),  # right answer, no think block
    (r"<think>hmm</think> $\boxed{40}$", "30", 0.1),  # layout only
    ("", "30", 0.0),
]


@pytest.mark.parametrize(("response", "ground_truth", "expected"), GEO3K_CASES)
def test_geometry3k_table(response, ground_truth, expected):
    # 0.9 * accuracy + 0.1 * layout: sums of binary floats, so compare to 1e-12
    assert default_compute_score("hiyouga/geometry3k", response, ground_truth) == pytest.approx(expected, abs=1e-12)
