"""The fallback rollout engine: Hugging Face transformers' ``generate``.

Same interface and output keys as the vLLM engine, for machines without vLLM (the lent GPU
machine's image has none) and for debugging; much slower at scale (no paged KV cache, no
continuous batching). Selected with ``actor_rollout_ref.rollout.name: hf``.

- Prompts are re-left-padded to the longest prompt of the call and repeated ``n`` times
  (interleaved); one ``generate`` call per ``micro_batch_size`` rows.
- ``rollout_log_probs`` come from ``generate``'s processed scores (temperature, top-k, top-p
  applied, as vLLM's ``processed_logprobs``): ``log_softmax(score)`` of the sampled token.
- Stop tokens (eos unless ``ignore_eos``, plus ``stop_token_ids``) and stop strings end a
  response; the stopping token is kept, as in vLLM.
- With ``record_routing`` (R3 router replay, ``verl.models.router_replay``) every sample carries the
  experts each MoE layer's router chose for its prompt and response tokens while generating
  (:class:`RoutingRecorder`).
- A vision-language model (a checkpoint whose config has a ``vision_config``) loads whole
  (``AutoModelForImageTextToText``) and generates each prompt with its images: the prompt batch's
  ``mm_pixel_values`` / ``mm_image_grid_thw`` columns (``verl.protocol.images``), which the output batch
  repeats for the trainer; the model computes its multimodal rotary positions itself. Its image and
  video tokens are never sampled (a response holds no image); the reported log-probs are still over
  the whole vocabulary, as the trainer's (exact without top-k/top-p; with them the removed tokens
  count as if the cut kept them).
- Randomness comes from the engine's own RNG stream (see ``RolloutEngine.generate``); samples
  differ from vLLM's for the same seed (different samplers).

:func:`hf_response_logprobs` recomputes per-token logprobs of a rollout batch with a plain
forward pass (the trainer's computation, for checks and benchmarks).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from verl.protocol import Batch
from verl.rollout.base import RolloutEngine, Sample, SamplingSpec, left_pad

if TYPE_CHECKING:
    from verl.config.schema import RolloutConfig

logger = logging.getLogger(__name__)

__all__ = ["HFRollout", "RoutingRecorder", "hf_response_logprobs"]

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _torch_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


class HFRollout(RolloutEngine):
    """Rollouts with ``transformers`` ``generate`` (see the module docstring).

    Args:
        cfg: ``actor_rollout_ref.rollout``.
        model_path: Hugging Face model directory.
        tokenizer: the policy's tokenizer; loaded from ``model_path`` if None.
        device: where the model runs; CUDA when available, else CPU.
        micro_batch_size: sequences per ``generate`` call (None: all at once).
        trust_remote_code: allow custom modelling code of the checkpoint.
    """

    def __init__(
        self,
        cfg: RolloutConfig,
        model_path: str,
        *,
        tokenizer: Any = None,
        device: str | torch.device | None = None,
        micro_batch_size: int | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer, GenerationConfig

        from verl.data.vlm import is_vlm_dir

        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError(f"the tokenizer of {model_path} has neither a pad nor an eos token; set one")
        super().__init__(cfg, pad_token_id=pad)
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"HFRollout: micro_batch_size={micro_batch_size}; it must be >= 1 (or None)")
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.eos_token_id = tokenizer.eos_token_id
        self.micro_batch_size = micro_batch_size
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # The model reports cuda:N: "cuda" alone would never equal it (generate() compares the two).
            self.device = torch.device("cuda", torch.cuda.current_device())
        dtype = _torch_dtype(cfg.dtype, self.device)
        loader = AutoModelForImageTextToText if is_vlm_dir(model_path) else AutoModelForCausalLM
        self.model = loader.from_pretrained(model_path, dtype=dtype, trust_remote_code=trust_remote_code).to(self.device)
        vision = getattr(self.model.config, "vision_config", None)
        self.image_token_id = self.model.config.image_token_id if vision is not None else None
        # Never sampled (_NoVisionTokens): the trainer's forward reads every image token as an image slot.
        self.vision_token_ids = sorted({
            int(i) for i in (getattr(self.model.config, k, None) for k in ("image_token_id", "video_token_id"))
            if i is not None
        }) if vision is not None else []
        self._prompt_images: dict[str, torch.Tensor] | None = None  # the prompt batch's mm_* columns, in generate()
        self.model.eval()
        # Every sampling setting comes from cfg: nothing from the checkpoint's generation_config
        # (its eos, top_k=50 default, ...) may leak into generate().
        self.model.generation_config = GenerationConfig()
        self._home = self.device
        self._released = False
        self.record_routing = False
        """R3 router replay: record the experts of every generated sample (``Sample.routed_experts``)."""
        logger.info("HF rollout engine up: %s on %s, %s", model_path, self.device, dtype)

    # ------------------------------------------------------------------ generation
    @property
    def samples_on_cuda(self) -> bool:
        """Sampling draws from the CUDA generator when the model is on a GPU."""
        return self.device.type == "cuda"

    def generate(self, prompts: Batch, *, validate: bool = False, seed: int | None = None) -> Batch:
        """``RolloutEngine.generate``; a vision-language model reads each prompt's images from the batch."""
        from verl.protocol.images import MULTI_MODAL_KEYS

        images = {k: prompts[k] for k in MULTI_MODAL_KEYS if k in prompts}
        if images and self.image_token_id is None:
            raise ValueError(
                f"rollout: the prompts carry images ({sorted(images)}), but {type(self.model).__name__} is not a "
                "vision-language model; give actor_rollout_ref.model.path a VLM checkpoint"
            )
        self._prompt_images = images or None
        try:
            return super().generate(prompts, validate=validate, seed=seed)
        finally:
            self._prompt_images = None

    @contextlib.contextmanager
    def with_images(self, columns: dict[str, torch.Tensor]) -> Iterator[None]:
        """Calls of :meth:`sample` inside the block generate prompt ``i`` with row ``i`` of ``columns`` (the
        ``mm_*`` columns, one row per prompt): the agent loop's conversations with images."""
        if self.image_token_id is None:
            raise ValueError(
                f"rollout: the conversations hold images, but {type(self.model).__name__} is not a vision-language "
                "model; give actor_rollout_ref.model.path a VLM checkpoint"
            )
        self._prompt_images = dict(columns) or None
        try:
            yield
        finally:
            self._prompt_images = None

    def _sample(self, prompts: list[list[int]], spec: SamplingSpec) -> list[Sample]:
        if self.model.device != self.device:
            raise RuntimeError("HFRollout.generate called after release(); call resume() first")
        rows = [p for p in prompts for _ in range(spec.n)]
        step = self.micro_batch_size or len(rows)
        samples: list[Sample] = []
        for start in range(0, len(rows), step):
            images = None
            if self._prompt_images is not None:  # each row's prompt's images (rows are prompt-major)
                owners = torch.arange(start, min(start + step, len(rows))) // spec.n
                images = {k: v.index_select(0, owners.to(v.device)) for k, v in self._prompt_images.items()}
            samples.extend(self._generate_rows(rows[start : start + step], spec, images))
        return samples

    def _image_kwargs(self, input_ids: torch.Tensor, images: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """``generate``'s image arguments for left-padded ``input_ids`` [N, P] and the rows' ``mm_*`` columns."""
        from verl.protocol.images import model_image_inputs

        found = model_image_inputs(images) if images is not None else {}
        if not found:
            if self.image_token_id is not None and bool((input_ids == self.image_token_id).any()):
                raise ValueError(
                    "rollout: prompts hold image tokens but no images reached the engine (RolloutEngine.sample "
                    "passes token ids only); generate them through RolloutEngine.generate with the batch's "
                    "mm_pixel_values / mm_image_grid_thw columns, or call sample inside HFRollout.with_images"
                )
            return {}
        found["mm_token_type_ids"] = (input_ids == self.image_token_id).int()
        return {k: v.to(self.device) for k, v in found.items()}

    def _generate_rows(self, rows: list[list[int]], spec: SamplingSpec,
                       images: dict[str, torch.Tensor] | None = None) -> list[Sample]:
        from transformers import GenerationConfig

        width = max(len(r) for r in rows)
        input_ids, attention_mask = left_pad(rows, width, self.pad_token_id)
        eos = [] if spec.ignore_eos or self.eos_token_id is None else [self.eos_token_id]
        stop_ids = eos + list(spec.stop_token_ids)
        # Greedy: leave the sampling knobs unset (transformers warns about unused ones).
        sampling = {} if spec.greedy else dict(
            temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k if spec.top_k > 0 else 0
        )
        gen_cfg = GenerationConfig(
            do_sample=not spec.greedy,
            **sampling,
            max_new_tokens=spec.max_tokens,
            eos_token_id=stop_ids or None,
            pad_token_id=self.pad_token_id,
            stop_strings=list(spec.stop) or None,
            output_scores=True,
            return_dict_in_generate=True,
            use_cache=True,
        )
        recorder = RoutingRecorder(self.model) if self.record_routing else None
        no_vision = _NoVisionTokens(self.vision_token_ids) if self.vision_token_ids else None
        with torch.no_grad(), recorder or contextlib.nullcontext():
            out = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                generation_config=gen_cfg,
                logits_processor=[no_vision] if no_vision is not None else None,
                tokenizer=self.tokenizer if spec.stop else None,
                **self._image_kwargs(input_ids, images),
            )
            if recorder is not None:
                recorder.feed_last_token(out, attention_mask.to(self.device), self.pad_token_id)
        routed = recorder.routing(len(rows)) if recorder is not None else None  # [N, width + T, L, K]
        generated = out.sequences[:, width:]  # [N, T], T <= max_tokens
        # Logprob of each generated token under the processed distribution it was drawn from.
        scores = list(out.scores)  # each [N, V]
        if no_vision is not None:  # the vision tokens' logits back, warped as the others were (temperature)
            scale = 1.0 if spec.greedy else float(spec.temperature)
            scores = [torch.cat([s.float(), removed / scale], dim=-1) for s, removed in zip(scores, no_vision.removed)]
        token_lps = torch.stack(
            [
                torch.log_softmax(score.float(), dim=-1).gather(-1, generated[:, t : t + 1]).squeeze(-1)
                for t, score in enumerate(scores)
            ],
            dim=1,
        ).cpu()  # [N, T]
        generated = generated.cpu()
        stop_set = set(stop_ids)
        samples = []
        for i in range(len(rows)):
            ids = generated[i].tolist()
            length, stopped = self._response_length(ids, stop_set, spec.stop)
            samples.append(
                Sample(
                    token_ids=ids[:length],
                    logprobs=token_lps[i, :length].tolist(),
                    hit_length_limit=not stopped and length == spec.max_tokens,
                    routed_experts=None if routed is None else routed[i, width - len(rows[i]) : width + length].clone(),
                )
            )
        return samples

    def _response_length(self, ids: list[int], stop_ids: set[int], stop_strings: tuple[str, ...]) -> tuple[int, bool]:
        """(length including the stopping token, whether a stop token/string ended it)."""
        end = len(ids)
        stopped = False
        for t, tok in enumerate(ids):
            if tok in stop_ids:
                end, stopped = t + 1, True
                break
        if stop_strings:
            # The earliest prefix whose text contains a stop string (text grows with the prefix,
            # so "contains" is monotone and a binary search finds it).
            def hit(k: int) -> bool:
                text = self.tokenizer.decode(ids[:k])
                return any(s in text for s in stop_strings)

            if hit(end):
                lo, hi = 1, end
                while lo < hi:
                    mid = (lo + hi) // 2
                    if hit(mid):
                        hi = mid
                    else:
                        lo = mid + 1
                end, stopped = lo, True
        return end, stopped

    # ------------------------------------------------------------------ weights
    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The transformers model's parameters (Hugging Face names; tied weights listed once)."""
        return self.model.named_parameters()

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (Hugging Face name, tensor) pairs into the model in place.

        A tied ``lm_head.weight`` is the embedding's tensor, so writing either updates both.
        """
        targets = self.model.state_dict(keep_vars=True)
        unknown = []
        with torch.no_grad():
            for name, tensor in weights:
                target = targets.get(name)
                if target is None:
                    unknown.append(name)
                    continue
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"update_weights: {name} has shape {list(tensor.shape)}, the model's is {list(target.shape)}"
                    )
                target.data.copy_(tensor.to(device=target.device, dtype=target.dtype))
        if unknown:
            raise ValueError(
                f"update_weights: {len(unknown)} name(s) not in the model, e.g. {unknown[:3]}; expected Hugging "
                f"Face names such as {next(iter(targets))!r}"
            )

    # ------------------------------------------------------------------ memory
    def release(self) -> None:
        """On GPU move the model to host memory (no-op when ``free_cache_engine`` is false).

        On CPU there is nothing to free: ``generate`` keeps no KV cache between calls.
        """
        if self.cfg.free_cache_engine and self._home.type == "cuda":
            self.model.to("cpu")
            self.device = torch.device("cpu")
            torch.cuda.empty_cache()
        self._released = True

    def resume(self) -> None:
        """Move the model back to its device after :meth:`release`."""
        if self.device != self._home:
            self.model.to(self._home)
            self.device = self._home
        self._released = False

    def kv_cache_bytes(self) -> int:
        """0: transformers' ``generate`` allocates its KV cache inside each call and frees it on
        return, so between calls (when the memory handoff looks) the engine holds none. During a
        call it holds about 2 x layers x kv_heads x head_dim x dtype bytes per token of the batch."""
        return 0

    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per token of a batch: K and V of every layer, ``2 x layers x kv_heads x
        head_dim x dtype bytes``, from the model's config."""
        c = self.model.config
        heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return 2 * c.num_hidden_layers * heads * head_dim * self.model.dtype.itemsize

    def kv_token_budget(self) -> int:
        """The free memory of the engine's device over :meth:`kv_bytes_per_token`: transformers
        allocates a call's KV cache inside the call, so the room it has is what is free now (CUDA:
        ``torch.cuda.mem_get_info``; CPU: the host's available memory). Activations and logits of
        the call are not counted; ``max_batch_size`` bounds a call on a device with room to spare."""
        if self._released:
            return 0
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
        else:
            import psutil

            free = psutil.virtual_memory().available
        return int(free // self.kv_bytes_per_token())

    def shutdown(self) -> None:
        """Drop the model."""
        if getattr(self, "model", None) is None:
            return
        self.model = None
        gc.collect()
        if self._home.type == "cuda":
            torch.cuda.empty_cache()


class RoutingRecorder:
    """The experts a transformers Mixture-of-Experts model routes every token to during ``generate``.

    Inside the ``with`` block a forward hook on each MoE layer's router (``mlp.gate``; Qwen3-MoE, Qwen2-MoE and
    Mixtral in transformers 5: ``forward`` returns ``(logits, weights, indices)``, ``indices`` [tokens, K] the
    ``torch.topk`` of the softmax, the order Megatron's top-k gives too) keeps each call's indices: the prefill
    (every row's prompt columns) and each decode step (one new column, the KV-cached incremental forward the
    engine sampled from). ``generate`` never feeds its last sampled token back, so
    :meth:`feed_last_token` runs that one more decode step (the step ``generate`` would take next, from its
    cache). :meth:`routing` lays the calls side by side: [rows, columns, L, K] on the CPU
    (``router_replay.ROUTING_DTYPE``).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        layers = getattr(getattr(model, "model", None), "layers", None) or []
        self.gates = [layer.mlp.gate for layer in layers
                      if hasattr(getattr(layer, "mlp", None), "gate") and hasattr(layer.mlp, "experts")]
        if not self.gates:
            raise ValueError(
                f"router replay R3: the rollout model ({type(model).__name__}) has no Mixture-of-Experts layers "
                "to record; set actor_rollout_ref.actor.megatron.router_replay.mode=disabled"
            )
        self.calls: list[list[torch.Tensor]] = [[] for _ in self.gates]
        self._hooks: list = []

    def __enter__(self) -> "RoutingRecorder":
        for calls, gate in zip(self.calls, self.gates):
            self._hooks.append(gate.register_forward_hook(functools.partial(self._keep, calls)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    @staticmethod
    def _keep(calls: list[torch.Tensor], module, args, output) -> None:
        calls.append(output[2].detach())  # on the model's device: no host copy per layer and step

    def feed_last_token(self, out: Any, prompt_mask: torch.Tensor, pad_token_id: int) -> None:
        """One more decode step on ``generate``'s output ``out`` (``return_dict_in_generate``; its cache): the
        routing of the last sampled column, with the mask and positions ``generate`` would have used."""
        from transformers import GenerationConfig

        sequences = out.sequences
        mask = torch.cat([prompt_mask, prompt_mask.new_ones(sequences.shape[0], sequences.shape[1] - prompt_mask.shape[1])], 1)
        self.model.generate(
            input_ids=sequences, attention_mask=mask, past_key_values=out.past_key_values,
            generation_config=GenerationConfig(do_sample=False, max_new_tokens=1, pad_token_id=pad_token_id, use_cache=True),
        )

    def routing(self, rows: int) -> torch.Tensor:
        """[rows, columns, L, K]: each layer's calls concatenated along the columns."""
        per_layer = [torch.cat([c.reshape(rows, -1, c.shape[-1]) for c in calls], dim=1) for calls in self.calls]
        from verl.models.router_replay import as_routing

        return as_routing(torch.stack(per_layer, dim=2).to("cpu"))


class _NoVisionTokens:
    """``generate``'s logits processor that never lets a vision token be sampled (a response holds no image:
    a sampled ``<|image_pad|>`` would be an image slot without an image to the trainer's forward).

    Its logits go to -inf; each step's removed logits [N, k] are kept in ``removed`` so the reported
    log-probs are the policy's over the whole vocabulary, as the trainer computes them (the removed mass,
    ~k / vocab for an untrained model, would otherwise shift every log-prob by log(1 - mass))."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = torch.tensor(token_ids, dtype=torch.long)
        self.removed: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        ids = self.token_ids.to(scores.device)
        self.removed.append(scores.index_select(-1, ids).float())
        scores = scores.clone()
        scores[:, ids] = float("-inf")
        return scores


def hf_response_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    response_length: int,
    temperature: float = 1.0,
    micro_batch_size: int = 16,
) -> torch.Tensor:
    """Per-token logprobs of the last ``response_length`` tokens under ``model``, as a trainer computes them.

    ``log_softmax(logits / temperature)`` at the position before each response token (no
    top-k/top-p). Inputs ``[B, P+R]`` (rollout output layout); returns ``[B, R]`` float32.
    """
    temperature = temperature if temperature > 0 else 1.0
    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for start in range(0, input_ids.shape[0], micro_batch_size):
            sl = slice(start, start + micro_batch_size)
            logits = model(
                input_ids=input_ids[sl].to(device),
                attention_mask=attention_mask[sl].to(device),
                position_ids=position_ids[sl].to(device),
            ).logits.float()  # [b, P+R, V]
            logits = logits[:, -response_length - 1 : -1] / temperature  # predicts each response token
            lp = F.log_softmax(logits, dim=-1)
            target = input_ids[sl, -response_length:].to(device)
            out.append(lp.gather(-1, target.unsqueeze(-1)).squeeze(-1).cpu())
    return torch.cat(out, dim=0)
