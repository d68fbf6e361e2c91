"""``HumanReviewOperator``: a person scores the samples a predicate picks, before the update.

Put it after the reward operator (it reads ``token_level_scores``) and before
``PPOUpdateOperator``. Each step it

1. picks the samples ``select(sample)`` is true for (``sample``: ``verl.trainer.step.ops.sample_view``,
   the per-sample view FilterOperator's predicate gets: ``reward``, per-sample fields);
2. queues them (decoded prompt and response, model reward) in SQLite
   (:class:`verl.serving.review.ReviewStore`, ``<trainer.default_local_dir>/human_review.sqlite`` by
   default) and serves the review page on ``host:port`` (started on the first step, kept up
   between steps; ``url`` says where);
3. waits until every picked sample is reviewed or ``timeout_s`` has passed, then merges the
   decisions into the batch's rewards:

   - **approve**: the model's reward stands (the reviewer confirms it); the row is unchanged;
   - **reject**: the reward becomes 0;
   - **score x**: the reward becomes x (within ``score_range``);
   - not reviewed in time: the model's reward stands; the item is marked expired.

   A changed reward replaces the sample's ``token_level_scores`` row with the new sequence score
   on its last response token (the reward operators' convention).

Adds ``review_status`` (per sample: ``""`` not picked, ``approve``, ``reject``, ``score``,
``timeout``) and logs ``review/selected``, ``review/reviewed``, ``review/approved``,
``review/rejected``, ``review/scored``, ``review/timed_out``, ``review/wait_s`` and
``review/human_score_mean`` (the merged rewards of the reviewed samples).

A restart loses nothing: pending items and reviews live in the database, and a resumed run that
samples the same step again (same prompt, same response) finds its reviews there.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from verl.trainer.step.base import Operator
from verl.trainer.step.ops import sample_view

if TYPE_CHECKING:
    from verl.protocol import Batch

logger = logging.getLogger(__name__)

__all__ = ["HumanReviewOperator", "REVIEW_DB_FILE"]

REVIEW_DB_FILE = "human_review.sqlite"
"""The database's file name in the run directory (``trainer.default_local_dir``)."""

_POLL_S = 0.25  # also catches reviews recorded by another process on the same database


