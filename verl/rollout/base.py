"""What every rollout engine shares: sampling parameters, prompt unpadding, output assembly, metrics.

An engine turns a batch of LEFT-padded prompts into a batch of sampled sequences:

- input: ``input_ids`` / ``attention_mask`` (and optionally ``position_ids``) ``[B, P]``,
  prompts left-padded (as ``verl.data`` produces them), plus any non-tensor columns
  (``uid``, ``data_source``, ...);
- output (``B * n`` rows, the ``n`` samples of each prompt adjacent, every column of the
  input repeated alongside so ``uid`` groups the samples):

  ===================== =============== ====================================================
  ``prompts``           ``[B*n, P]``    the input ids, left-padded
  ``responses``         ``[B*n, R]``    sampled ids, right-padded with the pad id
  ``response_mask``     ``[B*n, R]``    1 for sampled tokens (the final stop/eos token too)
  ``rollout_log_probs`` ``[B*n, R]``    the engine's logprob of each sampled token, 0 at pads
  ``input_ids``         ``[B*n, P+R]``  prompt and response concatenated
  ``attention_mask``    ``[B*n, P+R]``  prompt mask and response mask concatenated
  ``position_ids``      ``[B*n, P+R]``  prompt positions, then last prompt position + 1, 2, ...
  ===================== =============== ====================================================

``R`` is always the configured ``response_length`` (fixed width, so batches from different
steps and ranks concatenate). The logprobs are those of the distribution the token was drawn
from: ``log_softmax(logits / temperature)`` with top-k/top-p filtering applied (raw logits
under greedy decoding). With ``top_k = -1`` and ``top_p = 1`` this is exactly what the trainer
recomputes from the same weights.

Engines subclass :class:`RolloutEngine` (one level) and implement ``_sample`` plus the weight
and memory hooks; ``generate`` (unpad -> sample -> assemble -> metrics) lives here once.
"""

from __future__ import annotations

import abc
import contextlib
import itertools
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from verl.protocol import Batch

if TYPE_CHECKING:
    from verl.config.schema import RolloutConfig

logger = logging.getLogger(__name__)

__all__ = [
    "RolloutEngine",
    "Sample",
    "SamplingSpec",
    "assemble_rollout",
    "left_pad",
    "prompt_token_lists",
    "rollout_metrics",
    "sampling_spec",
]

@dataclass(frozen=True, kw_only=True)
class SamplingSpec:
    """Resolved sampling parameters of one ``generate`` call (train or validation mode)."""

    n: int
    """Samples per prompt."""
    temperature: float
    """Sampling temperature; 0 means greedy decoding."""
    top_p: float
    """Nucleus threshold (1: off)."""
    top_k: int
    """Top-k (-1: off)."""
    max_tokens: int
    """Response length limit R."""
    stop: tuple[str, ...] = ()
    """Stop strings (the tokens that complete one are kept in the response)."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop token ids (kept in the response, like eos)."""
    ignore_eos: bool = False
    """Do not stop at the tokenizer's eos token."""

    @property
    def greedy(self) -> bool:
        """Whether this call decodes greedily."""
        return self.temperature == 0.0


def sampling_spec(cfg: RolloutConfig, *, validate: bool) -> SamplingSpec:
    """Sampling parameters from ``actor_rollout_ref.rollout`` (``val_kwargs`` in validation mode).

    ``do_sample: false`` (or temperature 0) means greedy decoding; ``n`` is honoured either way.
    """
    if validate:
        src = cfg.val_kwargs
        greedy = not src.do_sample or src.temperature == 0.0
        n, temperature, top_p, top_k = src.n, src.temperature, src.top_p, src.top_k
    else:
        greedy = not cfg.do_sample or cfg.temperature == 0.0
        n, temperature, top_p, top_k = cfg.n, cfg.temperature, cfg.top_p, cfg.top_k
    if greedy:
        temperature, top_p, top_k = 0.0, 1.0, -1
    return SamplingSpec(
        n=n,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_tokens=cfg.response_length,
        stop=tuple(cfg.stop),
        stop_token_ids=tuple(cfg.stop_token_ids),
        ignore_eos=cfg.ignore_eos,
    )


@dataclass(kw_only=True)
class Sample:
    """One sampled response, as an engine returns it."""

    token_ids: list[int]
    """Sampled ids, the final stop token included."""
    logprobs: list[float]
    """The engine's logprob of each sampled id (same length)."""
    hit_length_limit: bool
    """True when the response ended because it reached ``max_tokens``."""
    routed_experts: torch.Tensor | None = None
    """An engine that records routing (R3, ``verl.models.router_replay``): [prompt + response tokens, L, K]
    (``router_replay.ROUTING_DTYPE``), the experts each MoE layer sent each real token to while generating (-1 for a token the
    engine never ran through the model: vLLM's last sampled one); None otherwise."""


