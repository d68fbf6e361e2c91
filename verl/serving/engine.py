"""The served model: its tokenizer, a rollout engine, and the batcher that feeds it.

:class:`ServedModel` owns one :class:`verl.rollout.RolloutEngine` (vLLM when it is installed,
transformers ``generate`` otherwise, or the one named) and a :class:`Batcher`: requests that
arrive within ``batch_wait_ms`` of each other and share their sampling settings run as one
``engine.sample`` call (one thread runs the engine, so the event loop keeps answering while a
batch generates). Requests with a ``seed`` run alone: a seeded stream gives the same samples for
the same prompts only when no other request shares the call.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from verl.rollout.base import Sample, SamplingSpec

logger = logging.getLogger(__name__)

__all__ = ["ENGINE_CHOICES", "EXPORT_INFO_FILE", "Batcher", "ServeLimits", "ServedModel", "resolve_engine"]

ENGINE_CHOICES = ("auto", "vllm", "hf")
"""``engine=`` values: ``auto`` is ``vllm`` when vLLM is importable, else ``hf``."""

EXPORT_INFO_FILE = "verl_export.json"
"""Written beside the weights by ``DataStream.export_as_api``: the trainer step they are from."""


@dataclass(frozen=True, kw_only=True)
class ServeLimits:
    """What one request may ask for, and how requests are batched."""

    max_tokens: int = 256
    """Largest ``max_tokens`` a request may ask for; also the chat and ``/generate`` default."""
    default_completion_tokens: int = 16
    """``max_tokens`` of a ``/v1/completions`` request that sets none (OpenAI's default)."""
    max_prompts: int = 16
    """Prompts (or conversations) per request at most."""
    max_n: int = 8
    """Responses per prompt (``n``) at most."""
    max_prompt_tokens: int = 512
    """Tokens per prompt (after the chat template) at most."""
    batch_wait_ms: float = 5.0
    """How long the batcher waits for more requests after the first before generating."""
    max_batch_sequences: int = 64
    """Sequences (prompts x n) per engine call at most; later requests wait for the next call."""
    max_body_bytes: int = 1 << 20
    """Request bodies above this size are refused with a 413: a declared ``Content-Length`` before
    the body is read, a chunked body as soon as it passes the limit."""
    max_image_pixels: int = 1 << 20
    """Pixels (width x height) of one image of a chat request at most (a vision-language model's;
    checked from the file's header, before it is decoded)."""
    max_images: int = 8
    """Images per request at most (a vision-language model's)."""

    def __post_init__(self) -> None:
        for name in (
            "max_tokens",
            "default_completion_tokens",
            "max_prompts",
            "max_n",
            "max_prompt_tokens",
            "max_batch_sequences",
            "max_body_bytes",
            "max_image_pixels",
            "max_images",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"ServeLimits.{name}={getattr(self, name)}; it must be >= 1")
        if self.batch_wait_ms < 0:
            raise ValueError(f"ServeLimits.batch_wait_ms={self.batch_wait_ms}; it must be >= 0")
        if self.default_completion_tokens > self.max_tokens:
            raise ValueError(
                f"ServeLimits.default_completion_tokens={self.default_completion_tokens} is above "
                f"max_tokens={self.max_tokens}; lower it or raise max_tokens"
            )


def resolve_engine(engine: str) -> str:
    """The engine ``engine`` names (``auto``: vllm when importable, else hf); ValueError otherwise."""
    if engine not in ENGINE_CHOICES:
        raise ValueError(f"engine={engine!r} is not one of {ENGINE_CHOICES}")
    if engine != "auto":
        return engine
    import importlib.util

    return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"


@dataclass
class _Job:
    prompts: list[list[int]]
    spec: SamplingSpec
    seed: int | None
    future: asyncio.Future = field(repr=False)

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.spec.n


class Batcher:
    """Collects concurrent requests into engine calls (see the module docstring).

    Each event loop that submits (one per server; the test client and uvicorn may serve the same
    app at once) gets its own queue and collector task; the engine calls of all of them run one
    at a time on the one engine thread.
    """

    def __init__(self, engine: Any, *, wait_ms: float, max_sequences: int) -> None:
        self.engine = engine
        self.wait_s = wait_ms / 1000.0
        self.max_sequences = max_sequences
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verl-serving-engine")
        self._loops: dict[asyncio.AbstractEventLoop, tuple[asyncio.Queue, asyncio.Task]] = {}
        self._lock = threading.Lock()
        self.stats = {"requests": 0, "engine_calls": 0, "sequences": 0}

    def _queue(self) -> asyncio.Queue:
        loop = asyncio.get_running_loop()
        with self._lock:
            for other in [lp for lp in self._loops if lp.is_closed()]:  # servers that have stopped
                del self._loops[other]
            entry = self._loops.get(loop)
            if entry is None or entry[1].done():
                queue: asyncio.Queue = asyncio.Queue()
                entry = (queue, loop.create_task(self._run(queue)))
                self._loops[loop] = entry
        return entry[0]

    async def submit(self, prompts: list[list[int]], spec: SamplingSpec, seed: int | None) -> list[Sample]:
        """``len(prompts) * spec.n`` samples, prompt-major, from the next engine call with room."""
        queue = self._queue()
        future = asyncio.get_running_loop().create_future()
        await queue.put(_Job(prompts, spec, seed, future))
        return await future

    async def _collect(self, queue: asyncio.Queue) -> list[_Job]:
        jobs = [await queue.get()]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        while sum(j.rows for j in jobs) < self.max_sequences:
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                jobs.append(await asyncio.wait_for(queue.get(), left))
            except asyncio.TimeoutError:
                break
        return jobs

    async def _run(self, queue: asyncio.Queue) -> None:
        loop = asyncio.get_running_loop()
        while True:
            jobs = await self._collect(queue)
            groups: dict[Any, list[_Job]] = {}
            for k, job in enumerate(jobs):
                key = (job.spec, None) if job.seed is None else (job.spec, ("seeded", k))
                groups.setdefault(key, []).append(job)
            for group in groups.values():
                group = [j for j in group if not j.future.done()]  # a cancelled request drops out
                if not group:
                    continue
                prompts = [p for j in group for p in j.prompts]
                spec, seed = group[0].spec, group[0].seed
                try:
                    samples = await loop.run_in_executor(
                        self._executor, lambda: self.engine.sample(prompts, spec, seed=seed)
                    )
                except Exception as exc:  # every request of the failed call gets the error
                    logger.exception("serving: an engine call of %d request(s) failed", len(group))
                    for j in group:
                        if not j.future.done():
                            j.future.set_exception(exc)
                    continue
                with self._lock:
                    self.stats["engine_calls"] += 1
                    self.stats["requests"] += len(group)
                    self.stats["sequences"] += len(samples)
                start = 0
                for j in group:
                    if not j.future.done():
                        j.future.set_result(samples[start : start + j.rows])
                    start += j.rows

    def close(self) -> None:
        with self._lock:
            entries = list(self._loops.items())
            self._loops.clear()
        for loop, (_, task) in entries:
            if not loop.is_closed():
                loop.call_soon_threadsafe(task.cancel)
        self._executor.shutdown(wait=True)


class ServedModel:
    """The tokenizer, engine and batcher of one Hugging Face model directory.

    Args:
        model_dir: a Hugging Face checkpoint directory (a trainer's ``huggingface/`` export, or
            ``DataStream.export_as_api``'s).
        engine: ``auto``, ``vllm`` or ``hf`` (:data:`ENGINE_CHOICES`).
        limits: request limits and batching.
        name: the model's name in responses (``model`` of the OpenAI bodies); the directory's name by default.
        device: the hf engine's device (None: CUDA when available).
        seed: the engine's sampling seed (requests without a ``seed`` draw from its stream).
    """

    def __init__(
        self,
        model_dir: str,
        *,
        engine: str = "auto",
        limits: ServeLimits | None = None,
        name: str | None = None,
        device: str | None = None,
        seed: int = 0,
    ) -> None:
        from transformers import AutoTokenizer

        from verl.config.schema import RolloutConfig
        from verl.data.processor import load_processor
        from verl.rollout import build_rollout_engine

        model_dir = os.path.abspath(os.path.expanduser(os.fspath(model_dir)))
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            raise ValueError(f"{model_dir} is not a Hugging Face model directory (it has no config.json)")
        self.limits = limits or ServeLimits()
        self.model_dir = model_dir
        self.name = name or os.path.basename(model_dir.rstrip(os.sep))
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            self.hf_config = json.load(f)
        max_position = self.hf_config.get("max_position_embeddings")
        if max_position is not None and self.limits.max_prompt_tokens + self.limits.max_tokens > max_position:
            raise ValueError(
                f"ServeLimits: max_prompt_tokens={self.limits.max_prompt_tokens} + max_tokens={self.limits.max_tokens} "
                f"is above the model's max_position_embeddings={max_position} ({model_dir}/config.json); lower them"
            )
        self.step = _export_step(model_dir)
        self.engine_name = resolve_engine(engine)
        self.processor: Any = None
        """A vision-language model's processor (``verl.serving.vlm``); None for a text model."""
        if "vision_config" in self.hf_config:  # a vision-language model (Qwen2.5-VL, Qwen3-VL ...)
            if engine == "vllm":
                raise ValueError(
                    f"engine=vllm: {model_dir} is a vision-language model, which this server runs on the hf engine "
                    "(transformers generate with the request's images); use engine=hf or auto"
                )
            self.engine_name = "hf"
            self.processor = load_processor(model_dir)
            self.tokenizer = self.processor.tokenizer
        else:
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        cfg = RolloutConfig(
            name=self.engine_name,
            prompt_length=self.limits.max_prompt_tokens,
            response_length=self.limits.max_tokens,
            seed=seed,
            free_cache_engine=False,
        )
        if self.processor is not None:
            from verl.serving.vlm import VLMEngine

            self.engine = VLMEngine(cfg, model_dir, self.tokenizer, device=device)
        else:
            kwargs: dict[str, Any] = {"device": device} if self.engine_name == "hf" else {}
            self.engine = build_rollout_engine(cfg, model_dir, self.tokenizer, **kwargs)
        self.batcher = Batcher(
            self.engine, wait_ms=self.limits.batch_wait_ms, max_sequences=self.limits.max_batch_sequences
        )
        logger.info("serving %s (%s engine) from %s", self.name, self.engine_name, model_dir)

    # -- prompts and texts ------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def encode_chat(self, messages: list[dict[str, str]]) -> tuple[list[int], str]:
        """(token ids, rendered text) of a conversation through the tokenizer's chat template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer of {self.name} has no chat template; send plain prompts instead")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return list(ids), text

    def encode_image_chat(self, messages: list[Any], param: str) -> tuple[Any, str]:
        """(prompt, rendered text) of a conversation whose turns may hold image parts, through the
        processor (a vision-language model's): token ids, or an ``ImagePrompt`` with the images'
        ``pixel_values``. Each image is checked first (``verl.serving.vlm.decode_image``); a
        ``RequestError`` names the part at fault."""
        from verl.serving.errors import RequestError
        from verl.serving.schema import ImagePart
        from verl.serving.vlm import ImagePrompt, decode_image

        conversation: list[dict[str, Any]] = []
        images = []
        for i, message in enumerate(messages):
            if isinstance(message.content, str):
                conversation.append({"role": message.role, "content": message.content})
                continue
            parts: list[dict[str, Any]] = []
            for j, part in enumerate(message.content):
                if isinstance(part, ImagePart):
                    where = f"{param}.{i}.content.{j}.image_url"
                    if len(images) == self.limits.max_images:
                        raise RequestError(
                            400, f"{where}: more than {self.limits.max_images} images in one request (this server's "
                            "limit)", param=where,
                        )
                    images.append(decode_image(part.image_url.url, param=where, max_pixels=self.limits.max_image_pixels))
                    parts.append({"type": "image"})
                else:
                    parts.append({"type": "text", "text": part.text})
            conversation.append({"role": message.role, "content": parts})
        text = self.processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        enc = self.processor(text=[text], images=images or None, add_special_tokens=False, return_tensors="pt")
        ids = tuple(int(t) for t in enc["input_ids"][0])
        if not images:
            return list(ids), text
        return ImagePrompt(ids=ids, pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"]), text

    def response_text(self, sample: Sample, stop: list[str]) -> tuple[str, str]:
        """(text, finish_reason) of a sample: special tokens dropped, cut before the first stop string."""
        text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        cut = [text.find(s) for s in stop if s and s in text]
        if cut:
            text = text[: min(cut)]
        return text, "length" if sample.hit_length_limit else "stop"

    def text_pieces(self, sample: Sample, final: str) -> list[str]:
        """``final`` split along the sample's token boundaries (a streamed response's deltas)."""
        pieces, emitted = [], 0
        for k in range(1, len(sample.token_ids) + 1):
            if emitted >= len(final):
                break
            prefix = self.tokenizer.decode(sample.token_ids[:k], skip_special_tokens=True)
            upto = min(len(prefix), len(final))
            # A token that ends inside a multi-byte character decodes to a replacement char: wait.
            if upto > emitted and prefix[:upto] == final[:upto]:
                pieces.append(final[emitted:upto])
                emitted = upto
        if emitted < len(final):
            pieces.append(final[emitted:])
        return pieces

    def summary(self) -> dict[str, Any]:
        """``GET /model``: name, step, engine, the architecture's main sizes and the limits."""
        keys = (
            "model_type",
            "architectures",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
            "torch_dtype",
        )
        from dataclasses import asdict

        return {
            "name": self.name,
            "step": self.step,
            "engine": self.engine_name,
            "config": {k: self.hf_config[k] for k in keys if k in self.hf_config},
            "limits": asdict(self.limits),
        }

    def close(self) -> None:
        """Stop the batcher and free the engine."""
        self.batcher.close()
        self.engine.shutdown()


def _export_step(model_dir: str) -> int | None:
    """The trainer step of the weights (``verl_export.json``), or None when not recorded."""
    path = os.path.join(model_dir, EXPORT_INFO_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            step = json.load(f).get("step")
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"{path} cannot be read ({exc}); remove it or write it again with export_as_api"
        ) from None
    return None if step is None else int(step)
