"""Code scorers: agreement with the reference verl's scores on a corpus, per-test outcomes, and the
path through the reward manager's process pool."""

from __future__ import annotations

import json

import pytest

from tests.rewards.code_corpus import ADD, CALL, CASES, SUM_CRASH, SUM_SLOW
from verl.config.schema import SandboxConfig, SandboxLimitsConfig
from verl.rewards import RewardManager, default_compute_score, known_data_sources
from verl.rewards import code as code_rewards
from verl.sandbox import Sandbox, SandboxUnavailable, runner

# Short limits: the busy programs of the corpus run out of CPU time after a second (the CPU limit
# gives the verdict); the wall limit is far roomier so that a right program's start-up on a loaded
# machine never counts as a timeout (5 s was not: a suite run at load 16 on 2 cores took 5.4 s
# to run `print(1 / n)`).
LIMITS = SandboxLimitsConfig(wall_time_s=30.0, cpu_time_s=1.0, memory_mb=512, max_processes=16)


@pytest.fixture(autouse=True)
def small_sandbox(monkeypatch, tmp_path):
    config = SandboxConfig(limits=LIMITS, slots_dir=str(tmp_path / "slots"))
    try:
        if not Sandbox(config).confined:
            pytest.skip("bubblewrap cannot confine here")
    except (SandboxUnavailable, ValueError) as exc:  # no bwrap, or no interpreter nobody can read
        pytest.skip(f"no confinement on this machine ({exc}); tools/setup_env.sh installs bubblewrap as root")
    monkeypatch.setattr(runner, "_default", None)
    monkeypatch.setattr(runner, "_default_key", None)
    monkeypatch.delenv(runner.ENV_CONFIG, raising=False)  # restored after the test
    runner.configure(config)


def test_code_data_sources_are_registered():
    assert set(code_rewards.DATA_SOURCES) <= set(known_data_sources())


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_scores_agree_with_the_reference(case):
    data_source, response, ground_truth, expected = CASES[case]
    result = default_compute_score(data_source, response, ground_truth)
    # Scores are ratios of small test counts: equal up to float rounding of the division.
    assert result["score"] == pytest.approx(expected, abs=1e-12), result["tests"]
    assert result["num_tests"] == len(result["tests"])
    assert result["passed"] == sum(t["passed"] for t in result["tests"])


def test_every_tests_outcome_is_reported():
    crash = default_compute_score("apps", SUM_CRASH, ADD)
    assert [t["status"] for t in crash["tests"]] == ["runtime_error"] * 3
    assert "ZeroDivisionError" in crash["tests"][0]["stderr"]
    assert crash["acc"] == 0.0

    slow = default_compute_score("codecontests", SUM_SLOW, ADD)
    assert [t["status"] for t in slow["tests"]] == ["timeout", "not_run", "not_run"]

    partial = default_compute_score("codecontests", "a, b = map(int, input().split())\nprint(a - b)\n", ADD)
    assert [t["status"] for t in partial["tests"]] == ["wrong_answer", "passed", "wrong_answer"]
    assert partial["tests"][0]["output"] == "-1\n" and partial["tests"][0]["expected"] == "3\n"

    call = default_compute_score("taco", "def add_up(a, b):\n    return a * b\n", CALL)
    assert [t["status"] for t in call["tests"]] == ["wrong_answer", "not_run", "not_run"]
    assert call["tests"][0]["output"] == "2"


def test_output_comparison_rules():
    assert code_rewards.outputs_match("3 \n\n", "3")
    assert code_rewards.outputs_match("1\n  2\n3", ["1", "2", "3"])
    assert code_rewards.outputs_match("0.33333331\n", "0.3333333")  # within rtol 1e-5
    assert not code_rewards.outputs_match("0.334\n", "0.3333333")
    assert not code_rewards.outputs_match("1 2\n", "1  2")  # inner spaces count, as in the reference
    assert not code_rewards.outputs_match("nan\n", "0.0")


def test_bad_ground_truth_names_the_problem():
    with pytest.raises(ValueError, match="inputs"):
        code_rewards.parse_tests(json.dumps({"tests": []}))
    with pytest.raises(ValueError, match="not JSON"):
        code_rewards.parse_tests("{oops")
    with pytest.raises(ValueError, match="2 inputs but 1 outputs"):
        code_rewards.parse_tests({"inputs": ["1", "2"], "outputs": ["1"]})


def test_scoring_in_the_reward_managers_process_pool():
    """The pool's spawned workers run the programs under the configured sandbox and return the records."""
    manager = RewardManager(None, num_workers=1, timeout_s=60)
    try:
        right, wrong = CASES[0], CASES[2]
        results = manager.score_texts(
            [right[1], wrong[1]],
            [json.dumps(right[2]), json.dumps(wrong[2])],
            ["codecontests", "codecontests"],
        )
    finally:
        manager.close()
    assert [r.error for r in results] == [None, None]
    assert [r.score for r in results] == pytest.approx([1.0, 1 / 3])
    assert [t["status"] for t in results[1].extra["tests"]] == ["wrong_answer", "passed", "wrong_answer"]


def test_the_arithmetic_code_task_is_scored_by_running_its_program(tmp_path):
    """The tiny code task (tools/data/arithmetic.py --code, launch/grpo_code_tiny_cpu.sh): every
    reference program prints its answer in the sandbox (score 1); a program that prints another
    number, crashes or prints the expression's text scores 0, each with its test's outcome."""
    from verl.data import read_records
    from verl.data.tasks import arithmetic

    train, val = arithmetic.generate_splits(train=6, val=3, digits=2, ops=("+", "-", "*"), seed=2, code=True)
    for record in train + val:
        assert record["data_source"] == code_rewards.ARITHMETIC_CODE_DATA_SOURCE == "verl/arithmetic_code"
        truth = record["reward_model"]["ground_truth"]
        question = record["extra_info"]["question"]
        assert question.endswith(arithmetic.CODE_INSTRUCTION)
        expression = question.removeprefix("What is ").partition("?")[0]
        assert json.loads(truth) == {"inputs": [""], "outputs": [str(eval(expression))]}  # 2-digit integers only
        assert record["extra_info"]["answer"] == f"```python\nprint({expression})\n```"
        result = default_compute_score(record["data_source"], record["extra_info"]["answer"], truth)
        assert result["score"] == 1.0 and result["tests"][0]["status"] == "passed", result
    truth = val[0]["reward_model"]["ground_truth"]
    expression = val[0]["extra_info"]["question"].removeprefix("What is ").partition("?")[0]
    wrong = {
        "```python\nprint(0.5)\n```": "wrong_answer",
        "```python\nprint(1/0)\n```": "runtime_error",
        f"```python\nprint('{expression}')\n```": "wrong_answer",
    }
    for response, status in wrong.items():
        result = default_compute_score("verl/arithmetic_code", response, truth)
        assert result["score"] == 0.0 and result["tests"][0]["status"] == status, (response, result)
    with pytest.raises(ValueError, match="code or tool_traces"):
        arithmetic.generate_splits(train=1, val=1, digits=2, code=True, tool_traces=True)
    # The data maker writes the same records (--code).
    from tests.data.test_tools import run_tool

    run_tool("tools/data/arithmetic.py", "--code", "--out-dir", str(tmp_path), "--train", "6", "--val", "3",
             "--digits", "2", "--ops", "+-*", "--seed", "2")
    assert list(read_records(str(tmp_path / "test.parquet"))) == val
