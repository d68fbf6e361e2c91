"""Serving a vision-language model (VLM): chat requests with images, and the engine that reads them.

A chat message's content may hold OpenAI's image parts,
``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``. Each is checked
before anything runs (:func:`decode_image`), each failure a 400 naming the part
(``messages.0.content.1.image_url``): only ``data:`` URLs are read (the server fetches nothing
from a network), the payload must be valid base64 of an image file Pillow reads, and the image
must fit the server's pixel budget (``ServeLimits.max_image_pixels``, checked from the file's
header before it is decoded). The conversation goes through the processor's chat template (an
image part renders as the model's vision span) and the processor, which widens each span to one
placeholder token per merged patch and builds ``pixel_values`` / ``image_grid_thw``: an
:class:`ImagePrompt` carries both to :class:`VLMEngine`, which generates with transformers
``generate`` (each prompt with its own images).
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from verl.rollout.base import RolloutEngine, Sample, SamplingSpec
from verl.serving.errors import RequestError

logger = logging.getLogger(__name__)

__all__ = ["ImagePrompt", "VLMEngine", "decode_image"]


def decode_image(url: str, *, param: str, max_pixels: int) -> Any:
    """The PIL image of a ``data:image/...;base64,`` URL; :class:`RequestError` (400, naming ``param``)
    for anything else (module docstring)."""
    from PIL import Image, UnidentifiedImageError

    head, sep, payload = url.partition(",")
    if not url.startswith("data:"):
        shown = url if len(url) <= 60 else url[:57] + "..."
        raise RequestError(
            400,
            f"{param}: only data URLs are accepted (data:image/png;base64,...); this server fetches nothing from a "
            f"network, got {shown!r}",
            param=param,
        )
    if not sep or not head.endswith(";base64") or not head[len("data:"):].startswith("image/"):
        raise RequestError(
            400, f"{param}: the data URL must be data:image/<format>;base64,<data>, got a header {head[:60]!r}",
            param=param,
        )
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(400, f"{param}: the data URL's payload is not valid base64", param=param) from None
    try:
        image = Image.open(io.BytesIO(raw))  # reads the header only: the size is known before decoding
    except (UnidentifiedImageError, OSError):
        raise RequestError(
            400, f"{param}: the data is not an image file this server reads (PNG, JPEG, GIF, WebP, BMP)", param=param
        ) from None
    width, height = image.size
    if width * height > max_pixels:
        raise RequestError(
            400,
            f"{param}: the image is {width}x{height} = {width * height} pixels, above this server's budget of "
            f"{max_pixels}; send a smaller image",
            param=param,
        )
    try:
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError):
        raise RequestError(400, f"{param}: the image file is damaged or truncated", param=param) from None
    return image.convert("RGB")


@dataclass(frozen=True, eq=False)
class ImagePrompt:
    """A prompt's token ids (the image placeholders widened) and its images' processor outputs.
    It reads as its token list (``len``, iteration), so the batcher and usage counts take it as one."""

    ids: tuple[int, ...]
    pixel_values: torch.Tensor
    """[patches, D] of every image of the prompt, in order."""
    image_grid_thw: torch.Tensor
    """[images, 3]."""

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids)


class VLMEngine(RolloutEngine):
    """transformers ``generate`` of a vision-language model, each prompt with its images.

    Args:
        cfg: the rollout config (seed, dtype; sampling comes from each request).
        model_dir: the model's directory (``AutoModelForImageTextToText``).
        tokenizer: the processor's tokenizer.
        device: where the model runs (None: CUDA when available).
    """

    def __init__(self, cfg: Any, model_dir: str, tokenizer: Any, *, device: str | None = None) -> None:
        from transformers import AutoModelForImageTextToText, GenerationConfig

        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError(f"the tokenizer of {model_dir} has neither a pad nor an eos token; set one")
        super().__init__(cfg, pad_token_id=pad)
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir).to(self.device).eval()
        self.model.generation_config = GenerationConfig()  # every setting comes from the request

    @property
    def samples_on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def _sample(self, prompts: list[Any], spec: SamplingSpec) -> list[Sample]:
        samples: list[Sample] = []
        for prompt in prompts:  # one prompt (with its n samples) per generate: each has its own images
            samples.extend(self._generate(prompt, spec))
        return samples

    def _generate(self, prompt: Any, spec: SamplingSpec) -> list[Sample]:
        from transformers import GenerationConfig

        ids = torch.tensor([list(prompt)] * spec.n, device=self.device)  # [n, P]
        images: dict[str, torch.Tensor] = {}
        if isinstance(prompt, ImagePrompt):
            images = {
                "pixel_values": prompt.pixel_values.repeat(spec.n, 1).to(self.device),
                "image_grid_thw": prompt.image_grid_thw.repeat(spec.n, 1).to(self.device),
            }
        eos = [] if spec.ignore_eos or self.eos_token_id is None else [self.eos_token_id]
        stop_ids = eos + list(spec.stop_token_ids)
        sampling = {} if spec.greedy else dict(
            temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k if spec.top_k > 0 else 0
        )
        gen_cfg = GenerationConfig(
            do_sample=not spec.greedy, **sampling, max_new_tokens=spec.max_tokens, eos_token_id=stop_ids or None,
            pad_token_id=self.pad_token_id, stop_strings=list(spec.stop) or None, output_scores=True,
            return_dict_in_generate=True,
        )
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen_cfg,
                tokenizer=self.tokenizer if spec.stop else None, **images,
            )
        generated = out.sequences[:, ids.shape[1]:]  # [n, T]
        logps = torch.stack(
            [
                torch.log_softmax(s.float(), -1).gather(-1, generated[:, t:t + 1]).squeeze(-1)
                for t, s in enumerate(out.scores)
            ],
            dim=1,
        ).cpu()  # [n, T]
        samples = []
        for row, lps in zip(generated.cpu().tolist(), logps):
            end = next((t + 1 for t, tok in enumerate(row) if tok in stop_ids), None)
            if end is None and spec.stop:
                end = self._stop_string_end(row, spec.stop)
            stopped = end is not None
            end = end or len(row)
            samples.append(Sample(token_ids=row[:end], logprobs=lps[:end].tolist(),
                                  hit_length_limit=not stopped and end == spec.max_tokens))
        return samples

    def _stop_string_end(self, row: list[int], stops: tuple[str, ...]) -> int | None:
        """The shortest prefix of ``row`` whose text holds a stop string (None: none does); the text
        grows with the prefix, so a binary search finds it (a row that stopped early is padded after it)."""
        def hit(k: int) -> bool:
            text = self.tokenizer.decode(row[:k])
            return any(s in text for s in stops)

        if not hit(len(row)):
            return None
        lo, hi = 1, len(row)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if hit(mid) else (mid + 1, hi)
        return lo

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (Hugging Face name, tensor) pairs into the model in place; unknown names are refused."""
        targets = self.model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, tensor in weights:
                if name not in targets or tuple(targets[name].shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"update_weights: {name} {list(tensor.shape)} is not a parameter of the served model"
                    )
                targets[name].data.copy_(tensor.to(device=targets[name].device, dtype=targets[name].dtype))

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.model.named_parameters()

    def release(self) -> None:
        """Nothing to free: ``generate`` keeps no KV cache between calls."""

    def resume(self) -> None:
        """Nothing to restore (see :meth:`release`)."""

    def kv_cache_bytes(self) -> int:
        return 0

    def shutdown(self) -> None:
        self.model = None
