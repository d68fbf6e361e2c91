"""``VLMRewardEngine``: the reward-model role's frozen engine for a vision-language reward model.

A directory written by ``VLMRewardModel.save_pretrained`` / ``VLMJudge.save_pretrained``
(``verl.models.vlm_reward``) as ``reward_model.model.path`` runs here instead of on Megatron or
FSDP2: the whole transformers VLM on each rank of the role, the batch's rows split over the
role's data-parallel ranks and the scores gathered back (as :class:`~verl.roles.engine_role.RoleEngine`
does). Images reach the model from the batch in either layout:

- the RL data path's row-aligned tensors ``mm_pixel_values`` [B, N, D] (each row's patches, zero
  rows after them) and ``mm_image_grid_thw`` [B, K, 3] (each image's grid, zero rows after);
- the reference verl's non-tensor ``multi_modal_inputs`` column: one dict per row with
  ``pixel_values`` [N_i, D] and ``image_grid_thw`` [I_i, 3] (the processor's output for the row).

A micro-batch concatenates its rows' images in order. A row whose tokens hold image placeholders
without images, or a different number of them, is refused naming the row.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch

from verl.protocol import Batch
from verl.roles.dispatch import collect, shard

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

logger = logging.getLogger(__name__)

__all__ = ["MM_IMAGE_GRID_THW", "MM_PIXEL_VALUES", "MULTI_MODAL_INPUTS", "VLMRewardEngine", "image_inputs"]

MULTI_MODAL_INPUTS = "multi_modal_inputs"
"""The batch's non-tensor column of per-row processor outputs (the reference verl's name)."""
MM_PIXEL_VALUES, MM_IMAGE_GRID_THW = "mm_pixel_values", "mm_image_grid_thw"
"""The RL data path's row-aligned image tensors (module docstring)."""


def _row_entries(rows: Batch) -> list[Any]:
    """Each row's images as ``{"pixel_values", "image_grid_thw"}`` (None: no images), from either layout."""
    if MM_PIXEL_VALUES in rows.tensors:
        out: list[Any] = []
        for pv, thw in zip(rows[MM_PIXEL_VALUES], rows[MM_IMAGE_GRID_THW]):  # [N, D], [K, 3]
            real = thw[thw.prod(-1) > 0]
            out.append({"pixel_values": pv[: int(real.prod(-1).sum())], "image_grid_thw": real} if len(real) else None)
        return out
    if MULTI_MODAL_INPUTS in rows:
        return list(rows.non_tensors[MULTI_MODAL_INPUTS])
    return [None] * len(rows)


def _image_token_id(config: Any) -> int | None:
    value = getattr(config, "image_token_id", None)
    return None if value is None else int(value)


def _merge_area(config: Any) -> int:
    vision = getattr(config, "vision_config", None)
    merge = int(getattr(vision, "spatial_merge_size", 1) or 1)
    return merge * merge


def image_inputs(rows: list[Any], input_ids: torch.Tensor, attention_mask: torch.Tensor, config: Any,
                 *, first_row: int = 0) -> dict[str, torch.Tensor]:
    """``pixel_values`` / ``image_grid_thw`` of a micro-batch's rows (``rows``: each row's
    ``multi_modal_inputs`` entry, a dict or None), concatenated in row order; {} when no row has
    images. ValueError naming the row (``first_row`` + its index) when a row's image placeholder
    tokens do not match its inputs."""
    image_id = _image_token_id(config)
    area = _merge_area(config)
    pixels: list[torch.Tensor] = []
    grids: list[torch.Tensor] = []
    for i, entry in enumerate(rows):
        where = f"row {first_row + i}"
        placeholders = 0
        if image_id is not None:
            placeholders = int(((input_ids[i] == image_id) & attention_mask[i].bool()).sum())
        if entry is None or (isinstance(entry, dict) and "pixel_values" not in entry):
            if placeholders:
                raise ValueError(
                    f"{where}: {placeholders} image placeholder tokens but no {MULTI_MODAL_INPUTS}['pixel_values']; "
                    "the reward model needs the row's images (the processor's pixel_values and image_grid_thw)"
                )
            continue
        if not isinstance(entry, dict) or "image_grid_thw" not in entry:
            raise ValueError(
                f"{where}: {MULTI_MODAL_INPUTS} must be a dict with pixel_values and image_grid_thw, got "
                f"{type(entry).__name__}{' keys ' + str(sorted(entry)) if isinstance(entry, dict) else ''}"
            )
        grid = torch.as_tensor(entry["image_grid_thw"]).reshape(-1, 3)
        expected = int(grid.prod(dim=-1).sum()) // area
        if expected != placeholders:
            raise ValueError(
                f"{where}: {placeholders} image placeholder tokens in the sequence but its image_grid_thw "
                f"{grid.tolist()} gives {expected}; the tokens and {MULTI_MODAL_INPUTS} must come from the same "
                "processor call"
            )
        pixels.append(torch.as_tensor(entry["pixel_values"]))
        grids.append(grid)
    if not pixels:
        return {}
    return {"pixel_values": torch.cat(pixels), "image_grid_thw": torch.cat(grids)}


