"""The vision tower of a vision-language actor in the memory plan: its parameters and its activations per image.

The Megatron engine runs a Qwen2.5-VL (``verl.models.megatron_vlm``) with transformers' vision tower
whole on every tensor-parallel rank of the first pipeline stage, in the role's dtype, beside the
language model; the actor trains it unless ``freeze_vision_tower``, the reference holds it frozen.
So on every GPU of the first stage the tower adds its parameters, and when it trains their fp32
gradient (Megatron's DDP ``main_grad``) and optimizer state, counted as the language model's are.

Hand count of the tower (``Qwen2_5_VisionTransformerPretrainedModel``; hidden ``h``, MLP width ``I``,
``depth`` blocks, ``C`` channels, temporal patch ``T``, patch ``P``, spatial merge ``m``, language hidden ``H``):

- patch embedding: a bias-free Conv3d, ``h x C T P^2``;
- each block: two RMSNorms (``2h``), fused q/k/v with bias (``3h^2 + 3h``), the output projection
  (``h^2 + h``), the SwiGLU MLP with biases (``2(hI + I) + Ih + h``);
- the merger: an RMSNorm (``h``), then ``h m^2 -> h m^2`` and ``h m^2 -> H``, with biases.

Activations (bytes of the role's dtype), per patch of an image (``t x h x w`` grid patches, merged ``m^2``
to one language token): what backward keeps when the tower trains -- the patch's pixels (the
convolution's input) and its embedding, per block the two norms' inputs and outputs, q/k/v, the
attention output (fused attention: no ``s x s`` scores, as the language model's count), the MLP's gate,
up and product; the merger's norm input and output and its MLP's input, hidden and activation
(``3 h m^2`` per merged token), and the ``H``-wide features per merged token. A frozen tower (and
any forward-only pass) keeps no graph: it holds the pixels, one block's working set and the features.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

__all__ = ["VisionTower"]


@dataclass(frozen=True, kw_only=True)
class VisionTower:
    """A Qwen2.5-VL vision tower's shapes and the images one sequence carries."""

    depth: int
    hidden: int
    intermediate: int
    in_channels: int = 3
    temporal_patch: int = 2
    patch: int = 14
    merge: int = 2
    out_hidden: int
    """The language model's hidden size (the merger's output)."""
    patches_per_image: int
    """Patches of one image (``t x h x w`` of its grid): the image processor's pixel budget / ``patch^2``."""
    images_per_sequence: int = 1

    @classmethod
    def from_hf(cls, config: dict[str, Any], *, max_pixels: int, images_per_sequence: int = 1) -> "VisionTower":
        """From a Qwen2.5-VL ``config.json`` (its ``vision_config``) and the image processor's pixel budget."""
        v = config["vision_config"]
        patch = int(v.get("patch_size", 14))
        return cls(
            depth=int(v["depth"]), hidden=int(v["hidden_size"]), intermediate=int(v["intermediate_size"]),
            in_channels=int(v.get("in_channels", 3)), temporal_patch=int(v.get("temporal_patch_size", 2)),
            patch=patch, merge=int(v.get("spatial_merge_size", 2)),
            out_hidden=int(v.get("out_hidden_size") or config["text_config"]["hidden_size"]),
            # A still image is repeated over the temporal patch: one temporal step of patch x patch pixels each.
            patches_per_image=max(1, max_pixels // (patch * patch)), images_per_sequence=images_per_sequence,
        )

    @classmethod
    def from_model_dir(cls, model_dir: str, *, images_per_sequence: int = 1) -> "VisionTower | None":
        """The tower of a Qwen2.5-VL directory (its image processor's ``max_pixels`` as the budget); None for
        a text model."""
        from verl.utils.paths import load_json_object

        config = load_json_object(os.path.join(model_dir, "config.json"))
        if not isinstance(config.get("vision_config"), dict):
            return None
        processor = os.path.join(model_dir, "preprocessor_config.json")
        raw = load_json_object(processor) if os.path.isfile(processor) else {}
        size = raw.get("size") or {}
        max_pixels = int(raw.get("max_pixels") or size.get("longest_edge") or 12845056)  # Qwen2.5-VL's default budget
        return cls.from_hf(config, max_pixels=max_pixels, images_per_sequence=images_per_sequence)

    @property
    def params(self) -> int:
        """Elements of the whole tower (module docstring's hand count)."""
        h, i, mh = self.hidden, self.intermediate, self.hidden * self.merge**2
        patch_embed = h * self.in_channels * self.temporal_patch * self.patch**2
        block = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * (h * i + i) + i * h + h
        merger = h + (mh * mh + mh) + (mh * self.out_hidden + self.out_hidden)
        return patch_embed + self.depth * block + merger

    def activation_bytes(self, images: int, dtype_bytes: int, *, trains: bool) -> int:
        """Bytes the tower holds for ``images`` images of ``patches_per_image`` patches in one pass:
        what backward keeps when it ``trains``, else the forward working set (module docstring)."""
        h, i = self.hidden, self.intermediate
        patches = images * self.patches_per_image
        merged = patches // self.merge**2
        pixels = self.in_channels * self.temporal_patch * self.patch**2
        block = 4 * h + 3 * h + h + 3 * i  # norms in/out, q/k/v, attention output, gate/up/product
        if trains:
            per_patch = pixels + h + self.depth * block + 2 * h + 3 * h  # + the merger's norm and MLP (3 h m^2 / m^2)
        else:
            per_patch = pixels + block
        return dtype_bytes * (patches * per_patch + merged * self.out_hidden)
