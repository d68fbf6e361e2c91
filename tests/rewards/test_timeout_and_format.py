"""The per-call time limit (nesting, outer timers, threads) and the format reward."""

from __future__ import annotations

import logging
import re
import signal
import threading
import time

import pytest

from verl.rewards import THINK_ANSWER_PATTERN, format_reward
from verl.rewards.timeout import ScoreTimeout, time_limit
from verl.utils.signals import deferred, deferring, interruptible


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@pytest.mark.timeout(30)
def test_time_limit_abandons_the_body_and_reports_expiry():
    handler_before = signal.getsignal(signal.SIGALRM)
    reached_end = False
    with time_limit(0.1) as limit:
        _spin(10)
        reached_end = True
    assert limit.expired and not reached_end
    # The timeout passes through `except Exception` (as found all over sympy): it cannot be swallowed.
    with time_limit(0.1) as limit:
        try:
            _spin(10)
        except Exception:
            pass
        reached_end = True
    assert limit.expired and not reached_end
    with time_limit(1.0) as limit:
        _spin(0.01)
    assert not limit.expired
    with time_limit(None) as limit:
        _spin(0.01)
    assert not limit.expired
    assert signal.getsignal(signal.SIGALRM) is handler_before  # whatever was installed is back


@pytest.mark.timeout(30)
def test_a_lost_timeout_fires_again():
    # A timeout raised inside a gc callback or __del__ is reported as unraisable and lost; the
    # timer keeps firing after the deadline, so the next signal still ends the block.
    swallowed = 0
    with time_limit(0.1) as limit:
        try:
            _spin(10)
        except ScoreTimeout:
            swallowed += 1
        _spin(10)
    assert limit.expired and swallowed == 1


@pytest.mark.timeout(30)
def test_deferred_clean_up_runs_to_its_end_while_the_timeout_fires_again():
    """Past the deadline the timer fires every 50 ms until the block has unwound; a clean-up inside
    deferred() that takes longer (a loaded machine) still runs to its end, and the block still ends
    with the limit expired. Without deferred() the next signal cuts it short (checked below)."""

    def clean_up_taking(seconds: float, done: list) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(0.01)  # a signal lands here: sleep returns early and the handler may raise
        done.append(True)

    done: list = []
    with time_limit(0.05) as limit:
        try:
            time.sleep(5)
        finally:
            with deferred():
                clean_up_taking(0.4, done)
    assert limit.expired and done == [True]

    cut: list = []
    with time_limit(0.05) as limit:
        try:
            time.sleep(5)
        finally:
            clean_up_taking(0.4, cut)
    assert limit.expired and cut == []  # the re-firing timer ended the undeferred clean-up early


def test_deferred_restores_its_callers_state_when_an_inner_interruptible_was_cut_short():
    """A timeout can land in interruptible()'s finally before it restores the depth; the enclosing
    deferred() still hands its caller the state it found (a count left at -1 would make every later
    deferred() block hold nothing back)."""
    from verl.utils import signals

    with deferred():
        signals._local.depth -= 1  # what an interruptible() whose finally was cut short leaves behind
        assert not deferring()
    assert not deferring()
    with deferred():
        assert deferring()
    with deferred(), deferred(), interruptible():
        assert deferring()  # one level only: the outer block still holds


def test_outer_timer_survives_an_inner_limit():
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(time.monotonic()))
    saved = signal.setitimer(signal.ITIMER_REAL, 0.5)
    try:
        start = time.monotonic()
        with time_limit(5.0) as limit:
            _spin(0.05)
        assert not limit.expired and not fired
        remaining = signal.getitimer(signal.ITIMER_REAL)[0]
        assert 0.0 < remaining < 0.5  # re-armed with what was left of the outer 0.5 s
        _spin(1.0)
        assert len(fired) == 1 and fired[0] - start < 0.9  # fired near its own deadline
    finally:
        signal.setitimer(signal.ITIMER_REAL, *saved)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.timeout(30)
def test_an_outer_limit_unwinds_through_an_inner_one():
    inner_claimed = False
    start = time.monotonic()
    with time_limit(0.2) as outer:
        with time_limit(10.0) as inner:
            try:
                _spin(10)
            except ScoreTimeout:
                inner_claimed = True  # a scorer that catches timeouts by name still cannot keep going
                raise
        _spin(10)  # never reached
    assert outer.expired and not inner.expired and inner_claimed
    assert time.monotonic() - start < 5.0


@pytest.mark.timeout(30)
def test_an_inner_limit_expires_alone():
    with time_limit(10.0) as outer:
        with time_limit(0.1) as inner:
            _spin(10)
        _spin(0.01)  # the outer block goes on
    assert inner.expired and not outer.expired


def test_time_limit_in_a_thread_runs_unbounded_with_a_warning(caplog):
    errors = []

    def body():
        try:
            with time_limit(0.05):
                _spin(0.2)
        except BaseException as exc:  # noqa: BLE001 - the test wants to see anything raised
            errors.append(exc)

    with caplog.at_level(logging.WARNING, logger="verl.rewards.timeout"):
        t = threading.Thread(target=body, name="scorer-thread")
        t.start()
        t.join()
    assert errors == []
    assert "main thread" in caplog.text


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("<think>6 - 2 = 4</think><answer>21</answer>", 1.0),
        ("  <think>\nline one\nline two\n</think>\n\n<answer> 21 </answer>\n", 1.0),
        ("<think></think><answer></answer>", 1.0),
        ("<answer>21</answer>", 0.0),  # no think block
        ("<think>a</think>", 0.0),
        ("<think>a</think><answer>1</answer><answer>2</answer>", 0.0),  # two answers
        ("<think>a<think>b</think></think><answer>1</answer>", 0.0),  # nested tags
        ("<think>a</think>text between<answer>1</answer>", 0.0),
        ("<think>a</think><answer>1</answer> trailing words", 0.0),
        ("<answer>1</answer><think>a</think>", 0.0),  # wrong order
        ("<think>\u00e9\u4e2d\U0001F600</think><answer>\u221e</answer>", 1.0),  # Unicode inside is fine
        ("", 0.0),
        (None, 0.0),
    ],
)
def test_format_reward_think_answer(response, expected):
    assert format_reward(response) == expected


def test_format_reward_custom_pattern_and_errors():
    assert format_reward("Answer: 5", r"Answer: -?\d+") == 1.0
    assert format_reward("Answer: 5 extra", r"Answer: -?\d+") == 0.0  # the whole response must match
    assert format_reward("ANSWER: 5", r"answer: \d+", flags=re.IGNORECASE, score=0.5) == 0.5
    with pytest.raises(ValueError, match="not a valid regex"):
        format_reward("x", r"(unclosed")


@pytest.mark.timeout(30)
def test_format_reward_is_linear_on_long_input():
    format_reward("<think>" + "a" * 1_000_000 + "</think><answer>" + "<" * 100_000)
    assert re.compile(THINK_ANSWER_PATTERN)  # the documented default is a plain regex string
