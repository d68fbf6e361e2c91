"""The data_source registry and user reward functions loaded from files."""

from __future__ import annotations

import pickle
import textwrap

import pytest

from verl.rewards import (
    FileRewardFunction,
    default_compute_score,
    get_scorer,
    known_data_sources,
    load_custom_reward_fn,
    register_scorer,
)
from verl.rewards import registry


def test_reference_data_sources_are_registered():
    known = known_data_sources()
    for name in (
        "openai/gsm8k",
        "lighteval/MATH",
        "DigitalLearningGmbH/MATH-lighteval",
        "HuggingFaceH4/MATH-500",
        "math_dapo",
        "countdown",
        "verl/arithmetic",
        "aime*",
    ):
        assert name in known


def test_unknown_data_source_lists_the_known_ones():
    with pytest.raises(ValueError) as info:
        default_compute_score("my/unknown-set", "#### 1", "1")
    message = str(info.value)
    assert "my/unknown-set" in message
    assert "openai/gsm8k" in message and "verl/arithmetic" in message and "aime*" in message
    assert "custom_reward_function" in message


def test_prefix_registration_and_exact_names_win(monkeypatch):
    monkeypatch.setattr(registry, "_SCORERS", dict(registry._SCORERS))
    monkeypatch.setattr(registry, "_PREFIX_SCORERS", dict(registry._PREFIX_SCORERS))

    @register_scorer("toy/", prefix=True)
    def toy_prefix(solution_str, ground_truth, extra_info=None):
        return 0.25

    @register_scorer("toy/exact")
    def toy_exact(solution_str, ground_truth, extra_info=None):
        return {"score": 0.75, "kind": "exact"}

    assert default_compute_score("toy/anything", "", "") == 0.25
    assert default_compute_score("toy/exact", "", "") == {"score": 0.75, "kind": "exact"}
    assert get_scorer("aime2025") is get_scorer("aime24")  # the built-in "aime" prefix
    with pytest.raises(ValueError, match="already has scorer"):
        register_scorer("toy/exact")(toy_prefix)
    with pytest.raises(ValueError, match="at least one"):
        register_scorer()


def _write(tmp_path, name: str, body: str):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_custom_function_overrides_and_extends(tmp_path):
    path = _write(
        tmp_path,
        "my_reward.py",
        """
        from verl.rewards import default_compute_score

        def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
            if data_source == "my/length":
                return {"score": float(len(solution_str) == int(ground_truth)) + bonus, "length": len(solution_str)}
            return default_compute_score(data_source, solution_str, ground_truth, extra_info)
        """,
    )
    fn = load_custom_reward_fn(str(path), "compute_score", reward_kwargs={"bonus": 0.5})
    assert fn(data_source="my/length", solution_str="abcd", ground_truth="4") == {"score": 1.5, "length": 4}
    assert fn(data_source="openai/gsm8k", solution_str="#### 72", ground_truth="72") == 1.0
    # Pickles by path and name (how it reaches pool workers), and still works after the trip.
    clone = pickle.loads(pickle.dumps(fn))
    assert isinstance(clone, FileRewardFunction) and clone.path == fn.path and clone.reward_kwargs == {"bonus": 0.5}
    assert clone(data_source="my/length", solution_str="ab", ground_truth="4") == {"score": 0.5, "length": 2}


def test_custom_function_without_extra_info(tmp_path):
    path = _write(
        tmp_path,
        "simple.py",
        """
        def judge(data_source, solution_str, ground_truth):
            return 1.0 if solution_str.strip() == ground_truth else 0.0
        """,
    )
    fn = load_custom_reward_fn(str(path), "judge")
    assert fn(data_source="x", solution_str=" yes ", ground_truth="yes", extra_info={"split": "train"}) == 1.0


def test_no_path_means_the_built_in_scorers():
    assert load_custom_reward_fn(None, "compute_score") is None
    assert load_custom_reward_fn("", "compute_score") is None


def test_custom_function_errors_name_the_path_and_name(tmp_path):
    missing = tmp_path / "nope.py"
    with pytest.raises(ValueError, match=r"custom_reward_function\.path=.*nope\.py.*no such file"):
        load_custom_reward_fn(str(missing), "compute_score")

    path = _write(tmp_path, "fns.py", "def other(data_source, solution_str, ground_truth):\n    return 0.0\nVALUE = 3\n")
    with pytest.raises(ValueError) as info:
        load_custom_reward_fn(str(path), "compute_score")
    assert "custom_reward_function.name='compute_score'" in str(info.value)
    assert "fns.py" in str(info.value) and "other" in str(info.value)  # lists what the file defines

    with pytest.raises(ValueError, match="'VALUE' .* is a int, not a function"):
        load_custom_reward_fn(str(path), "VALUE")

    with pytest.raises(ValueError, match="name is empty"):
        load_custom_reward_fn(str(path), "")

    broken = _write(tmp_path, "broken.py", "import not_a_module_anywhere\n")
    with pytest.raises(ValueError, match=r"broken\.py.*failed to import.*ModuleNotFoundError"):
        load_custom_reward_fn(str(broken), "compute_score")

    syntax = _write(tmp_path, "syntax.py", "def compute_score(:\n")
    with pytest.raises(ValueError, match=r"syntax\.py.*failed to import.*SyntaxError"):
        load_custom_reward_fn(str(syntax), "compute_score")

    wrong_sig = _write(tmp_path, "sig.py", "def compute_score(text, answer):\n    return 0.0\n")
    with pytest.raises(ValueError, match=r"sig\.py:compute_score must accept.*lacks \['data_source', 'ground_truth', 'solution_str'\]"):
        load_custom_reward_fn(str(wrong_sig), "compute_score")

    kw_only = _write(tmp_path, "kw.py", "def f(data_source, solution_str, ground_truth):\n    return 0.0\n")
    with pytest.raises(ValueError, match=r"lacks \['scale'\]"):
        load_custom_reward_fn(str(kw_only), "f", reward_kwargs={"scale": 2})
