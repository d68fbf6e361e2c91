"""Score a batch of responses with rule-based reward functions.

``RewardManager(tokenizer)(batch)`` decodes each response (only its valid tokens), scores
it with ``compute_score`` (``default_compute_score`` unless the user gives their own), and
puts the score on the response's last valid token of ``token_level_scores`` [B, T], which is
how outcome rewards enter the token-level advantage estimators.

The core, ``RewardManager.score_texts``, takes plain lists, so any caller (validation, a
custom loop, tests) can score strings without building a batch.

Robustness contract: scoring never raises for a response. A scorer that raises, returns
something that is not a score, returns NaN/inf, or runs longer than ``timeout_s`` gives 0.0
for that sample, counted in ``RewardOutput.num_failed`` and logged once per batch. Only
configuration errors raise: an unknown ``data_source`` (before anything is scored), missing
batch columns, a compute function that cannot be sent to worker processes.

With ``num_workers > 0`` samples are scored in a process pool (spawned workers, so a
hung or crashed scorer cannot take the trainer down); each sample runs under ``timeout_s``
in its worker's main thread. If a worker dies or the whole batch overruns, the unfinished
samples score 0.0 and the pool is replaced on the next call.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import multiprocessing
import os
import pickle
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from verl import sandbox
from verl.rewards.registry import (
    default_compute_score,
    get_scorer,
    load_custom_reward_fn,
    reference_compute_score,
)
from verl.rewards.scoring import SampleScore, score_chunk

logger = logging.getLogger(__name__)

# The built-in scorer tables by ``reward_model.rule_scoring``: ours, or the reference verl's exact
# scores (data sources it has no scorer for use ours in both).
RULE_SCORING: dict[str, Callable[..., Any]] = {
    "lenient": default_compute_score,
    "reference": reference_compute_score,
}

# Slack on top of timeout_s * ceil(samples / workers) for the whole pool batch: worker
# start-up (spawn + import, a few seconds on a loaded machine) and result transfer.
_POOL_SLACK_S = 60.0


@dataclass(frozen=True, kw_only=True)
class OverlongBuffer:
    """DAPO's soft overlong punishment (``reward_model.overlong_buffer``), see ``verl.algos.dapo``."""

    len: int
    """Buffer length in tokens: responses longer than ``max_response_length - len`` lose reward."""
    penalty_factor: float = 1.0
    """Penalty at ``max_response_length`` (it grows linearly across the buffer)."""
    max_response_length: int
    """``data.max_response_length``: the longest response the rollout may produce."""

    def __post_init__(self) -> None:
        if not 0 < self.len <= self.max_response_length:
            raise ValueError(
                f"reward_model.overlong_buffer.len={self.len} must be in [1, data.max_response_length="
                f"{self.max_response_length}] when the overlong buffer is enabled"
            )
        if self.penalty_factor < 0:
            raise ValueError(f"reward_model.overlong_buffer.penalty_factor={self.penalty_factor} must be >= 0")


@dataclass(kw_only=True)
class RewardOutput:
    """What ``RewardManager`` returns for a batch of B responses of length T."""

    token_level_scores: torch.Tensor
    """[B, T] float32: each response's score on its last valid token, zeros elsewhere."""
    scores: torch.Tensor
    """[B] float32: each response's score, plus the overlong penalty when on (the row sum of
    ``token_level_scores``, except for a response with no valid token, where nothing is placed)."""
    extra_info: dict[str, list[Any]] = field(default_factory=dict)
    """Per-sample extra fields returned by dict-valued scorers, each a list of length B
    (None where a sample's scorer did not return that field); ``overlong_penalty`` too when on."""
    num_failed: int = 0
    """Samples whose scorer raised, timed out or returned a non-score (scored 0.0)."""


def _shutdown_pool(pool: cf.ProcessPoolExecutor, kill: bool) -> None:
    pool.shutdown(wait=not kill, cancel_futures=True)
    if kill:
        # A worker stuck in C code ignores the in-worker timer; only killing it frees it.
        # ProcessPoolExecutor has no public way before Python 3.14's terminate_workers().
        terminate = getattr(pool, "terminate_workers", None)
        if terminate is not None:
            terminate()
        else:
            for proc in list((getattr(pool, "_processes", None) or {}).values()):
                proc.kill()


