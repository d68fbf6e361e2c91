"""Our scorers against the reference verl 0.9.1's, on a corpus of realistic answers.

``data/reference_scores.json`` holds 234 responses across GSM8K, MATH, DAPO/AIME, Numina and
Geometry3K,
each with ``reference_score``: what the reference wheel's own ``default_compute_score``
returned for it, computed once, offline, with ``pip download --no-deps verl==0.9.1`` (the
reference is never imported here), and ``correct``: our label of whether the response's final
answer is right.

- ``rule_scoring=reference`` must give exactly the reference's score on every case.
- The default (lenient) scorers must give the reference's score too, except on the cases in
  ``DELIBERATE_DIFFERENCES``: there they accept a right answer the reference rejects
  ("lenient"), or reject a wrong one it accepts ("strict"), or give Geometry3K's layout bonus
  where the reference does not ("layout"). The same list is in docs/rewards.md.
"""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest

from tests.rewards.conftest import CharTokenizer, make_batch
from verl.config import from_dict
from verl.config.schema import PPOConfig
from verl.rewards import (
    RewardManager,
    default_compute_score,
    reference_compute_score,
    reward_manager_from_config,
)
from verl.rewards.reference import prime_compute_score, reference_data_source

CORPUS_PATH = os.path.join(os.path.dirname(__file__), "data", "reference_scores.json")
with open(CORPUS_PATH, encoding="utf-8") as _f:
    CORPUS = json.load(_f)["cases"]
BY_ID = {case["id"]: case for case in CORPUS}

