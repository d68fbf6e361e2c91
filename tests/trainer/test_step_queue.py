"""The queue of batches generated ahead as named states (``verl.trainer.step.queue``, issue #52):
each transition is asserted, and so is who may make it (the main thread, or the free-running
generator's thread while the queue is lent to it)."""

from __future__ import annotations

import threading

import pytest

from verl.trainer.step.generator import THREAD_NAME
from verl.trainer.step.queue import AheadBatch, AheadQueue, State


def _on_generator(fn):
    """Run ``fn`` on a thread named as the generator's; returns what it raised (or None)."""
    raised: list[BaseException | None] = [None]

    def body():
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 (handed back to the test)
            raised[0] = exc

    t = threading.Thread(target=body, name=THREAD_NAME)
    t.start()
    t.join(timeout=10)
    assert not t.is_alive()
    return raised[0]


def test_a_batch_goes_drawn_in_flight_finished_and_the_queue_pops_it_for_its_step():
    queue = AheadQueue()
    a, b = AheadBatch(step=2), AheadBatch(step=3)
    queue.draw(a)
    queue.draw(b)
    assert [x.state for x in queue] == [State.DRAWN, State.DRAWN] and queue.oldest_unfinished() is a
    queue.begin(a, 1, partial="segments so far")
    assert (a.state, a.version, a.partial) == (State.IN_FLIGHT, 1, "segments so far")
    queue.finish(a, ("batch", None, {}))
    assert (a.state, a.partial, a.generated[0]) == (State.FINISHED, None, "batch")
    queue.begin(b, 1, generated=("whole", None, {}))
    assert b.state is State.FINISHED and queue.oldest_unfinished() is None
    with pytest.raises(RuntimeError, match="next batch is for step 2, not step 3"):
        queue.pop(3)


def test_illegal_transitions_are_refused():
    queue = AheadQueue()
    a = AheadBatch(step=1)
    queue.draw(a)
    with pytest.raises(AssertionError):
        queue.finish(a, ("batch", None, {}))  # DRAWN cannot finish without beginning
    with pytest.raises(AssertionError):
        queue.drop(a)  # only a batch in flight is dropped
    queue.begin(a, 0, partial="p")
    with pytest.raises(AssertionError):
        queue.begin(a, 0, partial="p")  # begun twice
    queue.drop(a)
    assert a.state is State.DROPPED and a.partial is None
    queue.begin(a, 5, partial="again")  # sampled again: the version that began it stays
    assert (a.state, a.version) == (State.IN_FLIGHT, 0)
    with pytest.raises(AssertionError):
        queue.draw(AheadBatch(step=2, state=State.FINISHED))


def test_who_may_change_the_queue():
    queue = AheadQueue()
    a = AheadBatch(step=1)
    queue.draw(a)
    # Not lent: the generator's thread may change nothing.
    assert isinstance(_on_generator(lambda: queue.begin(a, 0, partial="p")), AssertionError)
    queue.lend()
    # Lent: the thread begins, advances and finishes; it never draws, pops or drops.
    assert _on_generator(lambda: queue.begin(a, 0, partial="p")) is None
    assert _on_generator(lambda: queue.assert_in_flight(a)) is None
    assert isinstance(_on_generator(lambda: queue.draw(AheadBatch(step=2))), AssertionError)
    assert isinstance(_on_generator(lambda: queue.pop(1)), AssertionError)
    # ... and the main thread changes nothing while it is lent.
    with pytest.raises(AssertionError):
        queue.finish(a, ("batch", None, {}))
    with pytest.raises(AssertionError):
        queue.draw(AheadBatch(step=2))
    queue.take_back()  # a hold
    queue.finish(a, ("batch", None, {}))
    assert queue.pop(1) is a and not queue