def prompt_token_lists(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """The real tokens of each left-padded prompt row. ``[B, P]`` x2 -> B lists of ids.

    Raises ValueError when a row is not left-padded (a 0 after a 1 in its mask) or is empty.
    """
    if input_ids.shape != attention_mask.shape or input_ids.ndim != 2:
        raise ValueError(
            f"input_ids {list(input_ids.shape)} and attention_mask {list(attention_mask.shape)} must be "
            "the same [B, P] shape"
        )
    mask = attention_mask.to(torch.bool).cpu()
    # Left padding: once a row's mask turns 1 it stays 1, i.e. the mask never decreases.
    bad = (mask[:, 1:].to(torch.int8) < mask[:, :-1].to(torch.int8)).any(dim=1)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"prompt row {row} is not left-padded (its attention_mask has a 0 after a 1); rollout "
            "engines take left-padded prompts, as verl.data's RL dataset produces them"
        )
    lengths = mask.sum(dim=1)
    if bool((lengths == 0).any()):
        row = int((lengths == 0).nonzero()[0, 0])
        raise ValueError(f"prompt row {row} has no tokens (its attention_mask is all 0)")
    ids = input_ids.cpu()
    width = ids.shape[1]
    return [ids[i, width - int(n) :].tolist() for i, n in enumerate(lengths)]


