"""A batch's images: two row-aligned tensors that travel with every other column.

A vision-language model takes ``pixel_values`` [sum of all images' patches, D] and
``image_grid_thw`` [images, 3] for a whole batch, which do not split by rows. In a :class:`Batch`
each row carries its own images instead, so they are sharded over data-parallel ranks, repeated
for the ``n`` samples of a prompt, reordered and cut into micro-batches like any other column:

- ``mm_pixel_values`` [B, N, D]: the row's images' patches one after the other, zero-padded to N
  (a dataset's widest row; D = channels x temporal patch x patch x patch);
- ``mm_image_grid_thw`` [B, K, 3]: each image's (t, h, w) patch grid, zero rows after the last one
  (K: the most images of a row).

:func:`model_image_inputs` turns rows back into the model's two tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["IMAGE_GRID_THW", "MULTI_MODAL_KEYS", "PIXEL_VALUES", "image_columns", "model_image_inputs", "pad_row_images"]

PIXEL_VALUES = "mm_pixel_values"
IMAGE_GRID_THW = "mm_image_grid_thw"
MULTI_MODAL_KEYS = (PIXEL_VALUES, IMAGE_GRID_THW)


def image_columns(batch: Any) -> list[str]:
    """The image columns ``batch`` (a Batch or a mapping of columns) holds, in :data:`MULTI_MODAL_KEYS` order."""
    return [k for k in MULTI_MODAL_KEYS if k in batch]


def pad_row_images(pixel_values: torch.Tensor | None, grid: torch.Tensor | None, *, patches: int, images: int,
                   dim: int) -> dict[str, torch.Tensor]:
    """One row's images as the batch's two columns: [patches, dim] and [images, 3], zero-padded."""
    pv = torch.zeros(patches, dim, dtype=torch.float32)
    thw = torch.zeros(images, 3, dtype=torch.long)
    if grid is not None and len(grid):
        pv[: pixel_values.shape[0]] = pixel_values
        thw[: grid.shape[0]] = grid
    return {PIXEL_VALUES: pv, IMAGE_GRID_THW: thw}


def model_image_inputs(rows: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's ``pixel_values`` [sum of patches, D] and ``image_grid_thw`` [images, 3] of a micro-batch's
    rows (their ``mm_*`` columns, :func:`pad_row_images`' layout), in row order; {} without images."""
    if PIXEL_VALUES not in rows:
        return {}
    pixels, grids = rows[PIXEL_VALUES], rows[IMAGE_GRID_THW]  # [b, N, D], [b, K, 3]
    keep_pixels, keep_grids = [], []
    for pv, thw in zip(pixels, grids):
        real = thw[thw.prod(-1) > 0]  # [k, 3]
        if len(real):
            keep_grids.append(real)
            keep_pixels.append(pv[: int(real.prod(-1).sum())])
    if not keep_grids:
        return {}
    return {"pixel_values": torch.cat(keep_pixels), "image_grid_thw": torch.cat(keep_grids)}
