"""Rule-based scorers keyed by ``data_source``, and user reward functions loaded from a file.

A scorer is a plain function ``fn(solution_str, ground_truth, extra_info=None) -> float | dict``;
a dict carries ``"score"`` plus extra per-sample fields the reward manager reports (``"acc"``,
``"pred"``...). ``default_compute_score`` dispatches on the sample's ``data_source`` with the
same names as the reference verl, so datasets prepared for it score the same way here;
``reference_compute_score`` dispatches the same names to the reference's own scorers
(:mod:`verl.rewards.reference`), falling back to ours where it has none.

Extend the table with ``@register_scorer("my/source")``, or replace the whole dispatch with a
user function (config ``custom_reward_function.path`` + ``.name``, see ``load_custom_reward_fn``)
that takes ``(data_source, solution_str, ground_truth, extra_info)`` as keyword arguments;
such a function can call ``default_compute_score`` for the data sources it does not handle.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from verl.rewards import arithmetic, code, colour_square, countdown, gsm8k, math_answer, reference
from verl.rewards.extract import as_text, last_boxed
from verl.rewards.format_reward import format_reward

ScoreResult = float | dict[str, Any]
Scorer = Callable[..., ScoreResult]

_SCORERS: dict[str, Scorer] = {}
_PREFIX_SCORERS: dict[str, Scorer] = {}


def register_scorer(*data_sources: str, prefix: bool = False) -> Callable[[Scorer], Scorer]:
    """Decorator: score samples whose ``data_source`` is one of ``data_sources`` with the function.

    With ``prefix=True`` the names are prefixes ("aime" covers "aime24", "aime2025"...); an
    exact name always wins over a prefix. Registering a name twice is an error.
    """
    if not data_sources:
        raise ValueError("register_scorer needs at least one data_source name")

    def decorator(fn: Scorer) -> Scorer:
        table = _PREFIX_SCORERS if prefix else _SCORERS
        for name in data_sources:
            if name in table and table[name] is not fn:
                raise ValueError(
                    f"data_source {name!r} already has scorer {table[name].__qualname__}; "
                    "pick another name or use custom_reward_function to override"
                )
            table[name] = fn
        return fn

    return decorator


def known_data_sources() -> list[str]:
    """Every registered data_source, sorted; prefixes are shown as "name*"."""
    return sorted(_SCORERS) + sorted(f"{p}*" for p in _PREFIX_SCORERS)


def get_scorer(data_source: str) -> Scorer:
    """The scorer for ``data_source``; ValueError listing the known ones when there is none."""
    fn = _SCORERS.get(data_source)
    if fn is not None:
        return fn
    for prefix in sorted(_PREFIX_SCORERS, key=len, reverse=True):
        if isinstance(data_source, str) and data_source.startswith(prefix):
            return _PREFIX_SCORERS[prefix]
    raise ValueError(
        f"no rule-based scorer for data_source={data_source!r}. Known: {', '.join(known_data_sources())}. "
        "Register one with verl.rewards.register_scorer, or set custom_reward_function.path/name."
    )


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: Mapping[str, Any] | None = None,
) -> ScoreResult:
    """Score one response with the rule-based scorer registered for ``data_source``.

    Returns a float, or a dict with ``"score"`` and extra fields (e.g. DAPO's ``acc``, ``pred``).
    An unknown ``data_source`` raises ValueError listing the known ones.
    """
    return get_scorer(data_source)(solution_str, ground_truth, extra_info)


def reference_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: Mapping[str, Any] | None = None,
) -> ScoreResult:
    """Score one response as the reference verl 0.9.1 does (``reward_model.rule_scoring=reference``):
    with the reference's own scorer (:func:`verl.rewards.reference.reference_scorer`).

    Data sources the reference has no scorer for (``countdown``, ``verl/arithmetic``...) use
    ours, as :func:`default_compute_score`; an unknown one raises ValueError listing the known ones.
    """
    solution_str = as_text(solution_str)  # responses are text; None or bytes must not crash a run
    fn = reference.reference_scorer(data_source)
    if fn is None:
        return default_compute_score(data_source, solution_str, ground_truth, extra_info)
    return fn(solution_str, ground_truth)


# ---- the built-in table (names as in the reference verl) ----

register_scorer("openai/gsm8k", "gsm8k")(gsm8k.compute_score)
register_scorer("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")(
    math_answer.compute_score
)
register_scorer(
    "numina_aops_forum",
    "numina_synthetic_math",
    "numina_amc_aime",
    "numina_synthetic_amc",
    "numina_cn_k12",
    "numina_olympiads",
)(math_answer.compute_score_numina)
register_scorer("math_dapo", "math", "math_dapo_reasoning")(math_answer.compute_score_dapo)
register_scorer("aime", prefix=True)(math_answer.compute_score_dapo)
register_scorer("countdown")(countdown.compute_score)
register_scorer(arithmetic.DATA_SOURCE)(arithmetic.compute_score)
# The vision-language demo's task and its control set without the square (verl.data.tasks.colour_square).
register_scorer(colour_square.DATA_SOURCE, colour_square.BLANK_DATA_SOURCE)(colour_square.compute_score)
# Programs run against the task's tests in the sandbox (verl.sandbox): stdin/stdout or function calls.
register_scorer(*code.DATA_SOURCES, code.ARITHMETIC_CODE_DATA_SOURCE)(code.compute_score)

# Geometry3K answers in a box after a <think> block; 10% of the score is for that layout.
GEOMETRY3K_FORMAT_PATTERN = r"\s*<think>.*</think>.*\\boxed\{.*\}.*"


@register_scorer("hiyouga/geometry3k")
def geometry3k_score(
    solution_str: object, ground_truth: object, extra_info: Mapping[str, Any] | None = None, *, format_weight: float = 0.1
) -> float:
    """(1 - format_weight) * accuracy of the last box + format_weight * (think-then-box layout).

    Accurate means ``math_equal``, or right by the reference verl's own Geometry3K grader
    (mathruler's), so every answer it accepts is accepted here too.
    """
    right = math_answer.math_equal(last_boxed(solution_str), ground_truth)
    if not right and isinstance(solution_str, str):
        right = reference.geo3k_accuracy(
            solution_str,
            ground_truth,
            max_answer_chars=math_answer.MAX_ANSWER_CHARS,
            sympy_timeout_s=math_answer.DEFAULT_MATH_VERIFY_TIMEOUT_S,
        )
    accuracy = 1.0 if right else 0.0
    layout = format_reward(solution_str, GEOMETRY3K_FORMAT_PATTERN)
    return (1.0 - format_weight) * accuracy + format_weight * layout


# ---- user functions from a file ----


@functools.lru_cache(maxsize=None)
def _load_function(path: str, name: str) -> Callable[..., Any]:
    """Import the file at ``path`` as a module (once per process) and return its ``name``."""
    if not os.path.isfile(path):
        raise ValueError(f"custom_reward_function.path={path!r}: no such file")
    # The same name in every process (hash() is salted per process), so objects defined in the
    # file pickle between the driver and pool workers.
    module_name = "verl_custom_reward_" + hashlib.sha1(path.encode()).hexdigest()[:16]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"custom_reward_function.path={path!r}: cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # so functions defined there pickle, and dataclasses work
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise ValueError(f"custom_reward_function.path={path!r} failed to import: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, name, None)
    if fn is None:
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ValueError(
            f"custom_reward_function.name={name!r} is not defined in {path}; callables there: {public}"
        )
    if not callable(fn):
        raise ValueError(f"custom_reward_function.name={name!r} in {path} is a {type(fn).__name__}, not a function")
    return fn


class FileRewardFunction:
    """A reward function named by file path and function name, with fixed keyword arguments.

    Called like ``default_compute_score``: keyword arguments ``data_source, solution_str,
    ground_truth, extra_info`` (``extra_info`` only if the function takes it) plus the fixed
    ``reward_kwargs``. Picklable as (path, name, kwargs), so it crosses into process-pool
    workers, which import the file themselves on first call.
    """

    def __init__(self, path: str, name: str, reward_kwargs: Mapping[str, Any] | None = None):
        self.path = os.path.abspath(os.path.expanduser(path))
        self.name = name
        self.reward_kwargs = dict(reward_kwargs or {})
        # Load now so a bad path/name fails in the driver at start-up, not in a worker mid-run.
        self.takes_extra_info = self._check_signature(_load_function(self.path, self.name))

    def _check_signature(self, fn: Callable[..., Any]) -> bool:
        """Whether ``fn`` takes ``extra_info``; ValueError if it lacks a required argument."""
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):  # a builtin without a signature: pass everything
            return True
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return True
        missing = sorted({"data_source", "solution_str", "ground_truth", *self.reward_kwargs} - set(params))
        if missing:
            raise ValueError(
                f"custom_reward_function {self.path}:{self.name} must accept the keyword arguments "
                f"data_source, solution_str, ground_truth[, extra_info] and the reward_kwargs; "
                f"its signature {inspect.signature(fn)} lacks {missing}"
            )
        return "extra_info" in params

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None
    ) -> ScoreResult:
        fn = _load_function(self.path, self.name)
        if self.takes_extra_info:
            return fn(
                data_source=data_source,
                solution_str=solution_str,
                ground_truth=ground_truth,
                extra_info=extra_info,
                **self.reward_kwargs,
            )
        return fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, **self.reward_kwargs)

    def __repr__(self) -> str:
        return f"FileRewardFunction({self.path!r}, {self.name!r}, reward_kwargs={self.reward_kwargs!r})"


def load_custom_reward_fn(
    path: str | None, name: str | None = "compute_score", reward_kwargs: Mapping[str, Any] | None = None
) -> FileRewardFunction | None:
    """The user's reward function from ``custom_reward_function.path`` / ``.name``; None if no path.

    The file is imported at once so a missing file, an import error or a missing function
    fails here with a ValueError naming the path and name, not mid-training.
    """
    if not path:
        return None
    if not name:
        raise ValueError(f"custom_reward_function.name is empty for path {path!r}: name the function to call")
    return FileRewardFunction(path, name, reward_kwargs)
