"""Images in RL prompts: reading them, checking them, and the tensors a vision-language model takes.

Data layout (the reference verl's, Geometry3K's): a row's ``images`` column (``data.image_key``)
is a list of images, each a dict with ``bytes`` (the encoded file; a ``path`` beside it is used
when ``bytes`` is empty) or a path string; the prompt holds one ``<image>`` placeholder per image,
in order. Relative paths are read from the working directory, else beside the data file.

:class:`ImagePromptEncoder` holds the model's processor's two parts: its tokenizer and its image
processor (``AutoImageProcessor`` of the model directory, or a processor's ``image_processor``:
``pixel_values`` and ``image_grid_thw``). Each ``<image>`` becomes the model's vision span,
``<|vision_start|>`` + one ``<|image_pad|>`` per merged patch + ``<|vision_end|>``, as the family's
``AutoProcessor`` writes it (the parts are used rather than the processor because transformers
refuses to build the Qwen-VL processors without torchvision, which the environment does not have).

In a batch a row's images travel as two row-aligned tensors (``verl.protocol.images``).
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from verl.protocol.images import IMAGE_GRID_THW, MULTI_MODAL_KEYS, PIXEL_VALUES, model_image_inputs, pad_row_images

__all__ = [
    "IMAGE_GRID_THW", "IMAGE_PLACEHOLDER", "MULTI_MODAL_KEYS", "PIXEL_VALUES", "ImagePromptEncoder",
    "is_vlm_dir", "load_image", "model_image_inputs", "pad_row_images",
]

IMAGE_PLACEHOLDER = "<image>"


def is_vlm_dir(path: str) -> bool:
    """Whether the model directory ``path`` holds a vision-language model (its config has a ``vision_config``
    and an image processor config sits beside it)."""
    import json

    config = os.path.join(path, "config.json")
    if not os.path.isfile(config) or not os.path.isfile(os.path.join(path, "preprocessor_config.json")):
        return False
    with open(config, encoding="utf-8") as f:
        return "vision_config" in json.load(f)


def load_image(value: Any, *, where: str, base_dir: str | None = None) -> Any:
    """The RGB ``PIL.Image`` of one entry of an ``images`` list (a dict with ``bytes``/``path``, or a path);
    ValueError starting with ``where`` when it is missing or unreadable."""
    from PIL import Image, UnidentifiedImageError

    data, path = None, None
    if isinstance(value, Mapping):
        data, path = value.get("bytes"), value.get("path")
    elif isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
    elif isinstance(value, (bytes, bytearray)):
        data = value
    else:
        raise ValueError(
            f"{where}: an image is a dict with 'bytes' (or 'path') or a path string, got a {type(value).__name__}; "
            "write images as {'bytes': <encoded file>} (tools/make_vlm_data.py does)"
        )
    try:
        if data:
            image = Image.open(io.BytesIO(data))
        elif path:
            full = path if os.path.isabs(path) or base_dir is None or os.path.exists(path) else os.path.join(base_dir, path)
            if not os.path.isfile(full):
                raise ValueError(f"{where}: image file {path} not found; fix the path or embed the image's bytes")
            image = Image.open(full)
        else:
            raise ValueError(f"{where}: the image has neither bytes nor a path; give one")
        image.load()
    except (UnidentifiedImageError, OSError, SyntaxError) as exc:
        raise ValueError(f"{where}: unreadable image ({type(exc).__name__}: {exc}); replace it with a PNG or JPEG") from exc
    return image.convert("RGB")


class ImagePromptEncoder:
    """A vision-language model's prompts with images: its tokenizer and image processor (module docstring).

    Args:
        tokenizer: the model's tokenizer, with the vision tokens.
        image_processor: a Qwen-VL style image processor (``merge_size``, ``get_number_of_image_patches``).
        max_pixels: the pixel budget an image may have before resizing (None: the image processor's
            ``size["longest_edge"]``); larger images are refused when a dataset is loaded.
    """

    def __init__(self, tokenizer: Any, image_processor: Any, *, max_pixels: int | None = None,
                 image_token: str = "<|image_pad|>", vision_start: str = "<|vision_start|>",
                 vision_end: str = "<|vision_end|>") -> None:
        for token in (image_token, vision_start, vision_end):
            if tokenizer.convert_tokens_to_ids(token) in (None, tokenizer.unk_token_id):
                raise ValueError(f"the tokenizer has no {token} token: it is not a Qwen-VL style model's tokenizer")
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.merge_size = int(image_processor.merge_size)
        self.image_token, self.vision_start, self.vision_end = image_token, vision_start, vision_end
        self.image_token_id = tokenizer.convert_tokens_to_ids(image_token)
        size = getattr(image_processor, "size", None)
        budget = getattr(size, "longest_edge", None) if size is not None else None
        if budget is None and isinstance(size, Mapping):
            budget = size.get("longest_edge")
        self.max_pixels = int(max_pixels if max_pixels is not None else budget)

    @classmethod
    def from_pretrained(cls, path: str, *, tokenizer: Any = None, trust_remote_code: bool = False) -> ImagePromptEncoder:
        """The processor of the model directory ``path`` (its tokenizer unless one is given)."""
        from transformers import AutoImageProcessor, AutoTokenizer

        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        image_processor = AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
        return cls(tokenizer, image_processor)

    @classmethod
    def from_processor(cls, processor: Any) -> ImagePromptEncoder:
        """From a transformers processor (its ``tokenizer`` and ``image_processor``)."""
        return cls(processor.tokenizer, processor.image_processor)

    def patches(self, width: int, height: int) -> int:
        """Patches the image processor makes of a ``width`` x ``height`` image (after its resize)."""
        return int(self.image_processor.get_number_of_image_patches(height, width, {}))

    def row_patches(self, value: Any, prompt: Any, *, row_where: str, image_key: str, prompt_key: str,
                    base_dir: str | None = None) -> list[int]:
        """The patch counts of one data row's images (``value``: its ``image_key`` entry, None for none),
        each opened and checked: a ValueError starting with ``row_where`` (the file and row) for an entry that
        is not a list, an image missing, unreadable or above the pixel budget, or a ``prompt`` whose
        ``<image>`` placeholders do not match the images."""
        where = f"{row_where}: {image_key}"
        if value is None:
            value = []
        if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__len__"):
            raise ValueError(f"{where}: a list of images, got a {type(value).__name__}; write a list")
        counts = []
        for i, entry in enumerate(value):
            image = load_image(entry, where=f"{where}[{i}]", base_dir=base_dir)
            if image.width * image.height > self.max_pixels:
                raise ValueError(
                    f"{where}[{i}]: {image.width}x{image.height} = {image.width * image.height} pixels, above the "
                    f"image processor's budget of {self.max_pixels}; resize the image (or raise the budget: the "
                    "image processor's size.longest_edge)"
                )
            counts.append(self.patches(image.width, image.height))
        placeholders = (prompt if isinstance(prompt, str) else str(prompt)).count(IMAGE_PLACEHOLDER)
        if placeholders != len(counts):
            raise ValueError(
                f"{row_where}: {prompt_key}: {placeholders} {IMAGE_PLACEHOLDER} placeholders for {len(counts)} images "
                f"in {image_key}; write one {IMAGE_PLACEHOLDER} per image, in order"
            )
        return counts

    def expand(self, text: str, patches: Sequence[int], *, where: str) -> str:
        """``text`` with its i-th ``<image>`` replaced by the vision span of ``patches[i]`` patches."""
        pieces = text.split(IMAGE_PLACEHOLDER)
        if len(pieces) - 1 != len(patches):
            raise ValueError(
                f"{where}: the prompt has {len(pieces) - 1} {IMAGE_PLACEHOLDER} placeholders for {len(patches)} images; "
                f"write one {IMAGE_PLACEHOLDER} per image, in order"
            )
        out = [pieces[0]]
        for n, piece in zip(patches, pieces[1:]):
            out += [self.vision_start, self.image_token * (n // self.merge_size**2), self.vision_end, piece]
        return "".join(out)

    def pixels(self, images: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values [sum of patches, D], image_grid_thw [images, 3]) of PIL images."""
        enc = self.image_processor(images=list(images), return_tensors="pt")
        return enc["pixel_values"], enc["image_grid_thw"].long()
