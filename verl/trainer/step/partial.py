"""Partial rollout (``trainer.async_training.partial_rollout``): a batch generated in segments, so
that a weight update between two segments does not throw away the unfinished samples.

A :class:`PartialBatch` holds one step's batch in flight: per sample (prompt-major, the ``n``
samples of a prompt adjacent) the tokens sampled so far, the engine's log-probability of each and
the policy version that sampled each. :meth:`PartialBatch.advance` runs one segment, one engine
call (``Rollout.generate_segment``) with whatever weights the engine holds now: the first segment
samples ``n`` responses of each prompt, a later one continues each unfinished sample from its
prefix (prompt + its tokens so far, fed to the engine as a prompt) for at most
``partial_rollout_tokens`` more tokens. Segment ``k`` samples with ``seed + k * SEGMENT_STRIDE``,
so a batch is reproducible from its seed and the weights of each segment.

A sample is finished when a segment ends it with a stop token (the tokenizer's eos unless
``ignore_eos``, or one of ``stop_token_ids``), or when it reaches ``response_length``.
:meth:`PartialBatch.assemble` then gives the engine's usual output (``verl.rollout.base``) plus

- ``rollout_token_versions`` ``[B*n, R]`` long: the version that sampled each response token
  (-1 at pads), beside ``rollout_log_probs`` (each from the weights of that token's segment);
- ``rollout_version`` ``[B*n]`` long: the version that began the sample (its oldest token's).

Departure from one engine call: the engine sees a resumed sample as a new prompt, so its
KV cache is rebuilt for the prefix (vLLM's prefix cache, when on, reuses what it can), and
stop strings that span two segments would go unseen (the pre-flight refuses stop strings with
partial rollout).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Callable

import torch

from verl.rollout.base import Sample, assemble_rollout, left_pad, prompt_token_lists, rollout_metrics

if TYPE_CHECKING:
    from verl.protocol import Batch

__all__ = ["SEGMENT_STRIDE", "PartialBatch", "Segment"]

SEGMENT_STRIDE = 7919  # seed offset of each segment after the first (a prime: no clash with the calls' strides)

# Rollout.generate_segment: (rows, seed, max_tokens, n) -> the engine's output batch
Segment = Callable[..., "Batch"]


class PartialBatch:
    """One step's batch in flight (module docstring).

    Args:
        prompts: the step's prompt batch (left-padded ``input_ids``/``attention_mask`` and the
            non-tensor columns the output repeats).
        n: samples per prompt.
        response_length: ``R``, the most tokens of a response.
        segment_tokens: the most new tokens of one segment.
        stop_ids: the token ids that end a sample.
        seed: the batch's sampling seed (segment ``k`` samples with ``seed + k * SEGMENT_STRIDE``).
        pad_token_id: the engine's pad id.
    """

    def __init__(
        self,
        prompts: "Batch",
        *,
        n: int,
        response_length: int,
        segment_tokens: int,
        stop_ids: set[int] | frozenset[int],
        seed: int,
        pad_token_id: int,
    ) -> None:
        if segment_tokens < 1 or response_length < 1 or n < 1:
            raise ValueError(f"PartialBatch: n={n}, response_length={response_length}, segment_tokens={segment_tokens} must be >= 1")
        self.prompts = prompts
        self.n = n
        self.response_length = response_length
        self.segment_tokens = segment_tokens
        self.stop_ids = frozenset(int(i) for i in stop_ids)
        self.seed = int(seed)
        self.pad_token_id = int(pad_token_id)
        rows = len(prompts) * n
        self.tokens: list[list[int]] = [[] for _ in range(rows)]
        self.logprobs: list[list[float]] = [[] for _ in range(rows)]
        self.versions: list[list[int]] = [[] for _ in range(rows)]
        self.done = [False] * rows
        self.segments = 0  # engine calls so far
        self.seconds = 0.0  # their time

    # -- generation -----------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """Whether every sample has ended (and :meth:`assemble` may be called)."""
        return self.segments > 0 and all(self.done)

    def advance(self, segment: Segment, version: int) -> int:
        """One segment with the engine's current weights (policy ``version``): the first samples
        ``n`` responses of each prompt, a later one continues the unfinished samples. Returns the
        samples it extended (0 once :attr:`finished`)."""
        if self.finished:
            return 0
        start = time.perf_counter()
        seed = self.seed + self.segments * SEGMENT_STRIDE
        if self.segments == 0:
            rows = list(range(len(self.tokens)))
            limit = min(self.segment_tokens, self.response_length)
            out = segment(self.prompts, seed=seed, max_tokens=limit, n=self.n)
        else:
            rows = [i for i, d in enumerate(self.done) if not d]
            bases = prompt_token_lists(self.prompts["input_ids"], self.prompts["attention_mask"])
            prefixes = [bases[i // self.n] + self.tokens[i] for i in rows]
            ids, mask = left_pad(prefixes, max(len(p) for p in prefixes), self.pad_token_id)
            from verl.protocol import Batch

            # One limit for the whole call: every unfinished sample has the same length left
            # unless earlier segments were cut short (they never are: a short segment ends its sample).
            limit = min(self.segment_tokens, min(self.response_length - len(self.tokens[i]) for i in rows))
            out = segment(Batch.from_dict({"input_ids": ids, "attention_mask": mask}), seed=seed, max_tokens=limit, n=1)
        lengths = out["response_mask"].long().sum(dim=1)  # [rows]
        if len(lengths) != len(rows):
            raise RuntimeError(f"partial rollout: the engine returned {len(lengths)} samples for {len(rows)} rows")
        for j, i in enumerate(rows):
            k = int(lengths[j])
            new = out["responses"][j, :k].tolist()
            self.tokens[i].extend(new)
            self.logprobs[i].extend(out["rollout_log_probs"][j, :k].float().tolist())
            self.versions[i].extend([int(version)] * k)
            stopped = k < limit or (k > 0 and new[-1] in self.stop_ids)
            self.done[i] = stopped or len(self.tokens[i]) >= self.response_length
        self.segments += 1
        self.seconds += time.perf_counter() - start
        return len(rows)

    def finish(self, segment: Segment, version: int) -> None:
        """Run segments with the current weights until every sample has ended."""
        while not self.finished:
            self.advance(segment, version)

    # -- the result -----------------------------------------------------------------------

    def assemble(self) -> "tuple[Batch, dict[str, float]]":
        """The finished batch (module docstring's columns) and its ``rollout/*`` metrics (over the
        whole batch; ``rollout/time_s`` sums its segments) plus ``async/partial_segments`` and
        ``async/partial_spanning`` (the share of samples sampled by more than one version)."""
        if not self.finished:
            raise RuntimeError("PartialBatch.assemble: samples are still unfinished; call finish() first")
        samples = [
            Sample(token_ids=t, logprobs=lp, hit_length_limit=len(t) == self.response_length and (not t or t[-1] not in self.stop_ids))
            for t, lp in zip(self.tokens, self.logprobs)
        ]
        batch = assemble_rollout(
            self.prompts, samples, n=self.n, response_length=self.response_length, pad_token_id=self.pad_token_id
        )
        versions = torch.full((len(samples), self.response_length), -1, dtype=torch.long)  # [B*n, R]
        for i, v in enumerate(self.versions):
            versions[i, : len(v)] = torch.tensor(v, dtype=torch.long)
        batch["rollout_token_versions"] = versions.to(batch["responses"].device)
        began = [min(v) if v else -1 for v in self.versions]
        if min(began) < 0:
            raise RuntimeError("partial rollout: a sample has no tokens")
        batch["rollout_version"] = torch.tensor(began, dtype=torch.long, device=batch["responses"].device)
        metrics = rollout_metrics(samples, self.seconds)
        metrics["async/partial_segments"] = float(self.segments)
        metrics["async/partial_spanning"] = sum(len(set(v)) > 1 for v in self.versions) / max(len(self.versions), 1)
        return batch, metrics

    # -- checkpoints ----------------------------------------------------------------------

    def save(self, path: str) -> None:
        """Write the batch in flight to ``path`` (a folder): its prompts and every sample's tokens,
        log-probs and versions."""
        os.makedirs(path, exist_ok=True)
        self.prompts.save(os.path.join(path, "prompts.batch"))
        torch.save(
            {
                "n": self.n, "response_length": self.response_length, "segment_tokens": self.segment_tokens,
                "stop_ids": sorted(self.stop_ids), "seed": self.seed, "pad_token_id": self.pad_token_id,
                "tokens": self.tokens, "logprobs": self.logprobs, "versions": self.versions, "done": self.done,
                "segments": self.segments, "seconds": self.seconds,
            },
            os.path.join(path, "state.pt"),
        )

    @classmethod
    def load(cls, path: str) -> "PartialBatch":
        """The batch :meth:`save` wrote to ``path``."""
        from verl.protocol import Batch

        state = torch.load(os.path.join(path, "state.pt"), weights_only=True)
        out = cls(
            Batch.load(os.path.join(path, "prompts.batch")),
            n=state["n"], response_length=state["response_length"], segment_tokens=state["segment_tokens"],
            stop_ids=set(state["stop_ids"]), seed=state["seed"], pad_token_id=state["pad_token_id"],
        )
        out.tokens, out.logprobs, out.versions = state["tokens"], state["logprobs"], state["versions"]
        out.done, out.segments, out.seconds = state["done"], state["segments"], state["seconds"]
        return out