class HumanReviewOperator(Operator):
    """Human review of the samples ``select`` picks, merged into the rewards (module docstring).

    Args:
        select: ``f(sample) -> bool`` on each sample's view (``sample["reward"]``, per-sample fields).
        timeout_s: how long a step waits for the reviews of its samples (0: queue, do not wait).
        port: the review page's port (0: a free one; see :attr:`url`).
        host: the page's bind address; a non-loopback one needs ``api_key``.
        db_path: the SQLite file; ``<trainer.default_local_dir>/human_review.sqlite`` by default.
        score_range: the scores a reviewer may set, ``(low, high)``.
        api_key: when set, the page is opened as ``url`` + ``?key=<api_key>``.
        tokenizer: decodes prompts and responses for the page; the trainer's by default.
    """

    inputs = ("prompts", "responses", "response_mask", "attention_mask", "token_level_scores")
    outputs = ("review_status",)

    def __init__(
        self,
        select: Callable[[dict[str, Any]], bool],
        *,
        timeout_s: float = 300.0,
        port: int = 0,
        host: str = "127.0.0.1",
        db_path: str | None = None,
        score_range: tuple[float, float] = (0.0, 1.0),
        api_key: str | None = None,
        tokenizer: Any = None,
    ) -> None:
        super().__init__()
        if not callable(select):
            raise TypeError(
                f"HumanReviewOperator(select=...) takes a function of a sample, got {type(select).__name__}"
            )
        if not timeout_s >= 0:
            raise ValueError(f"HumanReviewOperator(timeout_s={timeout_s}): it must be >= 0 seconds")
        if not 0 <= int(port) <= 65535:
            raise ValueError(f"HumanReviewOperator(port={port}): not a port number (0 picks a free one)")
        from verl.serving.server import check_bind

        check_bind(host, api_key)
        lo, hi = score_range
        if not lo < hi:
            raise ValueError(f"HumanReviewOperator(score_range={score_range}): low must be below high")
        self.select = select
        self.timeout_s = float(timeout_s)
        self.port = int(port)
        self.host = host
        self.db_path = None if db_path is None else os.path.abspath(os.fspath(db_path))
        self.score_range = (float(lo), float(hi))
        self.api_key = api_key
        self._tokenizer = tokenizer
        self._store = None
        self._server = None
        self._closing = threading.Event()
        self._step_lock = threading.Lock()
        self._calls = 0

    # -- the page -------------------------------------------------------------------------

    @property
    def store(self) -> Any:
        """The :class:`verl.serving.review.ReviewStore` (opened on first use)."""
        if self._store is None:
            from verl.serving.review import ReviewStore

            path = self.db_path
            if path is None:
                if self._trainer is None:
                    raise ValueError(
                        "HumanReviewOperator needs db_path= when it is not in a DataStream with a trainer"
                    )
                path = os.path.join(
                    os.path.abspath(self.trainer.cfg.trainer.default_local_dir), REVIEW_DB_FILE
                )
                os.makedirs(os.path.dirname(path), exist_ok=True)
            self._store = ReviewStore(path)
            self.db_path = path
        return self._store

    def start(self) -> str:
        """Serve the review page (if not yet); returns its URL."""
        if self._server is None:
            from verl.serving.review import create_review_app
            from verl.serving.server import BackgroundServer

            app = create_review_app(self.store, score_range=self.score_range, api_key=self.api_key)
            self._server = BackgroundServer(app, host=self.host, port=self.port).start()
            self._closing.clear()
            logger.info("human review page: %s/ (database %s)", self._server.url, self.db_path)
        return self.url

    @property
    def url(self) -> str:
        """The review page's base URL (the server must be started)."""
        if self._server is None:
            raise ValueError("the review page is not served yet: call start() or run a step")
        return self._server.url

    def close(self) -> None:
        """Stop the page and close the database; a step waiting for reviews fails (its items stay pending)."""
        self._closing.set()
        if self._store is not None:
            self._store.changed.set()  # wake a waiting step now
        if not self._step_lock.acquire(timeout=60):
            raise RuntimeError("HumanReviewOperator.close: a step did not stop waiting for reviews within 60 s")
        try:
            self._close_parts()
        finally:
            self._step_lock.release()

    def _close_parts(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._store is not None:
            self._store.close()
            self._store = None

    # -- the step -------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer if self._tokenizer is not None else self.trainer.tokenizer

    def _texts(self, batch: "Batch", i: int) -> tuple[str, str]:
        width = batch["prompts"].shape[1]
        prompt_mask = batch["attention_mask"][i, :width].bool()
        prompt = self.tokenizer.decode(batch["prompts"][i][prompt_mask].tolist(), skip_special_tokens=True)
        resp_mask = batch["response_mask"][i].bool()
        response = self.tokenizer.decode(batch["responses"][i][resp_mask].tolist(), skip_special_tokens=True)
        return prompt, response

    def _step(self) -> int:
        if self._trainer is not None:
            return self._trainer.step_in_progress()  # the step this batch is for
        self._calls += 1
        return self._calls

    def _await_reviews(
        self, step: int, batch: "Batch", picked: list[int], reward: torch.Tensor
    ) -> tuple[list[int], dict[int, dict[str, Any]], int, float]:
        """Queue the picked samples, wait for their reviews; (ids, rows, how many timed out, seconds waited)."""
        self.start()
        store = self.store
        queued = [(i, *self._texts(batch, i), float(reward[i])) for i in picked]
        ids = store.add(step, queued)
        logger.info("step %d: %d sample(s) wait for review at %s/", step, len(ids), self.url)
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        while True:
            if self._closing.is_set():
                pending = sum(r["status"] == "pending" for r in store.get(ids).values())
                raise RuntimeError(
                    f"HumanReviewOperator was closed while step {step} waited for {pending} review(s); "
                    f"they stay pending in {self.db_path}"
                )
            rows = store.get(ids)
            waiting = [k for k in ids if rows[k]["status"] == "pending"]
            if not waiting or time.monotonic() >= deadline:
                break
            store.changed.clear()
            store.changed.wait(min(_POLL_S, max(deadline - time.monotonic(), 0.0)))
        timed_out = store.expire(waiting)
        return ids, store.get(ids), timed_out, time.monotonic() - t0

    def process(self, batch: "Batch") -> "tuple[Batch, dict[str, float]]":
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() > 1:
            # One page and one queue per run; which rank reviews and how decisions reach the
            # other ranks' batches is not built yet.
            raise ValueError(
                f"HumanReviewOperator runs in a world of one process; this run has {dist.get_world_size()} "
                "ranks. Run the reviewed stream with one process (no torchrun)"
            )
        scores = batch["token_level_scores"]  # [B, R]
        reward = scores.sum(-1)  # [B]
        step = self._step()
        picked = [i for i in range(len(batch)) if self.select(sample_view(batch, i, reward))]
        status = [""] * len(batch)
        metrics = {"review/selected": float(len(picked))}
        if not picked:
            batch["review_status"] = status
            return batch, {**metrics, "review/reviewed": 0.0, "review/timed_out": 0.0}
        with self._step_lock:  # close() waits for this block before it closes the database
            ids, rows, timed_out, wait_s = self._await_reviews(step, batch, picked, reward)
        new_scores = scores.clone()
        counts = {"approve": 0, "reject": 0, "score": 0}
        merged = []
        for item_id, i in zip(ids, picked):
            row = rows[item_id]
            if row["status"] != "reviewed":
                status[i] = "timeout"
                continue
            decision = row["decision"]
            counts[decision] += 1
            status[i] = decision
            if decision == "approve":
                merged.append(float(reward[i]))
                continue
            value = 0.0 if decision == "reject" else float(row["human_score"])
            merged.append(value)
            length = int(batch["response_mask"][i].sum())
            new_scores[i] = 0.0
            new_scores[i, max(length - 1, 0)] = value  # the sequence score on the last response token
        batch["token_level_scores"] = new_scores
        batch["review_status"] = status
        metrics.update(
            {
                "review/reviewed": float(sum(counts.values())),
                "review/approved": float(counts["approve"]),
                "review/rejected": float(counts["reject"]),
                "review/scored": float(counts["score"]),
                "review/timed_out": float(timed_out),
                "review/wait_s": wait_s,
            }
        )
        if merged:
            metrics["review/human_score_mean"] = float(torch.tensor(merged).mean())
        if timed_out:
            logger.info(
                "step %d: %d of %d sample(s) not reviewed within %.0f s keep their model reward",
                step,
                timed_out,
                len(ids),
                self.timeout_s,
            )
        return batch, metrics
