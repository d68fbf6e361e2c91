"""``verl.trainer.step.generator.Generator``, the free-running generator's thread, on one rank (no
rollout group): holds pause it between two units of work, an error on the thread reaches the main
thread at its next hold, and it stops when asked, busy or idle, without hanging."""

from __future__ import annotations

import threading
import time

import pytest

from verl.trainer.step.generator import Generator

WAIT_S = 30.0  # generous: a loaded machine may take a while to schedule the thread


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {WAIT_S} s: {what}")
        time.sleep(0.005)


def test_a_hold_pauses_the_thread_between_two_units():
    units: list[int] = []
    inside = threading.Event()

    def work() -> bool:
        assert not inside.is_set(), "a unit ran inside a hold"
        units.append(len(units))
        time.sleep(0.002)
        return True

    gen = Generator(work)
    with gen.held():  # before start: a plain block
        pass
    gen.start()
    _until(lambda: len(units) > 3, "the thread runs units")
    for _ in range(5):
        with gen.held():
            inside.set()
            seen = len(units)
            time.sleep(0.05)
            assert len(units) == seen  # nothing ran while held
            inside.clear()
        _until(lambda: len(units) > seen, "the thread goes on after the hold")
    with gen.held(), gen.held():  # a hold inside a hold (validation inside a checkpoint's, say): one pause
        seen = len(units)
    _until(lambda: len(units) > seen, "the thread goes on after the nested holds")
    busy, count = gen.take_busy()
    assert count > 0 and busy > 0
    gen.stop()
    assert not gen.running


def test_an_idle_thread_wakes_for_a_hold_and_stops():
    calls = [0]

    def work() -> bool:  # nothing to do until a hold changes something
        calls[0] += 1
        return False

    gen = Generator(work)
    gen.start()
    _until(lambda: calls[0] >= 1, "the thread looked for work")
    time.sleep(0.05)
    assert calls[0] == 1  # idle: it waits, it does not spin
    with gen.held():
        pass
    _until(lambda: calls[0] >= 2, "after the hold the thread looks again")
    gen.stop()
    assert not gen.running


def test_an_error_on_the_thread_is_raised_at_the_next_hold():
    calls = [0]

    def work() -> bool:
        calls[0] += 1
        if calls[0] == 3:
            raise ValueError("the engine broke")
        return True

    gen = Generator(work)
    gen.start()
    _until(lambda: not gen.running, "the thread ended on its error")
    with pytest.raises(RuntimeError, match=r"the free-running generator failed: ValueError\('the engine broke'\)"):
        with gen.held():
            pass
    gen.stop()  # nothing left to raise, nothing to wait for


def test_an_error_while_a_hold_waits_is_raised_there():
    release = threading.Event()

    def work() -> bool:
        release.wait(WAIT_S)
        raise OSError("lost the device")

    gen = Generator(work)
    gen.start()
    timer = threading.Timer(0.1, release.set)  # the unit fails while the main thread waits for it
    timer.start()
    with pytest.raises(RuntimeError, match="lost the device"):
        with gen.held():
            pass
    timer.join()
    gen.stop()