# Every case where our default scorer and the reference disagree, and why.
LENIENT, STRICT, LAYOUT = "lenient", "strict", "layout"
DELIBERATE_DIFFERENCES: dict[str, tuple[str, str]] = {
    # GSM8K: we compare numbers, read the whole response, and allow the marker without its space
    "gsm_no_space": (LENIENT, "'####72': the reference needs '#### ' with one space"),
    "gsm_dollar": (LENIENT, "'#### $50': a currency sign after the marker"),
    "gsm_decimal_zero": (LENIENT, "'9.00' is 9 (the reference compares strings)"),
    "gsm_trailing_period": (LENIENT, "'72.' is 72"),
    "gsm_long_marker_early": (LENIENT, "the marker is read anywhere, not only in the last 300 characters"),
    "gsm_leading_zero": (LENIENT, "'072' is 72"),
    "gsm_unicode_minus": (LENIENT, "a Unicode minus sign reads as '-'"),
    "gsm_newline_after_marker": (LENIENT, "a line break between '####' and the number"),
    "gsm_dot_decimal": (LENIENT, "'.5' is 0.5"),
    "gsm_commas_bad_grouping": (STRICT, "'10,00' is not 1000 (the reference drops every comma)"),
    # MATH: math_equal (normaliser + math-verify) on the last box, besides the Hendrycks normaliser
    "math_decimal_quarter": (LENIENT, "0.25 is 1/4 (the reference knows only 0.5 = 1/2)"),
    "math_float_int": (LENIENT, "2.0 is 2"),
    "math_sqrt_equiv": (LENIENT, "\\sqrt{8} is 2\\sqrt{2} (symbolic)"),
    "math_poly_order": (LENIENT, "1+x^2 is x^2+1 (symbolic)"),
    "math_units_text_nospace": (LENIENT, "a trailing \\text{cm} is a unit even without a space"),
    "math_var_eq_long_name": (LENIENT, "'xyz=3' is 3 (the reference drops only 1-2 character names)"),
    "math_set_order": (LENIENT, "a set of solutions in any order"),
    "math_fbox": (LENIENT, "\\fbox{5} is a box (the reference finds it, then rejects it)"),
    "math_boxed_space_then_brace": (LENIENT, "the last box counts; any '\\boxed ' makes the reference read that one"),
    "math_thousands": (LENIENT, "1,000 is 1000"),
    "math_thousands_gt_commas": (LENIENT, "1000 is 1,000"),
    "math_text_answer_plain": (LENIENT, "\\text{circle} is circle"),
    "math_neg_frac_numerator": (LENIENT, "\\frac{-3}{4} is -\\frac{3}{4}"),
    "math_unreduced": (LENIENT, "\\frac{2}{4} is 1/2"),
    "math_mixed_number": (LENIENT, "2\\frac{1}{2} is 5/2 (math-verify reads the mixed number)"),
    "math_inline_dollar_in_box": (LENIENT, "'$' inside the box is dropped"),
    "math_trailing_period_in_box": (LENIENT, "'5.' is 5"),
    "math_scientific": (LENIENT, "1.5\\times10^3 is 1500"),
    "math_box_inside_answer": (STRICT, "\\boxed{\\boxed{5}+1} is 6; the reference reads the inner box"),
    "math_boxed_space_earlier_wrong": (STRICT, "the last box (4) is the answer; the reference reads an earlier '\\boxed 5'"),
    # DAPO / AIME: the whole response, math_equal on the answer, the box after spaces too
    "dapo_final_answer_phrase": (LENIENT, "Minerva's 'Final Answer: The final answer is 34. ...' reads 34"),
    "dapo_answer_decimal_vs_frac": (LENIENT, "0.5 is \\frac{1}{2}"),
    "dapo_answer_float_int": (LENIENT, "34.0 is 34"),
    "dapo_answer_trailing_period": (LENIENT, "'Answer: 34.' is 34"),
    "dapo_box_long_tail": (LENIENT, "a box anywhere, not only in the last 100 characters"),
    "dapo_box_spaced": (LENIENT, "\\boxed{ 34 } is 34 (the reference compares the box raw)"),
    "dapo_box_dfrac": (LENIENT, "\\dfrac{1}{2} is \\frac{1}{2}"),
    "dapo_box_units": (LENIENT, "a \\text{ dollars} unit in the box"),
    "dapo_answer_bold": (LENIENT, "'**Answer:** 34' is 34"),
    "dapo_answer_markdown_box": (LENIENT, "'Answer: \\boxed{34}.' is 34 (the period stops the reference's unboxing)"),
    "dapo_box_sqrt_equiv": (LENIENT, "\\sqrt{8} is 2\\sqrt{2}"),
    "aime_answer_leading_zero": (LENIENT, "070 is 70"),
    "aime_box_leading_zero": (LENIENT, "\\boxed{070} is 70"),
    "aime_box_expr": (LENIENT, "\\boxed{m+n=116} is 116"),
    "aime_box_space": (LENIENT, "'\\boxed {116}' is a box"),
    # Numina: math_equal and PRIME's grader, without PRIME's numeric leniency
    "num_box_unreduced": (LENIENT, "\\frac{6}{16} is 3/8 (PRIME refuses unreduced fractions)"),
    "num_two_solutions_order": (LENIENT, "a set of solutions in any order"),
    "num_sci": (LENIENT, "1.5\\times 10^{3} is 1500"),
    "num_log": (LENIENT, "\\log_2 8 is 3"),
    "num_box_percent_scale": (STRICT, "0.5 is not 50 (PRIME also accepts the ground truth / 100 or * 100)"),
    "num_box_pi_numeric": (STRICT, "12.566 is not 4\\pi (PRIME accepts within a relative 1e-4)"),
    "num_approx": (STRICT, "3.1416 is not \\pi"),
    # Geometry3K: math_equal besides mathruler's grader; the layout bonus allows leading spaces
    "geo_fbox": (LENIENT, "\\fbox{30} is a box (mathruler reads only \\boxed{)"),
    "geo_space_before_think": (LAYOUT, "white space before <think> keeps the 0.1 layout bonus"),
}


def _score(result) -> float:
    return float(result["score"] if isinstance(result, dict) else result)


def _accepts(score: float, family: str = "") -> bool:
    """Whether a score says the answer is right: 1.0 vs 0.0, DAPO's +1.0 vs -1.0, Geometry3K's
    0.9 x right + 0.1 x layout."""
    return score >= 0.9 if family == "geo3k" else score > 0


