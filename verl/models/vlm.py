"""A Hugging Face vision-language model (Qwen2.5-VL and its relatives) run by the plain engines.

The engines call a model as ``module(input_ids, attention_mask=..., position_ids=..., use_cache=False)``
(``verl.engine.torch_engine.module_forward_kwargs``). :class:`ImageFeed` is a forward pre-hook on
the model that adds a micro-batch's images to that call: ``pixel_values`` and ``image_grid_thw``
from the batch's ``mm_*`` columns (``verl.protocol.images``), and ``mm_token_type_ids`` (1 at the image
tokens); it drops the one-dimensional ``position_ids``, so the model computes its multimodal rotary
positions (mrope: temporal, height and width indices for image tokens, text positions after them)
from the ids, the grids and the attention mask, as it does inside ``generate``. Without images in a
micro-batch the call goes to the language model with the model's own positions too.

:func:`freeze_vision_tower` is the reference verl's ``freeze_vision_tower``: the vision encoder
(patch embedding, blocks, merger) takes no gradient and no optimizer state.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from verl.protocol.images import model_image_inputs

__all__ = ["ImageFeed", "freeze_vision_tower", "is_vlm", "vision_tower"]


def is_vlm(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a transformers vision-language model (its config has a ``vision_config``)."""
    config = getattr(module, "config", None)
    return config is not None and getattr(config, "vision_config", None) is not None


def vision_tower(module: torch.nn.Module) -> torch.nn.Module:
    """The vision encoder of a transformers VLM (``model.visual`` in Qwen-VL families, else ``vision_tower``)."""
    inner = getattr(module, "model", module)
    for holder in (inner, module):
        for name in ("visual", "vision_tower", "vision_model"):
            tower = getattr(holder, name, None)
            if isinstance(tower, torch.nn.Module):
                return tower
    raise ValueError(f"{type(module).__name__} has no vision encoder (model.visual / vision_tower) to freeze")


def freeze_vision_tower(module: torch.nn.Module) -> int:
    """Stop gradients into the vision encoder; returns how many parameters it froze."""
    tower = vision_tower(module)
    tower.requires_grad_(False)
    return sum(p.numel() for p in tower.parameters())


class ImageFeed:
    """Feeds each micro-batch's images to a vision-language model's forward (module docstring).

    ``with feed.rows(mb): module(...)``: inside the block, every call of ``module`` gets ``mb``'s
    images; outside it the hook changes nothing.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.image_token_id = int(module.config.image_token_id)
        self._pending: dict[str, torch.Tensor] | None = None
        # Before FSDP2's own pre-forward hook, so its mixed-precision cast sees pixel_values.
        self._handle = module.register_forward_pre_hook(self._hook, with_kwargs=True, prepend=True)

    @contextlib.contextmanager
    def rows(self, mb: Mapping[str, torch.Tensor]) -> Iterator[None]:
        """Calls of the model inside the block read ``mb``'s images (its ``mm_*`` columns)."""
        self._pending = model_image_inputs(mb)
        try:
            yield
        finally:
            self._pending = None

    def around(self, outputs: Callable[..., Any]) -> Callable[..., Any]:
        """An engine's ``_outputs(model, mb, **options)`` that runs inside :meth:`rows` of its micro-batch."""

        @functools.wraps(outputs)
        def with_images(model: torch.nn.Module, mb: Mapping[str, torch.Tensor], **options: Any) -> Any:
            with self.rows(mb):
                return outputs(model, mb, **options)

        return with_images

    def _hook(self, _module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        if self._pending is None:
            return None
        kwargs = dict(kwargs)
        kwargs.pop("position_ids", None)  # the model's own (mrope) positions
        input_ids = args[0] if args else kwargs["input_ids"]
        if not self._pending and bool((input_ids == self.image_token_id).any()):
            raise ValueError(
                f"the micro-batch's rows hold {int((input_ids == self.image_token_id).sum())} image tokens but no images "
                "(mm_pixel_values / mm_image_grid_thw): a step dropped the batch's image columns"
            )
        if self._pending:
            kwargs.update(self._pending)
            kwargs["mm_token_type_ids"] = (input_ids == self.image_token_id).int()
        return args, kwargs

    def remove(self) -> None:
        """Take the hook off the model."""
        self._handle.remove()
