"""Images in agent conversations: a tool may answer with images (:class:`ToolResponse`, the reference
verl's multimodal tool response), and a conversation whose prompt has images keeps them.

A tool's ``call`` returns a ``str`` or a :class:`ToolResponse` (``text`` and ``image``: PIL images, encoded
bytes, ``{"bytes"/"path"}`` dicts or paths). For a vision-language policy the loop renders the tool message
with the chat template's image parts (``{"type": "image"}`` before the text, as the processor's messages
are written), and each image's one ``<|image_pad|>`` becomes as many as its patch grid has merged patches,
as the model's processor writes them (:meth:`ToolImages.encode_turn`). Those ids are what the engine
reads next and what the trainer trains on (token-exact); the images' ``pixel_values`` and
``image_grid_thw`` join the conversation's images after the prompt's, in order
(:attr:`~verl.rollout.agent.trajectory.Trajectory.images`), so the rollout batch's ``mm_*`` columns hold
every image of the conversation (``verl.protocol.images``).

Bad images never end a run: an unreadable one, or one over the image processor's pixel budget (the
budget the dataset holds prompt images to), gives the model an ``Error: ...`` tool turn instead of the
answer; so does a text that spells a vision token (``<|image_pad|>``: an image slot without an image).
A text-only policy, or an engine that takes no images (the vLLM engine here), is a configuration fault:
the loop refuses with one line.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from verl.tools.response import ToolResponse

__all__ = ["ToolImages", "ToolResponse", "TurnImages", "align_image_columns", "row_image_columns"]


@dataclass
class TurnImages:
    """A tool answer's images as the model takes them."""

    pixel_values: torch.Tensor
    """[patches, D]."""
    image_grid_thw: torch.Tensor
    """[images, 3]."""
    pads: list[int]
    """``<|image_pad|>`` tokens of each image (its grid's merged patches)."""


class ToolImages:
    """A vision-language policy's processor for tool images (an :class:`~verl.data.vlm.ImagePromptEncoder`)."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor

    def prepare(self, images: Sequence[Any], *, where: str) -> TurnImages:
        """The model's tensors of ``images``; ValueError starting with ``where`` for an unreadable image or
        one over the pixel budget."""
        from PIL import Image

        from verl.data.vlm import load_image

        loaded = []
        for k, value in enumerate(images):
            at = f"{where}, image {k}"
            if isinstance(value, Image.Image):
                try:
                    value.load()
                    image = value.convert("RGB")
                except (OSError, ValueError) as exc:
                    raise ValueError(f"{at}: unreadable image ({type(exc).__name__}: {exc})") from exc
            elif isinstance(value, (str, os.PathLike, bytes, bytearray, Mapping)):
                image = load_image(value, where=at)
            else:
                raise ValueError(
                    f"{at}: an image is a PIL image, encoded bytes, a {{'bytes'/'path'}} dict or a path, got a "
                    f"{type(value).__name__}"
                )
            budget = self.processor.max_pixels
            if image.width * image.height > budget:
                raise ValueError(
                    f"{at}: the image is {image.width}x{image.height} = {image.width * image.height} pixels, over the "
                    f"image processor's budget of {budget}; the tool must return a smaller image"
                )
            loaded.append(image)
        pixel_values, grid = self.processor.pixels(loaded)
        merge = self.processor.merge_size**2
        return TurnImages(pixel_values.float(), grid, [int(g.prod()) // merge for g in grid])

    def vision_tokens_in(self, text: str) -> list[str]:
        """The vision tokens (image pad, vision start and end) spelled in ``text``: a tool's text holding them
        would tokenize to image slots without images."""
        p = self.processor
        return [token for token in (p.image_token, p.vision_start, p.vision_end) if token in text]

    @staticmethod
    def message(text: str, images: int) -> dict[str, Any]:
        """A tool message with ``images`` image parts before its text (the chat template's multimodal content)."""
        if not images:
            return {"role": "tool", "content": text}
        parts: list[dict[str, Any]] = [{"type": "image"} for _ in range(images)]
        if text:
            parts.append({"type": "text", "text": text})
        return {"role": "tool", "content": parts}

    def expand(self, text: str, pads: Sequence[int]) -> str:
        """``text`` (a rendered tool turn) with its i-th ``<|image_pad|>`` repeated ``pads[i]`` times."""
        token = self.processor.image_token
        pieces = text.split(token)
        if len(pieces) - 1 != len(pads):
            raise ValueError(
                f"the chat template writes {len(pieces) - 1} {token} for {len(pads)} tool image(s); a tool answer's "
                f"images need a template that renders {{'type': 'image'}} content parts (Qwen2.5-VL's does), and a "
                f"text without {token} in it"
            )
        out = [pieces[0]]
        for n, piece in zip(pads, pieces[1:]):
            out += [token * n, piece]
        return "".join(out)


def row_image_columns(rows: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """The ``mm_*`` columns of rows given as lists of (pixel_values [p, D], image_grid_thw [k, 3]) in
    context order, zero-padded to the widest row ({} when no row has an image)."""
    from verl.protocol.images import pad_row_images

    joined = [(torch.cat([pv for pv, _ in r]), torch.cat([g for _, g in r])) if r else None for r in rows]
    real = [j for j in joined if j is not None]
    if not real:
        return {}
    patches = max(pv.shape[0] for pv, _ in real)
    images = max(g.shape[0] for _, g in real)
    dim = real[0][0].shape[1]
    cols = [pad_row_images(*(j if j is not None else (None, None)), patches=patches, images=images, dim=dim)
            for j in joined]
    return {k: torch.stack([c[k] for c in cols]) for k in cols[0]}


def align_image_columns(batch: Any, group: Any) -> Any:
    """``batch`` (a rank's agent rollout) with its ``mm_*`` columns zero-padded to the widest of ``group``'s
    ranks, so the ranks' rollouts gather into one batch (its columns must agree): each rank's widths follow
    its own conversations' images. A rank without image columns gets all-zero ones when another has some.
    Collective over ``group``."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from verl.protocol.collectives import comm_device
    from verl.protocol.images import IMAGE_GRID_THW, PIXEL_VALUES

    has = PIXEL_VALUES in batch
    mine = [batch[PIXEL_VALUES].shape[1], batch[IMAGE_GRID_THW].shape[1], batch[PIXEL_VALUES].shape[2]] if has else [0] * 3
    widths = torch.tensor(mine, dtype=torch.long, device=comm_device(group))
    dist.all_reduce(widths, op=dist.ReduceOp.MAX, group=group)
    patches, images, dim = (int(w) for w in widths.tolist())
    if not images:
        return batch
    rows = len(batch)
    pv = batch[PIXEL_VALUES] if has else torch.zeros(rows, 0, dim)
    grid = batch[IMAGE_GRID_THW] if has else torch.zeros(rows, 0, 3, dtype=torch.long)
    batch[PIXEL_VALUES] = F.pad(pv, (0, 0, 0, patches - pv.shape[1]))
    batch[IMAGE_GRID_THW] = F.pad(grid, (0, 0, 0, images - grid.shape[1]))
    return batch