def left_pad(rows: list[list[int]], width: int, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` of token ids left-padded to ``width`` (at least the longest row): (input_ids,
    attention_mask), each [len(rows), width] long."""
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        attention_mask[i, width - len(r) :] = 1
    return input_ids, attention_mask


def assemble_rollout(
    prompts: Batch, samples: list[Sample], *, n: int, response_length: int, pad_token_id: int
) -> Batch:
    """The output batch (see module docstring) from ``B * n`` samples in prompt-major order.

    Every column of ``prompts`` (tensors and non-tensors) is repeated ``n`` times, interleaved;
    ``input_ids``/``attention_mask``/``position_ids`` are replaced by the concatenated ones.
    """
    b = len(prompts)
    assert len(samples) == b * n, f"{len(samples)} samples for {b} prompts x n={n}"
    r = response_length
    lengths = torch.tensor([len(s.token_ids) for s in samples], dtype=torch.long)  # [B*n]
    for i, s in enumerate(samples):
        assert len(s.token_ids) <= r and len(s.logprobs) == len(s.token_ids), (
            f"sample {i}: {len(s.token_ids)} tokens, {len(s.logprobs)} logprobs, limit {r}"
        )
    # Each row's tokens are a prefix of the row, so the row-major order of the mask's ones is
    # the order of the samples' tokens one after the other.
    filled = torch.arange(r).unsqueeze(0) < lengths.unsqueeze(1)  # [B*n, R]
    flat_ids = list(itertools.chain.from_iterable(s.token_ids for s in samples))
    flat_lps = list(itertools.chain.from_iterable(s.logprobs for s in samples))
    responses = torch.full((b * n, r), pad_token_id, dtype=torch.long)
    responses.masked_scatter_(filled, torch.tensor(flat_ids, dtype=torch.long))
    logprobs = torch.zeros((b * n, r), dtype=torch.float32)
    logprobs.masked_scatter_(filled, torch.tensor(flat_lps, dtype=torch.float32))
    response_mask = filled.to(torch.long)

    out = prompts.repeat(n, interleave=True)
    prompt_ids = out["input_ids"]  # [B*n, P]
    prompt_mask = out["attention_mask"].to(torch.long)  # [B*n, P]
    if "position_ids" in out:
        prompt_pos = out["position_ids"]
    else:
        prompt_pos = (prompt_mask.cumsum(dim=1) - 1).clamp(min=0)
    # Responses continue counting from the last (real, since left-padded) prompt position.
    response_pos = prompt_pos[:, -1:] + torch.arange(1, r + 1, dtype=prompt_pos.dtype)  # [B*n, R]
    out["prompts"] = prompt_ids
    out["responses"] = responses.to(prompt_ids.device)
    out["response_mask"] = response_mask.to(prompt_ids.device)
    out["rollout_log_probs"] = logprobs.to(prompt_ids.device)
    out["input_ids"] = torch.cat([prompt_ids, out["responses"]], dim=1)
    mask_dtype = out["attention_mask"].dtype
    out["attention_mask"] = torch.cat([prompt_mask.to(mask_dtype), out["response_mask"].to(mask_dtype)], dim=1)
    out["position_ids"] = torch.cat([prompt_pos, response_pos.to(prompt_pos.device)], dim=1)
    if samples and samples[0].routed_experts is not None:
        from verl.models.router_replay import ROUTED_EXPERTS

        out[ROUTED_EXPERTS] = _routed_columns(samples, prompt_mask, r).to(prompt_ids.device)
    return out


def _routed_columns(samples: list[Sample], prompt_mask: torch.Tensor, response_length: int) -> torch.Tensor:
    """The samples' ``routed_experts`` in the batch's layout [B*n, P+R, L, K]: each row's prompt part ends at
    column P (prompts are left-padded), its response part starts there; pads hold ``0..K-1``."""
    p = prompt_mask.shape[1]
    layers, k = samples[0].routed_experts.shape[1:]
    from verl.models.router_replay import ROUTING_DTYPE

    out = torch.arange(k, dtype=ROUTING_DTYPE).expand(len(samples), p + response_length, layers, k).clone()
    for i, s in enumerate(samples):
        routed, prompt_len = s.routed_experts, int(prompt_mask[i].sum())
        if routed is None or routed.shape != (prompt_len + len(s.token_ids), layers, k):
            raise ValueError(
                f"sample {i}: the engine recorded routing {None if routed is None else list(routed.shape)} for "
                f"{prompt_len} prompt + {len(s.token_ids)} response tokens, {layers} MoE layers, top {k}"
            )
        out[i, p - prompt_len : p + len(s.token_ids)] = routed
    return out


def rollout_metrics(samples: list[Sample], seconds: float) -> dict[str, float]:
    """Throughput and length statistics of one ``generate`` call."""
    lengths = [len(s.token_ids) for s in samples]
    tokens = sum(lengths)
    count = max(len(lengths), 1)
    return {
        "rollout/tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "rollout/time_s": seconds,
        "rollout/num_sequences": float(len(lengths)),
        "rollout/num_tokens": float(tokens),
        "rollout/response_length/mean": tokens / count,
        "rollout/response_length/max": float(max(lengths, default=0)),
        "rollout/response_length/min": float(min(lengths, default=0)),
        "rollout/clip_ratio": sum(s.hit_length_limit for s in samples) / count,
    }


def merge_rollout_metrics(calls: Sequence[dict[str, float]]) -> dict[str, float]:
    """The :func:`rollout_metrics` of several calls as one: sums, sequence-weighted means, extremes,
    tokens per second over the calls' total time. Other keys: the last call's."""
    if not calls:
        return {}
    merged = dict(calls[-1])
    seqs = sum(c["rollout/num_sequences"] for c in calls)
    tokens = sum(c["rollout/num_tokens"] for c in calls)
    seconds = sum(c["rollout/time_s"] for c in calls)
    merged.update({
        "rollout/tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "rollout/time_s": seconds,
        "rollout/num_sequences": seqs,
        "rollout/num_tokens": tokens,
        "rollout/response_length/mean": tokens / max(seqs, 1),
        "rollout/response_length/max": max(c["rollout/response_length/max"] for c in calls),
        "rollout/response_length/min": min(c["rollout/response_length/min"] for c in calls),
        "rollout/clip_ratio": sum(c["rollout/clip_ratio"] * c["rollout/num_sequences"] for c in calls) / max(seqs, 1),
    })
    return merged


class RolloutEngine(abc.ABC):
    """A generation engine behind one interface: generate, update weights, release/resume memory.

    Subclasses implement :meth:`_sample` and the weight/memory methods. Use
    ``verl.rollout.build_rollout_engine`` to get one from the config.
    """

    def __init__(self, cfg: RolloutConfig, *, pad_token_id: int) -> None:
        self.cfg = cfg
        self.pad_token_id = int(pad_token_id)
        self._rng_state: torch.Tensor | None = None  # the engine's own CPU RNG stream
        self._cuda_rng_state: torch.Tensor | None = None  # and CUDA stream, when sampling on CUDA
        self._last_metrics: dict[str, float] = {}
        # Added to every seed: engines that are data-parallel replicas set it per replica so
        # they do not draw the same random numbers for their different prompts.
        self.seed_offset = 0

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Batch, *, validate: bool = False, seed: int | None = None) -> Batch:
        """Sample responses for a batch of left-padded prompts (see the module docstring for keys).

        ``validate=True`` samples with ``val_kwargs`` (greedy by default, its own ``n``).

        Randomness: an engine draws from its own RNG stream, seeded with ``cfg.seed`` and carried
        from call to call (so a run is reproducible and successive steps differ); the process's
        global RNG is neither used nor advanced. ``seed`` samples this one call from a fresh
        stream seeded with it instead (same prompts + same seed -> same samples) and leaves the
        engine's stream where it was.
        """
        for key in ("input_ids", "attention_mask"):
            if key not in prompts:
                raise ValueError(f"rollout: the prompt batch has no {key!r} column (columns: {prompts.keys()})")
        if prompts["input_ids"].shape[1] > self.cfg.prompt_length:
            raise ValueError(
                f"rollout: prompts are {prompts['input_ids'].shape[1]} tokens wide but "
                f"actor_rollout_ref.rollout.prompt_length is {self.cfg.prompt_length}; raise it or "
                "truncate the prompts (data.max_prompt_length)"
            )
        spec = sampling_spec(self.cfg, validate=validate)
        token_lists = prompt_token_lists(prompts["input_ids"], prompts["attention_mask"])
        start = time.perf_counter()
        with self._rng_stream(seed):
            samples = self._sample(token_lists, spec)
        seconds = time.perf_counter() - start
        self._last_metrics = rollout_metrics(samples, seconds)
        return assemble_rollout(
            prompts, samples, n=spec.n, response_length=spec.max_tokens, pad_token_id=self.pad_token_id
        )

    def sample(self, prompts: list[list[int]], spec: SamplingSpec, *, seed: int | None = None) -> list[Sample]:
        """``len(prompts) * spec.n`` samples (prompt-major) of unpadded prompt token lists with the
        caller's own sampling parameters (the serving app: one request's settings, not the config's).

        Randomness as in :meth:`generate`; the response limit is ``spec.max_tokens``.
        """
        if not prompts or any(not p for p in prompts):
            raise ValueError("RolloutEngine.sample: every prompt needs at least one token")
        start = time.perf_counter()
        with self._rng_stream(seed):
            samples = self._sample(prompts, spec)
        self._last_metrics = rollout_metrics(samples, time.perf_counter() - start)
        return samples

    @property
    def samples_on_cuda(self) -> bool:
        """Whether sampling draws from the CUDA RNG (engines on GPU override this)."""
        return False

    @contextlib.contextmanager
    def _rng_stream(self, seed: int | None) -> Iterator[None]:
        """Run the body on the engine's RNG stream (or a fresh one seeded with ``seed``).

        The global RNG states are saved and restored around it, so sampling neither depends on
        nor disturbs the caller's RNG (training dropout, data shuffling).
        """
        cuda = self.samples_on_cuda
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []):
            if seed is not None:
                torch.manual_seed(int(seed) + self.seed_offset)
            elif self._rng_state is None:
                torch.manual_seed(self.cfg.seed + self.seed_offset)
            else:
                torch.set_rng_state(self._rng_state)
                if cuda:
                    torch.cuda.set_rng_state(self._cuda_rng_state)
            yield
            if seed is None:
                self._rng_state = torch.get_rng_state()
                if cuda:
                    self._cuda_rng_state = torch.cuda.get_rng_state()

    @property
    def last_metrics(self) -> dict[str, float]:
        """Metrics of the last ``generate`` call: ``rollout/tokens_per_s``, response length
        mean/max/min, ``rollout/clip_ratio`` (fraction that hit the length limit), ...

        Kept here rather than in the output's ``meta_info`` because outputs of several ranks or
        calls are concatenated, and ``Batch.concat`` refuses meta_info values that differ.
        """
        return dict(self._last_metrics)

    @abc.abstractmethod
    def _sample(self, prompts: list[list[int]], spec: SamplingSpec) -> list[Sample]:
        """``len(prompts) * spec.n`` samples, prompt-major (the ``n`` samples of a prompt adjacent).

        Runs inside :meth:`_rng_stream`: draw randomness from torch's default generators.
        """

    # ------------------------------------------------------------------ weights
    @abc.abstractmethod
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights, given as (Hugging Face name, full tensor) pairs, without a restart."""

    weights_layout: str = "hf"
    """How :meth:`named_parameters` lays the weights out: ``"hf"`` (transformers' names and whole
    tensors) or ``"vllm"`` (vLLM's stacked, vocabulary-padded TP' shards); the hybrid engine's
    reshard plan writes into them (``verl.hybrid.layout``)."""

    @abc.abstractmethod
    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The engine's own parameters, in the engine's layout, for in-place writes."""

    def weights_updated(self) -> None:
        """Called after writing into :meth:`named_parameters` in place: drop what was computed with
        the old weights (the vLLM engine's prefix cache). Nothing to drop by default."""

    # ------------------------------------------------------------------ memory
    @abc.abstractmethod
    def release(self) -> None:
        """Give memory back for training (the KV cache, and on GPU optionally the weights)."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Undo :meth:`release` before the next ``generate``."""

    @abc.abstractmethod
    def kv_cache_bytes(self) -> int:
        """Bytes of KV cache this engine holds now on its device (0 between :meth:`release` and
        :meth:`resume`); what the memory handoff (``verl.hybrid.memory``) accounts for."""

    def kv_token_budget(self) -> int | None:
        """Tokens of KV cache (prompt + response tokens of every sequence) one ``generate`` call can
        hold now, from the memory this engine reports; None when it reports none. What
        ``RolloutOperator(dynamic_batch_size=True)`` sizes its calls by."""
        return None

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Free everything the engine holds; the object is unusable afterwards."""

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
