"""The colour-square task: a vision-language model names the colour of the square in an image.

Each image (``size`` x ``size`` pixels, 28 by default: one image token of the tiny Qwen2.5-VL)
is a grey background with one square of side 50-85% of the image at a random place, in one of
``colours`` (its RGB jittered a little); the prompt asks which colour it is and lists the
choices, so only the image tells them apart. Records are Geometry3K-shaped (``images`` column of
``{"bytes": PNG}``, one ``<image>`` placeholder), scored by :mod:`verl.rewards.colour_square`;
``extra_info.answer`` is the reference response for SFT. The control split draws the same
prompts with the square left out (data_source ``verl/colour_square_blank``).
"""

from __future__ import annotations

import io
import random
from typing import Any

from verl.data.tasks.common import make_record
from verl.rewards.colour_square import BLANK_DATA_SOURCE, DATA_SOURCE

__all__ = ["COLOURS", "colour_square_records", "square_image"]

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 180, 40), "blue": (30, 60, 220), "yellow": (230, 210, 30),
}
BACKGROUND = (128, 128, 128)


def square_image(colour: tuple[int, int, int] | None, rng: random.Random, *, size: int = 28) -> bytes:
    """A PNG of a grey ``size`` x ``size`` image with one square of ``colour`` (None: no square)."""
    import numpy as np
    from PIL import Image

    pixels = np.empty((size, size, 3), np.int16)
    pixels[:] = BACKGROUND
    pixels += np.array([rng.randint(-12, 12) for _ in range(size * size * 3)], np.int16).reshape(size, size, 3)
    if colour is not None:
        side = rng.randint(int(0.5 * size), int(0.85 * size))
        top, left = rng.randint(0, size - side), rng.randint(0, size - side)
        jitter = [rng.randint(-20, 20) for _ in range(3)]
        pixels[top:top + side, left:left + side] = [c + j for c, j in zip(colour, jitter)]
    out = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(out, format="PNG")
    return out.getvalue()


def colour_square_records(n: int, *, seed: int, split: str, colours: tuple[str, ...] = tuple(COLOURS),
                          blank: bool = False, size: int = 28) -> list[dict[str, Any]]:
    """``n`` records, the colours in turn (balanced: a model blind to the image scores 1/len(colours))."""
    unknown = [c for c in colours if c not in COLOURS]
    if unknown or len(colours) < 2:
        raise ValueError(f"colours {list(colours)}: give two or more of {sorted(COLOURS)}")
    rng = random.Random(seed)
    question = f"<image>What colour is the square: {', '.join(colours[:-1])} or {colours[-1]}?"
    records = []
    for index in range(n):
        name = colours[index % len(colours)]
        image = square_image(None if blank else COLOURS[name], rng, size=size)
        record = make_record(
            data_source=BLANK_DATA_SOURCE if blank else DATA_SOURCE, prompt=question, ground_truth=name,
            ability="vision", extra_info={"split": split, "index": index, "answer": name},
        )
        record["images"] = [{"bytes": image, "path": None}]
        records.append(record)
    rng.shuffle(records)
    return records
