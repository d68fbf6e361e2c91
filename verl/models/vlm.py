"""A Hugging Face vision-language model (Qwen2.5-VL, Qwen3-VL and their relatives) run by the plain engines.

The engines call a model as ``module(input_ids, attention_mask=..., position_ids=..., use_cache=False)``
(``verl.engine.torch_engine.module_forward_kwargs``). :class:`ImageFeed` is a forward pre-hook on
the model that adds a micro-batch's images to that call: ``pixel_values`` and ``image_grid_thw``
from the batch's ``mm_*`` columns (``verl.protocol.images``), and ``mm_token_type_ids`` (1 at the image
tokens); it drops the one-dimensional ``position_ids``, so the model computes its multimodal rotary
positions (mrope: temporal, height and width indices for image tokens, text positions after them)
from the ids, the grids and the attention mask, as it does inside ``generate``. Without images in a
micro-batch the call goes to the language model with the model's own positions too.

Sharded over data-parallel ranks (FSDP2 gathers each vision block's parameters when it runs), every
rank must run the vision encoder in each micro-batch, or a rank whose rows have images waits on one
whose rows have none: with ``every_rank_sees_images``, a micro-batch without images runs the encoder
on one blank image of the smallest grid and adds 0 x its features to the token embeddings (the
outputs and the gradients do not change; the collectives pair up).

:func:`freeze_vision_tower` is the reference verl's ``freeze_vision_tower``: the vision encoder
(patch embedding, blocks, merger) takes no gradient and no optimizer state.

:class:`VLMValueModel` is a critic's model for a VLM (transformers has no ``*ForSequenceClassification``
for the Qwen-VL families): the VLM's decoder (vision encoder and language model) with a scalar
``score`` head on every position, in the layout the engines' value heads read.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from verl.protocol.images import model_image_inputs

__all__ = ["ImageFeed", "VLMValueModel", "freeze_vision_tower", "is_vlm", "vision_tower"]


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

    def __init__(self, module: torch.nn.Module, *, every_rank_sees_images: bool = False) -> None:
        self.image_token_id = int(module.config.image_token_id)
        self._pending: dict[str, torch.Tensor] | None = None
        # Before FSDP2's own pre-forward hook, so its mixed-precision cast sees pixel_values.
        self._handles = [module.register_forward_pre_hook(self._hook, with_kwargs=True, prepend=True)]
        self._tower = vision_tower(module)
        if every_rank_sees_images:  # inside the root's forward: its parameters (patch embedding, merger) gathered
            self._handles.append(module.get_input_embeddings().register_forward_hook(self._blank_image))

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

    def _blank_image(self, _module: torch.nn.Module, _args: tuple, embeds: torch.Tensor) -> torch.Tensor | None:
        """The token embeddings plus 0 x the encoder's features of a blank image, when the micro-batch has none."""
        if self._pending is None or self._pending:
            return None
        vc = self._tower.config
        merge = int(vc.spatial_merge_size)
        grid = torch.tensor([[1, merge, merge]], device=embeds.device)  # the smallest grid: one merged token
        pixels = torch.zeros(merge * merge, vc.in_channels * vc.temporal_patch_size * vc.patch_size**2,
                             device=embeds.device, dtype=embeds.dtype)
        out = self._tower(pixels, grid_thw=grid)
        # Every parameter of the encoder must be in the graph (FSDP2 reduce-scatters the gradients a unit
        # has): the merged features (pooler_output, after the merger), the blocks' states, and Qwen3-VL's
        # deepstack features (its deepstack mergers' outputs) all.
        parts = [out] if torch.is_tensor(out) else [
            out.last_hidden_state, getattr(out, "pooler_output", None), *(getattr(out, "deepstack_features", None) or ())
        ]
        total = sum(p.sum() for p in parts if torch.is_tensor(p))
        return embeds + 0.0 * total

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self._handles:
            handle.remove()


class VLMValueModel(torch.nn.Module):
    """A value (or reward) head on a vision-language model: ``score`` [hidden] -> 1 (no bias) on every
    position of the VLM's decoder (``model`` of a ``*ForConditionalGeneration``: its vision encoder and
    language model; the LM head is not kept).

    The call the engines make, ``module(input_ids, attention_mask=..., position_ids=..., use_cache=...)``
    plus the images :class:`ImageFeed` adds, returns an object whose ``logits`` [B, T, 1] are the head on
    every position. Its state dict is the VLM's names under ``model.`` and ``score.weight`` (a
    ``*ForSequenceClassification``'s layout); ``config`` is the VLM's.

    Args:
        vlm: a transformers vision-language ``*ForConditionalGeneration`` (Qwen2.5-VL, Qwen3-VL, ...).
        score: the head's weight [1, hidden]; None: verl's scalar-head initialisation
            (``verl.models.heads.scalar_head_init``, as the Megatron and text FSDP2 critics start).
    """

    def __init__(self, vlm: torch.nn.Module, *, score: torch.Tensor | None = None) -> None:
        super().__init__()
        from verl.models.heads import scalar_head_init

        inner = getattr(vlm, "model", None)
        if not is_vlm(vlm) or not isinstance(inner, torch.nn.Module):
            raise ValueError(f"a VLM value head wraps a transformers vision-language *ForConditionalGeneration (with "
                             f".model and a vision_config), got {type(vlm).__name__}")
        self.model = inner
        self.config = vlm.config
        self.generation_config = None
        # FSDP2 shards these one by one (verl.engine.fsdp.decoder_layers): the VLM's decoder and vision blocks.
        self._no_split_modules = list(getattr(vlm, "_no_split_modules", None) or [])
        hidden = int((getattr(self.config, "text_config", None) or self.config).hidden_size)
        dtype = next(inner.parameters()).dtype
        self.score = torch.nn.Linear(hidden, 1, bias=False, dtype=dtype)
        init = score if score is not None else scalar_head_init(hidden, getattr(self.config, "initializer_range", 0.02))
        if tuple(init.shape) != (1, hidden):
            raise ValueError(f"VLMValueModel: score weight of shape {tuple(init.shape)}, expected (1, {hidden})")
        with torch.no_grad():
            self.score.weight.copy_(init)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, use_cache: bool = False, **images: Any) -> Any:
        """``logits`` [B, T, 1]: the head on the decoder's last hidden state at every position; ``images``:
        ``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids`` (the model's own mrope positions)."""
        from transformers.modeling_outputs import ModelOutput

        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=use_cache, **images)
        return ModelOutput(logits=self.score(out.last_hidden_state))

    def save_pretrained(self, out_dir: str, **_kwargs: Any) -> None:
        """config.json (the VLM's) and ``model.safetensors`` (``model.*`` and ``score.weight``): a directory
        :func:`verl.engine.fsdp.load_hf_value_model` loads back, head included."""
        import os

        from safetensors.torch import save_file

        os.makedirs(out_dir, exist_ok=True)
        self.config.save_pretrained(out_dir)
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def saved_score(path: str) -> torch.Tensor | None:
    """``score.weight`` from the safetensors files of the model directory ``path``, or None where none holds it."""
    import glob
    import os

    from safetensors import safe_open

    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(file, framework="pt") as f:
            if "score.weight" in f.keys():
                return f.get_tensor("score.weight")
    return None