class RewardManager:
    """Rule-based rewards for a batch of rollouts.

    Args:
        tokenizer: decodes ``responses``; anything with ``batch_decode(ids, skip_special_tokens=)``.
        compute_score: ``fn(data_source, solution_str, ground_truth, extra_info) -> float | dict``
            called with keyword arguments; ``default_compute_score`` when None (then every
            ``data_source`` in a batch is checked against the registry before scoring).
        num_workers: 0 scores in this process; N > 0 in a pool of N spawned processes
            (``compute_score`` must then be picklable: a module-level function or a
            ``FileRewardFunction``).
        timeout_s: limit per sample (None: none). In-process it needs the main thread.
        overlong_buffer: DAPO overlong punishment added to each score, or None.
        skip_special_tokens: passed to the tokenizer when decoding responses.
        reward_fn_key: the non-tensor column whose value picks the scorer (``data.reward_fn_key``).
        rule_scoring: which built-in scorers serve when ``compute_score`` is None: "lenient"
            (``default_compute_score``) or "reference" (``reference_compute_score``: the
            reference verl's exact scores; ``reward_model.rule_scoring``).
    """

    def __init__(
        self,
        tokenizer: Any,
        compute_score: Callable[..., Any] | None = None,
        *,
        num_workers: int = 0,
        timeout_s: float | None = 30.0,
        overlong_buffer: OverlongBuffer | None = None,
        skip_special_tokens: bool = True,
        reward_fn_key: str = "data_source",
        rule_scoring: str = "lenient",
    ) -> None:
        if rule_scoring not in RULE_SCORING:
            raise ValueError(
                f"reward_model.rule_scoring={rule_scoring!r} is not one of {sorted(RULE_SCORING)}"
            )
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"reward num_workers must be an int >= 0, got {num_workers!r}")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"reward timeout_s must be > 0 or None, got {timeout_s!r}")
        self.tokenizer = tokenizer
        self.compute_score = compute_score if compute_score is not None else RULE_SCORING[rule_scoring]
        self.rule_scoring = rule_scoring
        self.uses_registry = compute_score is None
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.overlong_buffer = overlong_buffer
        self.skip_special_tokens = skip_special_tokens
        self.reward_fn_key = reward_fn_key
        if num_workers > 0:
            try:
                pickle.dumps(self.compute_score)
            except Exception as exc:
                raise ValueError(
                    f"reward num_workers={num_workers} needs a picklable compute_score (a module-level "
                    f"function or custom_reward_function.path/name); {self.compute_score!r} is not: {exc}"
                ) from exc
        self._pool: cf.ProcessPoolExecutor | None = None
        self._finalizer: weakref.finalize | None = None

    # ------------------------------------------------------------------ pool lifetime
    def _get_pool(self) -> cf.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = cf.ProcessPoolExecutor(
                max_workers=self.num_workers, mp_context=multiprocessing.get_context("spawn")
            )
            self._finalizer = weakref.finalize(self, _shutdown_pool, self._pool, False)
        return self._pool

    def _drop_pool(self, kill: bool) -> None:
        if self._pool is not None:
            assert self._finalizer is not None
            self._finalizer.detach()
            _shutdown_pool(self._pool, kill)
            self._pool = None

    def close(self) -> None:
        """Shut the worker pool down (a later call starts a new one)."""
        self._drop_pool(kill=False)

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ scoring on plain lists
    def score_texts(
        self,
        solutions: Sequence[str],
        ground_truths: Sequence[Any],
        data_sources: Sequence[str],
        extra_infos: Sequence[Any] | None = None,
    ) -> list[SampleScore]:
        """Score B responses given as strings; one ``SampleScore`` per response, in order."""
        n = len(solutions)
        if extra_infos is None:
            extra_infos = [None] * n
        if not (len(ground_truths) == len(data_sources) == len(extra_infos) == n):
            raise ValueError(
                f"score_texts needs one entry per response: {n} solutions, {len(ground_truths)} ground "
                f"truths, {len(data_sources)} data sources, {len(extra_infos)} extra_infos"
            )
        if self.uses_registry:
            for ds in dict.fromkeys(data_sources):
                get_scorer(ds)  # an unknown data_source is a config error: fail before any work
        items = list(zip(data_sources, solutions, ground_truths, extra_infos))
        if self.num_workers == 0 or n == 0:
            results = score_chunk(self.compute_score, items, self.timeout_s)
        else:
            results = self._score_in_pool(items)
        failed = [(i, r.error) for i, r in enumerate(results) if r.error is not None]
        if failed:
            i, err = failed[0]
            logger.warning(
                "%d of %d responses could not be scored and got 0.0; first: #%d (data_source=%r): %s",
                len(failed),
                n,
                i,
                data_sources[i],
                err,
            )
        return results

    def _score_in_pool(self, items: list[tuple[str, str, Any, Any]]) -> list[SampleScore]:
        n = len(items)
        # A few chunks per worker: fewer round trips than one task per sample, and a slow
        # chunk does not leave the other workers idle for long.
        chunk = max(1, math.ceil(n / (4 * self.num_workers)))
        pool = self._get_pool()
        parts = [items[s : s + chunk] for s in range(0, n, chunk)]
        futures = {pool.submit(score_chunk, self.compute_score, part, self.timeout_s): len(part) for part in parts}
        deadline = None
        if self.timeout_s is not None:
            deadline = self.timeout_s * math.ceil(n / self.num_workers) + _POOL_SLACK_S
        t0 = time.monotonic()
        _, not_done = cf.wait(futures, timeout=deadline)
        broken = bool(not_done)
        results: list[SampleScore] = []
        for fut, size in futures.items():  # dicts keep insertion order: chunks in order
            if fut in not_done:
                err = f"batch scoring exceeded {time.monotonic() - t0:.0f} s"
                results.extend([SampleScore(0.0, {}, err)] * size)
                continue
            try:
                results.extend(fut.result())
            except Exception as exc:  # a worker died (segfault, OOM kill) or results did not pickle
                broken = True
                err = f"worker failed: {type(exc).__name__}: {exc}"[:400]
                if isinstance(exc, cf.process.BrokenProcessPool):
                    err += (
                        " (spawned workers re-import the main script: is its entry point under "
                        "`if __name__ == '__main__':`?)"
                    )
                results.extend([SampleScore(0.0, {}, err)] * size)
        if broken:
            self._drop_pool(kill=True)
        assert len(results) == n
        return results

    # ------------------------------------------------------------------ the Batch-facing call
    def __call__(self, batch: Any) -> RewardOutput:
        """Score a rollout ``Batch``.

        Reads ``responses`` [B, T] (token ids), ``response_mask`` [B, T] (or the last T
        columns of ``attention_mask``), and the non-tensor columns ``data_source`` [B] (or
        whichever ``reward_fn_key`` names),
        ``reward_model`` [B] (dicts with ``ground_truth``; or a ``ground_truth`` column) and
        optionally ``extra_info`` [B].
        """
        responses = batch["responses"]  # [B, T]
        if responses.dim() != 2:
            raise ValueError(f"batch['responses'] must be [B, T] token ids, got shape {list(responses.shape)}")
        mask = self._response_mask(batch, responses)  # [B, T] bool
        B, T = responses.shape
        ids = [responses[i][mask[i]].tolist() for i in range(B)]
        solutions = list(self.tokenizer.batch_decode(ids, skip_special_tokens=self.skip_special_tokens)) if B else []
        data_sources = [str(ds) for ds in self._column(batch, self.reward_fn_key)]
        ground_truths = self._ground_truths(batch)
        extra_infos = list(batch.non_tensors["extra_info"]) if "extra_info" in batch.non_tensors else [None] * B

        results = self.score_texts(solutions, ground_truths, data_sources, extra_infos)
        device = responses.device
        scores = torch.tensor([r.score for r in results], dtype=torch.float32, device=device)  # [B]
        keys = list(dict.fromkeys(k for r in results for k in r.extra))
        extra_info = {k: [r.extra.get(k) for r in results] for k in keys}
        if self.overlong_buffer is not None and B:
            from verl.algos.dapo import overlong_penalty

            penalty = overlong_penalty(
                mask,
                max_response_length=self.overlong_buffer.max_response_length,
                overlong_buffer_len=self.overlong_buffer.len,
                overlong_penalty_factor=self.overlong_buffer.penalty_factor,
            )  # [B]
            scores = scores + penalty
            extra_info["overlong_penalty"] = penalty.tolist()

        token_level_scores = torch.zeros((B, T), dtype=torch.float32, device=device)
        if B and T:
            positions = torch.arange(T, device=device).expand(B, T)
            last = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=-1).values  # [B]
            rows = torch.nonzero(last >= 0).flatten()
            token_level_scores[rows, last[rows]] = scores[rows]
            num_placed = len(rows)
        else:
            num_placed = 0
        if num_placed < B:
            logger.warning("%d of %d responses have no valid token: their score is not placed", B - num_placed, B)
        return RewardOutput(
            token_level_scores=token_level_scores,
            scores=scores,
            extra_info=extra_info,
            num_failed=sum(r.error is not None for r in results),
        )

    @staticmethod
    def _column(batch: Any, key: str) -> np.ndarray:
        if key not in batch.non_tensors:
            raise ValueError(
                f"the batch has no non-tensor column {key!r} needed for rule-based rewards; "
                f"it has {sorted(batch.non_tensors)} (the dataset record must carry {key!r})"
            )
        return batch.non_tensors[key]

    def _ground_truths(self, batch: Any) -> list[Any]:
        if "ground_truth" in batch.non_tensors:
            return list(batch.non_tensors["ground_truth"])
        column = self._column(batch, "reward_model")
        out = []
        for i, rm in enumerate(column):
            if not isinstance(rm, Mapping) or "ground_truth" not in rm:
                raise ValueError(
                    f"reward_model[{i}] must be a dict with 'ground_truth', got {rm!r:.200}; "
                    "the dataset record's reward_model column should be {'style': 'rule', 'ground_truth': ...}"
                )
            out.append(rm["ground_truth"])
        return out

    @staticmethod
    def _response_mask(batch: Any, responses: torch.Tensor) -> torch.Tensor:
        """[B, T] bool: ``response_mask``, else the last T columns of ``attention_mask``."""
        if "response_mask" in batch.tensors:
            mask = batch["response_mask"]
        elif "attention_mask" in batch.tensors:
            mask = batch["attention_mask"][:, -responses.shape[1] :]
        else:
            raise ValueError("the batch needs 'response_mask' [B, T] or 'attention_mask' [B, P+T] to find valid tokens")
        if mask.shape != responses.shape:
            raise ValueError(
                f"response mask shape {list(mask.shape)} does not match responses {list(responses.shape)}"
            )
        return mask.bool()