def _family_of(case) -> str:
    ds = case["data_source"]
    if "gsm8k" in ds:
        return "gsm8k"
    if ds == "hiyouga/geometry3k":
        return "geo3k"
    if ds.startswith("numina_"):
        return "numina"
    if ds.startswith("aime") or ds in ("math_dapo", "math", "math_dapo_reasoning"):
        return "dapo"
    return "math"


def test_corpus_covers_every_family():
    assert len(CORPUS) >= 150
    assert len(BY_ID) == len(CORPUS), "duplicate case ids"
    families = Counter(_family_of(c) for c in CORPUS)
    assert set(families) == {"gsm8k", "math", "dapo", "numina", "geo3k"}, families
    assert min(families[f] for f in ("gsm8k", "math", "dapo", "numina")) >= 30 and families["geo3k"] >= 20, families
    allowed = {"dapo": (1.0, -1.0), "geo3k": (0.0, 0.1, 0.9, 1.0)}
    for case in CORPUS:
        assert reference_data_source(case["data_source"]), case["id"]
        assert case["reference_score"] in allowed.get(_family_of(case), (1.0, 0.0)), case["id"]
    # each family has right answers the reference accepts and rejects, and wrong ones
    for family in families:
        kinds = {(c["correct"], _accepts(c["reference_score"], family)) for c in CORPUS if _family_of(c) == family}
        assert kinds >= {(True, True), (True, False), (False, False)}, family


@pytest.mark.parametrize("case", CORPUS, ids=[c["id"] for c in CORPUS])
def test_reference_mode_equals_the_reference(case):
    expected = case["reference_score"]
    actual = _score(reference_compute_score(case["data_source"], case["solution_str"], case["ground_truth"]))
    assert actual == expected


@pytest.mark.parametrize("case", CORPUS, ids=[c["id"] for c in CORPUS])
def test_default_mode_differs_only_where_listed(case):
    reference = case["reference_score"]
    actual = _score(default_compute_score(case["data_source"], case["solution_str"], case["ground_truth"]))
    if case["id"] not in DELIBERATE_DIFFERENCES:
        assert actual == reference
        return
    kind, why = DELIBERATE_DIFFERENCES[case["id"]]
    assert actual != reference, f"listed as a difference ({why}) but both give {actual}"
    family = _family_of(case)
    if kind == LENIENT:  # a right answer we accept and the reference rejects
        assert case["correct"] and _accepts(actual, family) and not _accepts(reference, family), why
    elif kind == STRICT:  # a wrong answer the reference accepts and we reject
        assert not case["correct"] and not _accepts(actual, family) and _accepts(reference, family), why
    else:  # the same verdict on the answer, and our layout bonus where the reference gives none
        assert _accepts(actual, family) == _accepts(reference, family), why
        assert actual - reference == pytest.approx(0.1), why  # 0.1 is the bonus; approx for 0.9 + 0.1


def test_default_accepts_every_right_answer_the_reference_accepts():
    missed = [
        c["id"]
        for c in CORPUS
        if c["correct"]
        and _accepts(c["reference_score"], _family_of(c))
        and not _accepts(_score(default_compute_score(c["data_source"], c["solution_str"], c["ground_truth"])), _family_of(c))
    ]
    assert missed == []


def test_the_listed_differences_are_corpus_cases():
    assert set(DELIBERATE_DIFFERENCES) <= set(BY_ID)


def test_dapo_box_without_answer_line_is_right_in_both_modes():
    # The reported bug: ours gave -1 to "\boxed{34}" with ground truth 34 and no "Answer:" line.
    for data_source in ("math_dapo", "aime24", "aime2025"):
        for scorer in (default_compute_score, reference_compute_score):
            result = scorer(data_source, r"so the total is $\boxed{34}$.", "34")
            assert result["score"] == 1.0 and result["acc"] is True, (data_source, scorer.__name__)


