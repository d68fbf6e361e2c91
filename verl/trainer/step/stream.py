"""The streaming rollout: generation ahead of training, with a staleness bound
(``trainer.rollout_mode=one_step_off|async``; shared/DESIGN.md's "one-step-off and async modes").

:class:`StreamRolloutOperator` takes the place of ``RolloutOperator`` at the head of the same step
pipeline (``RewardOperator`` -> ``PPOUpdateOperator`` follow, one loop). It keeps a queue of batches
generated ahead, each sample tagged with ``rollout_version`` (the actor updates done before the
weights that sampled it). In step ``s``:

1. the actor's weights (version ``s - 1``) go to an engine on ranks of its own (collective);
2. the head of the queue (generated for step ``s``) is handed to every rank; with an empty queue
   (the first step) the batch is generated now, with version ``s - 1``;
3. while the rest of step ``s`` runs (the step's schedule calls :meth:`generate_ahead` inside
   ``StepPieces.update_step``: ``verl.trainer.step.schedule``), the
   rollout's ranks generate the batches of the next steps with version ``s - 1`` weights, as long
   as every such sample stays within the bound: a batch for step ``t`` trains from version
   ``t - 1``, ``t - s`` versions later, so the queue holds at most ``depth`` batches (1 for
   one_step_off; ``async_training.max_staleness`` for async; 0 would be the synchronous step, so
   the bound-0 async run is the sync run).

With the rollout on ranks that hold none of the actor, the reference and the critic
(``trainer.placement.rollout``; ``RLWorld.generates_only``), the schedule calls :meth:`generate_ahead`
first, right after the reward: those ranks join no collective from there until the updates end
(the other ranks hand each other the old/reference log-probs and values over
``RLWorld.trainer_group``; the ranks that only generate get them, with the updates' metrics, after
the updates, and compute the advantages then). So step 3 runs while the actor's ranks compute the
old and reference log-probs, the values, the advantages and the updates: generation overlaps the
whole of the actor's step but the weight push, the hand-over of the batch and the reward. Which
weights sample which batch is the same as in any other placement (the engine holds version
``s - 1`` throughout ``update_step``). With the rollout on a rank of the actor's roles (colocated,
or sharing a rank with the reference or critic) ``update_step`` calls it between the advantages and
the updates, and the same schedule runs one after the other (the samples are those of the
overlapped run).

The reference on the rollout's ranks (``trainer.placement.ref`` among ``trainer.placement.rollout``,
the rollout's first rank included; ``RLWorld.ref_ahead``): the reference never changes, so those
ranks compute a batch's ``ref_log_prob`` as soon as the batch is finished (right after generating
it ahead, or at its step for the first batch, a partial rollout's and one whose samples were dropped
as stale), and the batch brings them to every rank: ``update_step`` runs no reference pass, and
those ranks count as ranks that only generate (above). The same rows in the same micro-batches
give the same log-probs as the pass on the actor's ranks would (tests/trainer/test_ref_ahead.py).

Each batch samples with the seed and the prompts the synchronous step ``t`` would use
(``sampling_seed(step=t)``, uid ``t-1/0/i``); only the weights differ. Checkpoints hold the queue
(``rollout_queue/``, :meth:`save_state`), so a killed and resumed run trains exactly the batches
the uninterrupted one would.

Partial rollout (``async_training.partial_rollout``, ``verl.trainer.step.partial``): a batch ahead is
generated in segments of at most ``partial_rollout_tokens`` new tokens instead of one engine call.
Its first segment runs when it is begun (in the window where the bound first allows it, as above);
every later window runs one more segment of each batch in flight, with that window's weights; at its
own step the rest is generated with the weights just pushed. So a batch for step ``t`` begun with
version ``b`` has its token ``j`` sampled by version ``min(b + j // segment, t - 1)``
(``rollout_token_versions``, beside the per-token ``rollout_log_probs`` of the same weights, which
rollout correction uses), and ``rollout_version`` is ``b``, the version that began it: the bound
applies to the oldest token. A weight update never discards what was generated. The queue's
checkpoint holds the batches in flight (their tokens, log-probs and versions so far).

Filling the update window (``async_training.fill_update_window``, partial rollout with the rollout
on ranks apart; the window is ``update_step`` from its start, the passes included, on a rank that
only generates): after the window's fixed work above (one segment of each batch in flight, the
batches the bound lets begin), the rollout's ranks keep running segments of the unfinished batches
in flight, the next step's first, with the window's weights, until the actor's first rank signals
that its update is done (:meth:`update_done` counts the update on torch.distributed's default
store; each rollout rank reads the count, without blocking, before each segment, and several agree
over the rollout's group, done when any has seen it: :meth:`_update_is_done`) or nothing is left
to generate. The step then proceeds to the weight push as before. The pace is the actor's, not
a fixed amount of work, so in this mode *how many segments run in each window, hence which version
samples which token* (``rollout_token_versions``, the ``rollout_log_probs`` with them, the
responses themselves and everything trained from them) depends on timing. What does not: the
bound per sample (``rollout_version`` is still the version that began the batch, in the window
where the bound allows it), per-token versions non-decreasing and each at most the version the
update starts from, every token's log-prob from its segment's weights, and each segment's seed.

Stale samples (``async_training.stale_samples``): with ``wait`` (the default) generation never
runs ahead of the bound, so no sample can exceed it; one beyond it is an internal error raised
before the update (``StepPieces.staleness_metrics``). With ``drop``, the samples of a batch begun
more than ``depth`` versions before its update's are dropped (``async/stale_dropped`` counts them)
and their prompts sampled again, all ``n`` samples of each, with the current weights, so the batch
keeps its size and no group mixes policies. Within one run the pacing above gives nothing to drop;
a queue saved with a looser bound (a run resumed with a smaller ``max_staleness``) is the case it
serves here.

The free-running generator (``async_training.free_running``, the rollout on ranks that only
generate; ``verl.trainer.step.generator``): a thread on each rollout rank works on the oldest
unfinished batch in the queue, one unit at a time, with the version the engine holds then (partial
rollout: one segment, its first if it is not begun; else the whole batch, so the push waits for a
batch the thread is generating), without stopping at step boundaries: through
the batch's hand-over, the reward, the actor's passes and updates, the exchanges, logging and the
next step's start. Every rank draws the prompts of each batch the bound allows as the step's batch
is taken (:meth:`_head`, so every rank's data position is the same and a checkpoint's is that of the
queue it holds), and the thread begins them. It pauses only while the main thread holds it:
:meth:`_head` (the weight push, which writes into the engine's tensors in place, and the step's own
batch finished with the pushed weights when the thread has not finished it), validation and
checkpoints (``PPOTrainer._engine_held``), the end of the run (the schedule's ``close``). With the reference on
the rollout's ranks the thread computes each batch's log-probs as it finishes it (the main thread
meanwhile runs no model: the two would share the rank's cores). Timing decides how many segments run
between two pushes, so, as with ``fill_window``, which version samples which token; the bound per
sample and the per-token invariants hold, a batch begins as soon as the bound allows it and the
thread reaches it (so its staleness is the bound or less), and the checkpoint holds every batch in
flight with its tokens so far (nothing generated is lost on resume). ``async/free_segments`` and
``timing_s/gen_free`` are the thread's segments and seconds since the step before's push.

Not here: generation during the weight push (the push writes into the engine's tensors in place; a
second copy of the weights would let generation go on meanwhile), and the ranks that only generate
still take part in the reward (scored on every rank; with ``free_running`` the thread generates
meanwhile). When one step's generation outlasts the actor's passes and updates, the actor's ranks
wait for it at the exchange after the updates.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from verl.hybrid.weight_sync import push_totals
from verl.trainer.step.base import Operator
from verl.trainer.step.ops import ROLLOUT_FIELDS
from verl.trainer.step.queue import AheadBatch, AheadQueue, State

if TYPE_CHECKING:
    from verl.protocol import Batch
    from verl.trainer.step.generator import Generator
    from verl.trainer.step.context import StepContext
    from verl.trainer.step.partial import PartialBatch
    from verl.trainer.step.pieces import StepPieces

__all__ = ["QUEUE_DIR", "StreamRolloutOperator"]

QUEUE_DIR = "rollout_queue"  # in a checkpoint: the batches generated ahead
# On the default store: the updates the actor's first rank has finished (fill_update_window). A
# count, not a flag per step: it never needs deleting, and runs in one process group follow on.
_UPDATES_KEY = "verl/stream/updates_done"
_REFILL_SEED = 104_729  # seed offset of the prompts sampled again after a drop (stale_samples=drop)


class StreamRolloutOperator(Operator):
    """The step's batch from the stream of batches generated ahead (module docstring).

    Args:
        depth: the most batches generated ahead (the staleness bound: 1 for one_step_off).
        call_sizes: ``RolloutOperator``'s dynamic batch size ``(min, max)``, or None.
        partial_tokens: partial rollout (``async_training.partial_rollout``): the batches ahead are
            generated in segments of at most this many new tokens, one segment of each batch in
            flight per update (``verl.trainer.step.partial``); None: whole batches.
        stale_samples: ``"wait"`` (no sample ever exceeds ``depth``: generation waits) or ``"drop"``
            (a sample begun more than ``depth`` versions before its update's is dropped, counted in
            ``async/stale_dropped``, and its prompt sampled again with the current weights).
        fill_window: partial rollout with the rollout apart: keep running segments of the batches in
            flight until the actor's update is done (module docstring; timing-paced).
        free_running: the rollout on ranks that only generate: a generator thread generates without
            stopping at step boundaries, in segments with ``partial_tokens``, else in whole batches
            (module docstring; ``verl.trainer.step.generator``).
    """

    outputs = ROLLOUT_FIELDS + ("rollout_version",)

    def __init__(
        self,
        *,
        depth: int,
        call_sizes: tuple[int, int] | None = None,
        partial_tokens: int | None = None,
        stale_samples: str = "wait",
        fill_window: bool = False,
        free_running: bool = False,
    ) -> None:
        super().__init__()
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ValueError(f"StreamRolloutOperator(depth={depth!r}): batches generated ahead, an int >= 0")
        if partial_tokens is not None and (isinstance(partial_tokens, bool) or not isinstance(partial_tokens, int) or partial_tokens < 1):
            raise ValueError(f"StreamRolloutOperator(partial_tokens={partial_tokens!r}): new tokens per segment, an int >= 1 or None")
        if stale_samples not in ("wait", "drop"):
            raise ValueError(f"StreamRolloutOperator(stale_samples={stale_samples!r}): 'wait' or 'drop'")
        if partial_tokens is not None and call_sizes is not None:
            raise ValueError("StreamRolloutOperator: partial rollout makes one engine call per segment; use call_sizes=None")
        if fill_window and partial_tokens is None:
            raise ValueError("StreamRolloutOperator(fill_window=True) fills the update window with segments: set partial_tokens")
        if free_running and fill_window:
            raise ValueError("StreamRolloutOperator(free_running=True) fills every window itself: use fill_window=False")
        self.depth = depth
        self.call_sizes = call_sizes
        self.partial_tokens = partial_tokens
        self.stale_samples = stale_samples
        self.fill_window = fill_window
        self.free_running = free_running
        self._generator: "Generator | None" = None  # free_running, on the rollout's ranks
        self._engine_version = 0  # free_running: the policy version the engine holds (set inside holds)
        self._updates_before = 0  # fill_window: the store's update count when this step began
        self.queue = AheadQueue()  # the batches generated ahead, as named states (verl.trainer.step.queue)

    def bind(self, trainer: "StepPieces") -> None:
        """Attach the trainer and make the step's schedule of this mode (``verl.trainer.step.schedule``)."""
        from verl.trainer.step import schedule

        super().bind(trainer)
        world = trainer.world
        if self.free_running:
            if trainer.rollout is not None:
                from verl.trainer.step.generator import Generator

                if not world.generates_only:  # (the config's pre-flight says so before any model is built)
                    raise ValueError(
                        "trainer.async_training.free_running=true needs the rollout on ranks that only generate: place "
                        "the actor and the critic on other ranks (trainer.placement)"
                    )
                self._generator = Generator(
                    self._work, group=trainer.rollout.world, stop_timeout_s=trainer.cfg.trainer.collective_timeout_s
                )
            self.schedule = schedule.FreeRunningSchedule(world, self, self._generator)
        elif world.trainer_group is not None:  # ranks that only generate: from the start of the update step
            self.schedule = schedule.StepPacedApartSchedule(world, self)
        else:
            self.schedule = schedule.StepPacedSchedule(world, self)

    def held(self) -> "contextlib.AbstractContextManager[None]":
        """free_running: a block in which the generator thread is paused (the step's schedule's hold);
        elsewhere the block just runs."""
        if self._generator is None:
            return contextlib.nullcontext()
        return self._held()

    _hold_depth = 0  # holds open on the main thread (a hold inside a hold is one pause)

    @contextlib.contextmanager
    def _held(self) -> "Iterator[None]":
        with self._generator.held():
            self.queue.take_back()  # the thread is paused: the queue is the main thread's
            self._hold_depth += 1
            try:
                yield
            finally:
                self._hold_depth -= 1
                if self._hold_depth == 0 and self._generator.running:
                    self.queue.lend()

    # -- the step ---------------------------------------------------------------------------

    def process(self, batch: "Batch | None") -> "tuple[Batch | None, dict[str, float]]":
        if batch is not None:
            raise ValueError("StreamRolloutOperator makes the step's batch: it must be the stream's first operator")
        trainer = self.trainer
        step = trainer.step_ctx.step
        if self.fill_window and trainer.rollout is not None:
            # Before any collective of this step: the actor cannot have finished this step's
            # update (it needs this step's batch), and its earlier updates were counted before
            # the collective that ended the step before.
            self._updates_before = int(self._store().add(_UPDATES_KEY, 0))
        with self.held():  # free_running: the generator thread waits from here to the hand-over
            item = self._head(step)
        if item is None:
            return None, {}
        with trainer.phase("share"):
            out, metrics = trainer.share_generated(item.generated)
        metrics["async/generated_ahead"] = self._was_ahead
        metrics["async/queue_size"] = float(len(self.queue))
        return out, metrics

    def _head(self, step: int) -> AheadBatch | None:
        """The weight push and step ``step``'s batch, finished, its reference log-probs computed
        (the rollout's ranks); with free_running the next batches' prompts are drawn too. None when
        the data is used up."""
        trainer = self.trainer
        pushed: dict[str, float] = {}
        if trainer.world.send is not None:  # the current weights to the engine apart (collective)
            with trainer.phase("push"):
                pushed = push_totals(trainer.world.send.push())  # the actor's sent bytes too
        self._engine_version = trainer.step_ctx.version
        if self.queue:
            item = self.queue.pop(step)
            self._was_ahead = 1.0
        else:
            item = self._draw(step)
            if item is None:
                return None
            self._was_ahead = 0.0
        if trainer.rollout is not None:
            if item.state is State.DRAWN:  # not begun yet: now, with the weights just pushed
                self._start(item)
            if item.state is State.IN_FLIGHT:  # its last segments with the weights pushed for this step
                if self.stale_samples == "drop" and (step - 1) - item.version > self.depth:
                    self._restart(item, step)  # every sample began with item.version: finishing them is wasted
                else:
                    self._finish(item, trainer.step_ctx.version)
            if self.stale_samples == "drop":
                self._drop_stale(item, step)
            self._reference(item)  # (a batch generated ahead may have them already)
            item.generated[2].update(pushed)  # the push's metrics as the rollout's ranks see them (as generate's)
            if self._generator is not None:  # what the thread did since the last push
                busy, units = self._generator.take_busy()
                item.generated[2]["timing_s/gen_free"] = busy
                item.generated[2]["async/free_segments"] = float(units)
        if self.free_running:  # the prompts of every batch the bound allows now; the thread begins them
            while len(self.queue) < self.depth:
                more = self._draw(step + len(self.queue) + 1)
                if more is None:
                    break
                self.queue.draw(more)
        if self._generator is not None and not self._generator.running:  # (later steps: the hold lends it back)
            self.queue.lend()
            self._generator.start()
        return item

    def _draw(self, step: int) -> AheadBatch | None:
        """The prompts of ``step``'s batch (every rank draws them; the rollout's keep them), not yet
        begun; None when the data is used up."""
        trainer = self.trainer
        if self.queue.exhausted or step > trainer.total_steps:
            return None
        with trainer.phase("data"):
            prompts = trainer.data.prompt_batch(step - 1, 0)  # uid "step-1/0/i", as the synchronous step
        if prompts is None:
            self.queue.exhausted = True
            return None
        return AheadBatch(step=step, prompts=prompts if trainer.rollout is not None else None)

    def _start(self, item: AheadBatch) -> None:
        """Begin ``item`` with the weights the engine holds now (the rollout's ranks): its first
        segment (partial rollout), or the whole batch and its reference log-probs."""
        trainer = self.trainer
        version = trainer.step_ctx.version
        seed = trainer.sampling_seed(0, step=item.step)
        if self.partial_tokens is not None:  # its first segment now, the rest in later windows or at its step
            self.queue.begin(item, version, partial=self._partial(item.prompts, seed))
            with trainer.phase("gen"), trainer.rollout.phase():
                item.partial.advance(trainer.rollout.generate_segment, version)
            return
        with trainer.phase("gen"), trainer.rollout.phase() as push:
            generated = trainer.generate_here(item.prompts, seed=seed, call_sizes=self.call_sizes)
            generated[2].update(push)
        generated[0]["rollout_version"] = torch.full((len(generated[0]),), version, dtype=torch.long)
        self.queue.begin(item, version, generated=generated)
        self._reference(item)

    def _work(self) -> bool:
        """free_running, on the generator thread: one unit of the oldest unfinished batch in the
        queue, with the version the engine holds (partial rollout: one segment, its first if it is
        not begun; else the whole batch); False when every batch in the queue is finished. The queue
        changes only while the thread is held."""
        trainer = self.trainer
        item = self.queue.oldest_unfinished()
        if item is None:
            return False
        version = self._engine_version
        seed = trainer.sampling_seed(0, step=item.step)
        with trainer.rollout.phase():
            if self.partial_tokens is None:
                generated = trainer.generate_here(item.prompts, seed=seed, call_sizes=self.call_sizes)
                generated[0]["rollout_version"] = torch.full((len(generated[0]),), version, dtype=torch.long)
            else:
                if item.state is State.DRAWN:
                    self.queue.begin(item, version, partial=self._partial(item.prompts, seed))
                self.queue.assert_in_flight(item)
                item.partial.advance(trainer.rollout.generate_segment, version)
                if not item.partial.finished:
                    return True
                batch, metrics = item.partial.assemble()
                generated = (batch, None, metrics)
        if trainer.world.ref_ahead and trainer.reference is not None:  # as _reference, off the step's timer
            start = time.perf_counter()
            trainer.compute_ref_log_prob(generated[0])
            generated[2]["timing_s/ref_ahead"] = time.perf_counter() - start
        if item.state is State.DRAWN:
            self.queue.begin(item, version, generated=generated)
        else:
            self.queue.finish(item, generated)
        return True

    def _reference(self, item: AheadBatch) -> None:
        """With the reference on the rollout's ranks (``RLWorld.ref_ahead``): ``item``'s finished
        batch gets its ``ref_log_prob`` here, on those ranks, when it has none yet; the reference
        never changes, so a batch generated ahead has them before its step begins
        (``timing_s/ref_ahead`` in its metrics)."""
        trainer = self.trainer
        batch = item.generated[0]
        if not trainer.world.ref_ahead or trainer.reference is None or batch is None or "ref_log_prob" in batch:
            return
        start = time.perf_counter()
        with trainer.phase("ref_ahead"):
            trainer.compute_ref_log_prob(batch)
        item.generated[2]["timing_s/ref_ahead"] = item.generated[2].get("timing_s/ref_ahead", 0.0) + time.perf_counter() - start

    def _partial(self, prompts: "Batch", seed: int) -> "PartialBatch":
        """A batch in flight for ``prompts`` (partial rollout), sampling with ``seed``."""
        from verl.trainer.step.partial import PartialBatch

        trainer = self.trainer
        rollout_cfg = trainer.cfg.actor_rollout_ref.rollout
        eos = trainer.tokenizer.eos_token_id if not rollout_cfg.ignore_eos else None
        stop_ids = set(rollout_cfg.stop_token_ids) | ({int(eos)} if eos is not None else set())
        return PartialBatch(
            prompts, n=trainer.n, response_length=rollout_cfg.response_length, segment_tokens=self.partial_tokens,
            stop_ids=stop_ids, seed=seed, pad_token_id=trainer.rollout.engine.pad_token_id,
        )

    def _finish(self, item: AheadBatch, version: int) -> None:
        """Partial rollout: ``item``'s unfinished samples continued with the current weights (policy
        ``version``) until every one has ended; its batch assembled (the rollout's ranks)."""
        trainer = self.trainer
        self.queue.assert_in_flight(item)
        with trainer.phase("gen"), trainer.rollout.phase() as push:
            item.partial.finish(trainer.rollout.generate_segment, version)
        batch, metrics = item.partial.assemble()
        metrics.update(push)
        self.queue.finish(item, (batch, None, metrics))

    def _restart(self, item: AheadBatch, step: int) -> None:
        """``stale_samples=drop`` on a batch in flight begun beyond the bound: its samples dropped
        unfinished, its prompts sampled anew with the current weights (as :meth:`_drop_stale` would
        after finishing them, without the segments it would throw away)."""
        dropped, prompts = float(len(item.partial.tokens)), item.partial.prompts
        self.queue.drop(item)
        version = self.trainer.step_ctx.version
        self.queue.begin(item, version, partial=self._partial(prompts, self.trainer.sampling_seed(0, step=step) + _REFILL_SEED))
        self._finish(item, version)
        item.generated[2]["async/stale_dropped"] = dropped

    def _drop_stale(self, item: AheadBatch, step: int) -> None:
        """``stale_samples=drop``: the samples of ``item`` begun more than ``depth`` versions before
        the one step ``step`` trains from are dropped, and the prompts they belong to sampled again,
        all ``n`` samples of each, with the current weights (a group is never mixed across a drop),
        so the batch keeps its size; ``async/stale_dropped`` counts the samples dropped."""
        trainer = self.trainer
        batch, greedy, metrics = item.generated
        n = trainer.n
        stale = ((step - 1) - batch["rollout_version"].long()) > self.depth  # [B*n]
        groups = sorted({int(i) // n for i in stale.nonzero().flatten().tolist()})
        metrics["async/stale_dropped"] = metrics.get("async/stale_dropped", 0.0) + float(len(groups) * n)  # (after a _restart)
        if not groups:
            return
        if item.prompts is None:
            raise ValueError(
                f"step {step}: a batch generated ahead holds samples beyond the staleness bound {self.depth}, but its "
                "checkpoint holds no prompts to sample them again; resume with the trainer.async_training.max_staleness "
                "it was saved with"
            )
        prompts = item.prompts[groups]
        seed = trainer.sampling_seed(0, step=step) + _REFILL_SEED
        version = trainer.step_ctx.version
        with trainer.phase("gen"), trainer.rollout.phase():
            if self.partial_tokens is not None:
                fresh = self._partial(prompts, seed)
                fresh.finish(trainer.rollout.generate_segment, version)
                again, _ = fresh.assemble()
            else:
                again = trainer.rollout.generate(prompts, seed=seed)
                again["rollout_version"] = torch.full((len(again),), version, dtype=torch.long)
        rows = torch.tensor([g * n + j for g in groups for j in range(n)], dtype=torch.long)
        if "ref_log_prob" in batch and "ref_log_prob" not in again:  # computed anew for the batch (_reference)
            batch.pop(["ref_log_prob"])
        for key in list(batch.tensors):
            if key not in again:
                raise RuntimeError(f"stale_samples=drop: the samples drawn again have no {key!r} column")
            column = batch[key].clone()
            column[rows.to(column.device)] = again[key].to(column.device, column.dtype)
            batch[key] = column
        item.generated = (batch, greedy, metrics)

    _was_ahead = 0.0  # whether this step's batch came from the queue

    def generate_ahead(self, ctx: "StepContext") -> dict[str, float]:
        """Inside ``update_step`` of step ``ctx.step`` (the step-paced schedules call it): a segment of
        each batch in flight, then the next steps' batches while the bound allows, with the weights of
        ``ctx.version``."""
        trainer = self.trainer
        made = 0
        if self.partial_tokens is not None and trainer.rollout is not None:  # a segment of each batch in flight
            with trainer.phase("gen"), trainer.rollout.phase():  # one weight sync for them all
                for item in self.queue:
                    if item.state is State.IN_FLIGHT:
                        self.queue.assert_in_flight(item)
                        item.partial.advance(trainer.rollout.generate_segment, ctx.version)
        while len(self.queue) < self.depth:
            item = self._draw(ctx.step + len(self.queue) + 1)
            if item is None:
                break
            self.queue.draw(item)
            if trainer.rollout is not None:  # begun now with the step's weights
                self._start(item)
            made += 1
        if self.fill_window and trainer.rollout is not None:
            self._fill(ctx.version)
        return {"async/generated_in_update": float(made)}

    def _fill(self, version: int) -> int:
        """``fill_window``: segments of the unfinished batches in flight (the next step's first), with
        the weights of policy ``version``, until the actor's update is done or every batch in flight
        has ended; returns the segments run."""
        trainer = self.trainer
        store = self._store()
        ran = 0
        with trainer.phase("gen"), trainer.rollout.phase():
            while True:
                pending = [item for item in self.queue if item.state is State.IN_FLIGHT and not item.partial.finished]
                if not pending:
                    return ran
                for item in pending:
                    if self._update_is_done(store):
                        return ran
                    self.queue.assert_in_flight(item)
                    item.partial.advance(trainer.rollout.generate_segment, version)
                    ran += 1

    def _update_is_done(self, store: Any) -> bool:
        """``fill_window``, on the rollout's ranks before each segment: whether the actor's update
        is done. Several rollout ranks make each segment together (their engine calls are
        collectives), so they agree: done once any of them has read the count's change."""
        done = int(store.add(_UPDATES_KEY, 0)) > self._updates_before
        group = self.trainer.rollout.world
        if group is not None and torch.distributed.get_world_size(group) > 1:
            from verl.protocol.collectives import comm_device

            flag = torch.tensor([int(done)], device=comm_device(group))
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
            done = bool(flag.item())
        return done

    def update_done(self, ctx: "StepContext") -> None:
        """``fill_window``, on every rank once its updates are done: the actor's first rank counts
        the update on the store (the rollout's rank stops filling at the count's change)."""
        trainer = self.trainer
        if self.fill_window and torch.distributed.get_rank() == trainer.world.source["actor"]:
            self._store().add(_UPDATES_KEY, 1)

    @staticmethod
    def _store() -> Any:
        """torch.distributed's default store (the one every rank started with)."""
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()

    # -- checkpoints --------------------------------------------------------------------------

    def save_state(self, checkpoint_dir: str) -> None:
        """Write the queue under ``checkpoint_dir/rollout_queue/`` (the rollout's first rank writes;
        every rank calls it)."""
        trainer = self.trainer
        if trainer.rollout is None or torch.distributed.get_rank() != trainer.world.source["rollout"]:
            return
        folder = os.path.join(checkpoint_dir, QUEUE_DIR)
        os.makedirs(folder, exist_ok=True)
        index = []
        for i, item in enumerate(self.queue):
            batch, greedy, metrics = item.generated
            if item.state is State.IN_FLIGHT:  # its samples so far, per-token versions included
                item.partial.save(os.path.join(folder, f"{i}.partial"))
            elif item.state is State.FINISHED:
                batch.save(os.path.join(folder, f"{i}.batch"))
            if greedy is not None:
                greedy.save(os.path.join(folder, f"{i}.greedy"))
            if item.prompts is not None:
                item.prompts.save(os.path.join(folder, f"{i}.prompts"))
            index.append({
                "step": item.step, "version": item.version, "metrics": metrics, "greedy": greedy is not None,
                "partial": item.state is State.IN_FLIGHT, "prompts": item.prompts is not None,
                "begun": item.state is not State.DRAWN, "state": item.state.value,
            })
        with open(os.path.join(folder, "index.json"), "w", encoding="utf-8") as f:
            json.dump({"exhausted": self.queue.exhausted, "batches": index}, f)

    def load_state(self, checkpoint_dir: str) -> None:
        """Restore the queue :meth:`save_state` wrote (a checkpoint without one: an empty queue)."""
        from verl.protocol import Batch

        trainer = self.trainer
        folder = os.path.join(checkpoint_dir, QUEUE_DIR)
        self.queue.restore([], exhausted=False)
        path = os.path.join(folder, "index.json")
        if not os.path.exists(path):
            return
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        if len(saved["batches"]) > self.depth and self.stale_samples == "wait":
            raise ValueError(
                f"{checkpoint_dir} holds {len(saved['batches'])} batches generated ahead, more than this run's "
                f"staleness bound {self.depth} (trainer.rollout_mode={trainer.cfg.trainer.rollout_mode}); resume with "
                "the mode and trainer.async_training.max_staleness of the run that saved it, or with "
                "trainer.async_training.stale_samples=drop (the samples beyond the bound are then sampled again)"
            )
        here = trainer.rollout is not None
        batches = []
        for i, entry in enumerate(saved["batches"]):
            item = AheadBatch(step=int(entry["step"]), version=int(entry["version"]))
            batches.append(item)
            if here:
                greedy = Batch.load(os.path.join(folder, f"{i}.greedy")) if entry["greedy"] else None
                if entry.get("partial"):  # (a queue saved before partial rollout existed has no such key)
                    from verl.trainer.step.partial import PartialBatch

                    if self.partial_tokens is None:
                        raise ValueError(
                            f"{checkpoint_dir} holds a batch in flight of a partial rollout; resume with "
                            "trainer.async_training.partial_rollout=true"
                        )
                    item.partial, item.state = PartialBatch.load(os.path.join(folder, f"{i}.partial")), State.IN_FLIGHT
                    item.generated = (None, greedy, entry["metrics"])
                elif not entry.get("begun", True):  # its prompts only: begun by the thread, or at its step
                    item.generated = (None, greedy, entry["metrics"])
                else:
                    item.generated = (Batch.load(os.path.join(folder, f"{i}.batch")), greedy, entry["metrics"])
                    item.state = State.FINISHED
                if entry.get("prompts"):
                    item.prompts = Batch.load(os.path.join(folder, f"{i}.prompts"))
        self.queue.restore(batches, exhausted=bool(saved["exhausted"]))