# Reward manager names (config ``reward_model.reward_manager``) as in the reference verl. One
# class serves them all: "naive" and "dapo" score in-process ("dapo" run scripts also enable
# ``reward_model.overlong_buffer``, which any manager here honours); "prime" scores in a
# process pool with one worker per CPU core (at most 32).
REWARD_MANAGERS: dict[str, Callable[[], int]] = {
    "naive": lambda: 0,
    "dapo": lambda: 0,
    "prime": lambda: min(32, os.cpu_count() or 1),
}


def reward_manager_from_config(config: Any, tokenizer: Any) -> RewardManager:
    """The ``RewardManager`` a PPO config asks for (``verl.config.PPOConfig``: reward_model
    (reward_manager, overlong_buffer, rule_scoring), custom_reward_function,
    data.max_response_length, data.reward_fn_key)."""
    name = config.reward_model.reward_manager
    if name not in REWARD_MANAGERS:
        raise ValueError(f"reward_model.reward_manager={name!r} is not one of {sorted(REWARD_MANAGERS)}")
    custom = config.custom_reward_function
    # The code scorers run programs through the process-wide sandbox; the pool's spawned
    # workers inherit this config through the environment (verl.sandbox.configure).
    sandbox.configure(config.sandbox)
    if custom.path and config.reward_model.rule_scoring != "lenient":
        logger.info(
            "reward_model.rule_scoring=%s applies to the built-in scorers; custom_reward_function %s:%s "
            "scores on its own (it can call verl.rewards.reference_compute_score)",
            config.reward_model.rule_scoring,
            custom.path,
            custom.name,
        )
    buffer_cfg = config.reward_model.overlong_buffer
    overlong = None
    if buffer_cfg.enable:
        overlong = OverlongBuffer(
            len=buffer_cfg.len,
            penalty_factor=buffer_cfg.penalty_factor,
            max_response_length=config.data.max_response_length,
        )
    return RewardManager(
        tokenizer,
        load_custom_reward_fn(custom.path, custom.name),
        num_workers=REWARD_MANAGERS[name](),
        overlong_buffer=overlong,
        reward_fn_key=config.data.reward_fn_key,
        rule_scoring=config.reward_model.rule_scoring,
    )