def test_reference_mode_never_runs_the_answer_as_python(monkeypatch):
    # The reference eval()s an answer holding \pi; we only evaluate arithmetic on number literals.
    monkeypatch.setattr("builtins.exit", lambda *a: pytest.fail("model output was executed"))
    assert prime_compute_score(r"$\boxed{__import__('builtins').exit()\pi}$", r"\pi") == 0.0
    assert prime_compute_score(r"$\boxed{2\pi}$", r"2\pi") == 1.0
    assert prime_compute_score(r"$\boxed{[1, 2]}$", r"\begin{pmatrix} 1 \ 2 \end{pmatrix}") == 1.0  # no eval
    assert prime_compute_score(r"$\boxed{[1, exit()]}$", r"\begin{pmatrix} 1 \ 2 \end{pmatrix}") == 0.0


def test_sources_without_a_reference_scorer_use_ours():
    assert reference_compute_score("verl/arithmetic", "Answer: 579", "579") == 1.0
    assert reference_compute_score("gsm8k", "#### 9.00", "9") == default_compute_score("gsm8k", "#### 9.00", "9")
    with pytest.raises(ValueError, match="no rule-based scorer for data_source='nope'"):
        reference_compute_score("nope", "x", "y")


def _some_cases(n_per_family: int = 4) -> list[dict]:
    picked: dict[str, list] = {}
    for case in CORPUS:
        if case["id"] in DELIBERATE_DIFFERENCES:
            picked.setdefault(_family_of(case), []).append(case)
    return [c for cases in picked.values() for c in cases[:n_per_family]]


@pytest.mark.parametrize("rule_scoring", ["lenient", "reference"])
def test_reward_manager_scores_by_rule_scoring(rule_scoring):
    cases = _some_cases()
    scorer = reference_compute_score if rule_scoring == "reference" else default_compute_score
    manager = RewardManager(CharTokenizer(), rule_scoring=rule_scoring)
    results = manager.score_texts(
        [c["solution_str"] for c in cases], [c["ground_truth"] for c in cases], [c["data_source"] for c in cases]
    )
    expected = [_score(scorer(c["data_source"], c["solution_str"], c["ground_truth"])) for c in cases]
    assert [r.score for r in results] == expected
    if rule_scoring == "reference":
        assert expected == [c["reference_score"] for c in cases]
    else:  # these cases are the listed differences, so the two modes really differ on them
        assert expected != [c["reference_score"] for c in cases]


def test_reward_manager_rejects_an_unknown_rule_scoring():
    with pytest.raises(ValueError, match="rule_scoring='strict' is not one of"):
        RewardManager(CharTokenizer(), rule_scoring="strict")


def test_config_field_reaches_the_manager():
    cases = _some_cases()
    for rule_scoring, scorer in (("lenient", default_compute_score), ("reference", reference_compute_score)):
        cfg = from_dict(PPOConfig, {"reward_model": {"rule_scoring": rule_scoring}})
        manager = reward_manager_from_config(cfg, CharTokenizer())
        assert manager.compute_score is scorer
        got = manager.score_texts(
            [c["solution_str"] for c in cases], [c["ground_truth"] for c in cases], [c["data_source"] for c in cases]
        )
        assert [r.score for r in got] == [_score(scorer(c["data_source"], c["solution_str"], c["ground_truth"])) for c in cases]
    assert PPOConfig().reward_model.rule_scoring == "lenient"
    with pytest.raises(Exception, match="did you mean 'reference'"):
        from_dict(PPOConfig, {"reward_model": {"rule_scoring": "refrence"}})


def test_reference_mode_through_a_batch():
    # The Batch path: token ids -> decoded text -> the reference's score on the last valid token.
    cases = _some_cases(2)
    batch = make_batch([c["solution_str"] for c in cases], [c["data_source"] for c in cases],
                       [c["ground_truth"] for c in cases])
    out = RewardManager(CharTokenizer(), rule_scoring="reference")(batch)
    expected = [c["reference_score"] for c in cases]
    # The batch holds float32: Geometry3K's 0.9 is 0.89999998 there (float32 rounding, <= 3e-8 here).
    assert out.scores.tolist() == pytest.approx(expected, abs=1e-7, rel=0)
    assert out.token_level_scores.sum(dim=1).tolist() == pytest.approx(expected, abs=1e-7, rel=0)