class VLMRewardEngine:
    """A frozen VLM reward model on each rank of the reward-model role (module docstring).

    Args:
        path: the reward model's directory (``reward_model.model.path``).
        pg: the role's process groups (its data-parallel group splits the rows); None: this process alone.
        tensor_parallel: the role's TP degree, which must be 1 (the VLM runs whole on each rank).
        dtype: the weights' dtype.
        trust_remote_code: as ``reward_model.model.trust_remote_code``.
    """

    name = "reward_model"

    def __init__(self, path: str, *, pg: "ProcessGroupCollection | None" = None, tensor_parallel: int = 1,
                 dtype: torch.dtype = torch.float32, trust_remote_code: bool = False) -> None:
        from verl.models.vlm_reward import load_vlm_reward

        if tensor_parallel != 1:
            raise ValueError(
                f"reward_model.megatron.tensor_model_parallel_size={tensor_parallel}: a vision-language reward model "
                f"({path}) runs whole on each rank of its role; set it to 1"
            )
        self.pg = pg
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.model = load_vlm_reward(path, dtype=dtype, trust_remote_code=trust_remote_code).to(self.device)
        logger.info("reward model: %s (%s) from %s", type(self.model).__name__, self.model.kind, os.path.abspath(path))

    @property
    def _dp(self) -> Any:
        return None if self.pg is None else self.pg.dp

    @torch.no_grad()
    def score_rows(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, mm_rows: list[Any],
                   *, micro_batch_size: int, first_row: int = 0) -> torch.Tensor:
        """Scores [B] of rows ``input_ids`` / ``attention_mask`` [B, T] with their ``multi_modal_inputs``."""
        from verl.models.forward import last_token_values

        out: list[torch.Tensor] = []
        for start in range(0, len(input_ids), micro_batch_size):
            ids = input_ids[start:start + micro_batch_size]
            mask = attention_mask[start:start + micro_batch_size]
            images = image_inputs(mm_rows[start:start + micro_batch_size], ids, mask, self.model.config,
                                  first_row=first_row + start)
            images = {k: v.to(self.device) for k, v in images.items()}
            result = self.model(ids.to(self.device), mask.to(self.device), **images)
            if result.dim() == 2:  # a scalar head's values [b, T]: its last real token's
                result = last_token_values(result, mask.to(self.device))
            out.append(result.float().cpu())
        return torch.cat(out) if out else torch.zeros(0)

    def forward(self, batch: Batch, *, output: str = "values", micro_batch_size: int, response_length: int,
                full: bool = True, **_: Any) -> dict[str, torch.Tensor]:
        """``RoleEngine.forward``'s ``values`` [B, T] (``full``; identical on every rank): each row's
        score on its last real token, zeros elsewhere (``RewardModel`` reads that column)."""
        if output != "values" or not full:
            raise ValueError(f"{self.name}: a VLM reward model gives full-width values, not output={output!r}")
        images = [k for k in (MM_PIXEL_VALUES, MM_IMAGE_GRID_THW, MULTI_MODAL_INPUTS) if k in batch]
        piece = shard(batch.select(["input_ids", "attention_mask", *images]), self._dp)
        rows = piece.rows
        mm = _row_entries(rows)
        scores = self.score_rows(rows["input_ids"], rows["attention_mask"], mm, micro_batch_size=micro_batch_size)
        whole = collect(Batch.from_dict({"scores": scores}), self._dp, piece)["scores"]  # [B]
        mask = batch["attention_mask"]
        index = torch.arange(mask.shape[1]).expand_as(mask)
        last = (index * (mask != 0)).argmax(dim=1)  # [B]
        values = torch.zeros(mask.shape, dtype=torch.float32)
        values[torch.arange(len(mask)), last] = whole * (mask.sum(1) > 0)
        return {"values": values}
