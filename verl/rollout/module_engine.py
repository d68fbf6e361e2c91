"""The rollout engine of a plain PyTorch module: its own ``generate()``.

A policy trained on the plain PyTorch engine (``verl.engine.torch_engine``) generates with the
very module that trains: no weight copy, no push, no KV cache to hand over (the hybrid engine
has nothing to do). Same interface and output keys as the vLLM and transformers engines.

- Prompts are left-padded to ``prompt_length`` (``data.max_prompt_length``: the width of the
  trainer's batches, so a module that ignores ``attention_mask`` sees the same leading pads when
  it generates as when it is trained) and repeated ``n`` times (interleaved); one ``generate``
  call for them all, in eval mode, without gradients.
- ``generate`` is called with ``input_ids`` and, where its signature takes them (by name or
  ``**kwargs``), ``attention_mask``, ``max_new_tokens``, ``do_sample``, ``temperature``,
  ``top_p``, ``top_k``, ``eos_token_id`` and ``pad_token_id`` (transformers' names). A setting the
  call needs but the signature does not take is named in a warning once (the module samples as
  it does). It returns ``[N, P + R']`` ids (the prompt echoed, as transformers does) or
  ``[N, R']`` (the new tokens only); the response is cut after its first stop token (eos unless
  ``ignore_eos``, and ``stop_token_ids``), at most ``max_tokens`` tokens.
- ``rollout_log_probs`` are recomputed with one forward pass of the module over prompt and
  response: ``log_softmax(logits / temperature)`` of each sampled token (raw logits when greedy),
  the same computation the trainer makes; top-k/top-p filtering inside the module's own
  sampler is not reflected in them.
- Stop strings are refused (a module's ``generate`` has no tokenizer to match text with):
  give ``stop_token_ids``.
- Randomness: ``generate`` draws from torch's default generators, which the base class seeds per
  call (``RolloutEngine.generate``), so the same seed gives the same samples.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from verl.rollout.base import RolloutEngine, Sample, SamplingSpec, left_pad
from verl.utils.logging import warn_once

if TYPE_CHECKING:
    from verl.config.schema import RolloutConfig

logger = logging.getLogger(__name__)

__all__ = ["ModuleRollout"]


class ModuleRollout(RolloutEngine):
    """Rollouts with a plain module's ``generate`` (see the module docstring).

    Args:
        cfg: ``actor_rollout_ref.rollout``.
        module: the policy (the trained module itself: what it generates is always current).
        tokenizer: the policy's tokenizer (pad and eos ids).
    """

    def __init__(self, cfg: "RolloutConfig", module: torch.nn.Module, *, tokenizer: Any) -> None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError("the policy's tokenizer has neither a pad nor an eos token; set one")
        super().__init__(cfg, pad_token_id=pad)
        if cfg.stop:
            raise ValueError(
                f"actor_rollout_ref.rollout.stop={list(cfg.stop)}: stop strings are not applied to a plain module's "
                "generate(); give the stop tokens' ids as actor_rollout_ref.rollout.stop_token_ids"
            )
        generate = getattr(module, "generate", None)
        if not callable(generate):
            raise ValueError(f"{type(module).__name__} has no generate() method: the rollout samples with it")
        self.module = module
        self.eos_token_id = tokenizer.eos_token_id
        try:
            params = inspect.signature(generate).parameters
        except (TypeError, ValueError):
            params = {}
        self._any_kwarg = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        self._params = set(params)
        logger.info("rollout engine: %s.generate() (the trained module itself)", type(module).__name__)

    def _takes(self, name: str) -> bool:
        return self._any_kwarg or name in self._params

    @property
    def samples_on_cuda(self) -> bool:
        """Sampling draws from the CUDA generator when the module is on a GPU."""
        return self._device().type == "cuda"

    def _device(self) -> torch.device:
        p = next(self.module.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    def _sample(self, prompts: list[list[int]], spec: SamplingSpec) -> list[Sample]:
        rows = [p for p in prompts for _ in range(spec.n)]
        width = max(self.cfg.prompt_length, max(len(r) for r in rows))
        device = self._device()
        input_ids, attention_mask = (t.to(device) for t in left_pad(rows, width, self.pad_token_id))
        eos = [] if spec.ignore_eos or self.eos_token_id is None else [self.eos_token_id]
        stop_ids = set(eos) | set(spec.stop_token_ids)
        wanted: dict[str, Any] = {
            "attention_mask": attention_mask,
            "max_new_tokens": spec.max_tokens,
            "do_sample": not spec.greedy,
            "pad_token_id": self.pad_token_id,
        }
        if not spec.greedy:
            wanted.update(temperature=spec.temperature, top_p=spec.top_p)
            if spec.top_k > 0:
                wanted["top_k"] = spec.top_k
        if eos:
            wanted["eos_token_id"] = eos[0]
        kwargs = {k: v for k, v in wanted.items() if self._takes(k)}
        dropped = sorted(set(wanted) - set(kwargs) - {"pad_token_id", "attention_mask"})
        if dropped:
            warn_once(
                logger,
                "%s.generate() takes no %s: it samples by its own settings there",
                type(self.module).__name__,
                ", ".join(dropped),
            )
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                out = self.module.generate(input_ids, **kwargs)
                if not torch.is_tensor(out):
                    out = getattr(out, "sequences", out)
                if not torch.is_tensor(out) or out.dim() != 2 or out.shape[0] != len(rows):
                    raise ValueError(
                        f"{type(self.module).__name__}.generate() returned "
                        f"{list(out.shape) if torch.is_tensor(out) else type(out).__name__}; the rollout needs token "
                        f"ids [{len(rows)}, prompt + new tokens] or [{len(rows)}, new tokens]"
                    )
                out = out.to(device=device, dtype=torch.long)
                echoed = out.shape[1] >= width and torch.equal(out[:, :width], input_ids)
                generated = out[:, width:] if echoed else out
                generated = generated[:, : spec.max_tokens]
                lengths = []
                for row in generated.tolist():
                    end = next((t + 1 for t, tok in enumerate(row) if tok in stop_ids), len(row))
                    lengths.append(end)
                logprobs = self._logprobs(input_ids, attention_mask, generated, spec)
        finally:
            self.module.train(was_training)
        samples = []
        for i, length in enumerate(lengths):
            ids = generated[i, :length].tolist()
            stopped = length > 0 and ids[-1] in stop_ids
            samples.append(
                Sample(
                    token_ids=ids,
                    logprobs=logprobs[i, :length].tolist(),
                    hit_length_limit=not stopped and length == spec.max_tokens,
                )
            )
        return samples

    def _logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, generated: torch.Tensor, spec: SamplingSpec
    ) -> torch.Tensor:
        """[N, R'] log-probabilities of the generated tokens under the module (module docstring)."""
        from verl.engine.torch_engine import module_logits

        if generated.shape[1] == 0:
            return torch.zeros_like(generated, dtype=torch.float32)
        width = input_ids.shape[1]
        ids = torch.cat([input_ids, generated], dim=1)
        mask = torch.cat([attention_mask, torch.ones_like(generated)], dim=1)
        logits = module_logits(self.module, ids, mask)[:, width - 1 : -1].float()  # predicts generated
        if not spec.greedy and spec.temperature != 1.0:
            logits = logits / spec.temperature
        return torch.log_softmax(logits, dim=-1).gather(-1, generated.unsqueeze(-1)).squeeze(-1).cpu()

    # ------------------------------------------------------------------ weights
    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The module's own parameters (it is the trained module: nothing is ever pushed)."""
        return self.module.named_parameters()

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``weights`` (the module's own parameter names) into the module."""
        own = dict(self.module.named_parameters())
        with torch.no_grad():
            for name, tensor in weights:
                if name not in own:
                    raise KeyError(f"{type(self.module).__name__} has no parameter {name!r}")
                own[name].copy_(tensor)

    # ------------------------------------------------------------------ memory
    def release(self) -> None:
        """Nothing held between calls (``generate`` allocates its own cache per call)."""

    def resume(self) -> None:
        """Nothing to take back."""

    def kv_cache_bytes(self) -> int:
        """No cache is held between calls."""
        return 0

    def shutdown(self) -> None:
        """The module belongs to the caller: nothing to free."""
