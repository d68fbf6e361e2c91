"""A tiny Qwen2.5-VL or Qwen3-VL checkpoint made offline: tokenizer, image processor and random weights.

``make_tiny_vlm`` writes a directory that ``verl.data.vlm.load_processor`` (``AutoTokenizer``
and ``AutoImageProcessor``) and ``AutoModelForImageTextToText`` load: the byte-level BPE tokenizer of :mod:`verl.data.tiny_model`
with Qwen's vision tokens added (``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>``,
``<|video_pad|>``), a ``Qwen2VLImageProcessor`` with a small pixel budget (patch 14, spatial
merge 2: a 28 x 28 image is 4 patches, one image token), and a randomly initialised
``Qwen2_5_VLForConditionalGeneration`` (a 2-layer language model of hidden 64 with multimodal
rotary positions, a 2-block vision tower of hidden 32). Everything is a function of the
arguments and the seed.

``TinyVLMSpec(family="qwen3_vl")`` makes a ``Qwen3VLForConditionalGeneration`` of the same sizes
instead: the same tokenizer and vision tokens (Qwen3-VL's are Qwen2.5-VL's), its image processor
with patch 16 (a 32 x 32 image is one image token), a vision tower with learned position
embeddings and one deepstack merger (the features of vision block 0 added to the language
model's first layer's output), and interleaved multimodal rotary positions.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

from verl.data.corpus import generate_corpus
from verl.data.tiny_model import SPECIAL_TOKENS, train_tokenizer

logger = logging.getLogger(__name__)

__all__ = ["VISION_TOKENS", "VLM_CHAT_TEMPLATE", "VLM_FAMILIES", "TinyVLMSpec", "make_tiny_vlm", "tiny_image_processor", "tiny_vlm_tokenizer"]

VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"
VISION_TOKENS = (VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD)
# The families make_tiny_vlm writes, with their vision patch size (Qwen2.5-VL 14, Qwen3-VL 16).
VLM_FAMILIES = {"qwen2_5_vl": 14, "qwen3_vl": 16}

# ChatML as the tiny text models write it; an image content part ({"type": "image"}) renders as
# Qwen's vision span, which the processor widens to one <|image_pad|> per merged patch.
VLM_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True, kw_only=True)
class TinyVLMSpec:
    """Shape of a tiny Qwen2.5-VL (or Qwen3-VL: ``family``)."""

    family: str = "qwen2_5_vl"
    """Model family: qwen2_5_vl or qwen3_vl."""
    hidden: int = 64
    """Language model hidden size."""
    layers: int = 2
    """Language model decoder layers."""
    heads: int = 2
    """Language model attention heads (head_dim = hidden / heads)."""
    kv_heads: int = 1
    """Language model key/value heads."""
    vision_hidden: int = 32
    """Vision tower hidden size."""
    vision_depth: int = 2
    """Vision tower blocks."""
    vision_heads: int = 2
    """Vision tower attention heads."""
    min_pixels: int = 28 * 28
    """Image processor: images are resized up to at least this many pixels."""
    max_pixels: int = 112 * 112
    """Image processor: images are resized down to at most this many pixels (the pixel budget)."""
    vocab: int = 1024
    """Tokenizer vocabulary size before the vision tokens."""
    max_position: int = 2048
    """Maximum sequence length."""
    seed: int = 0
    """Seed of the tokenizer corpus and the weights."""
    corpus_lines: int = 4000
    """Lines of generated text the tokenizer is trained on."""

    def validate(self) -> None:
        """Reject shapes the model cannot take."""
        if self.family not in VLM_FAMILIES:
            raise ValueError(f"--family {self.family!r} is not one of {sorted(VLM_FAMILIES)}")
        for name in ("hidden", "layers", "heads", "kv_heads", "vision_hidden", "vision_depth", "vision_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.hidden % self.heads or (self.hidden // self.heads) % 8:
            raise ValueError(f"--hidden {self.hidden} / --heads {self.heads} must be a head size divisible by 8")
        if self.vision_hidden % self.vision_heads:
            raise ValueError(f"--vision-hidden {self.vision_hidden} is not divisible by --vision-heads {self.vision_heads}")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"--min-pixels {self.min_pixels} must be positive and at most --max-pixels {self.max_pixels}")


def _mrope_section(head_dim: int) -> list[int]:
    """Temporal, height and width shares of the rotary half-dimension (Qwen2.5-VL's 16/24/24 of 64, scaled)."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def tiny_image_processor(spec: TinyVLMSpec) -> Any:
    """Qwen2-VL's image processor (PIL backend: torchvision is not in the environment) with ``spec``'s pixel budget
    and its family's patch size (Qwen3-VL's also normalises with mean and std 0.5, as its checkpoints do)."""
    from transformers import Qwen2VLImageProcessorPil

    size = {"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels}
    extra = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3} if spec.family == "qwen3_vl" else {}
    return Qwen2VLImageProcessorPil(patch_size=VLM_FAMILIES[spec.family], temporal_patch_size=2, merge_size=2,
                                    size=size, **extra)


def tiny_vlm_tokenizer(spec: TinyVLMSpec) -> Any:
    """The tiny text models' byte-level BPE tokenizer with Qwen's vision tokens and an image-aware chat template."""
    tokenizer = train_tokenizer(generate_corpus(spec.corpus_lines, seed=spec.seed), vocab_size=spec.vocab)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[3:]) + list(VISION_TOKENS)})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    return tokenizer


def _config(spec: TinyVLMSpec, tokenizer: Any) -> Any:
    from transformers import Qwen2_5_VLConfig

    head_dim = spec.hidden // spec.heads
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in (
        ("vision_start_token_id", VISION_START), ("image_token_id", IMAGE_PAD),
        ("vision_end_token_id", VISION_END), ("video_token_id", VIDEO_PAD),
    )}
    text = dict(
        vocab_size=len(tokenizer), hidden_size=spec.hidden, intermediate_size=4 * spec.hidden,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_position, rms_norm_eps=1e-6, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": _mrope_section(head_dim)},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.02, tie_word_embeddings=False,
    )
    vision = dict(
        depth=spec.vision_depth, hidden_size=spec.vision_hidden, intermediate_size=2 * spec.vision_hidden,
        num_heads=spec.vision_heads, out_hidden_size=spec.hidden, patch_size=14, spatial_merge_size=2,
        temporal_patch_size=2, window_size=56, fullatt_block_indexes=[spec.vision_depth - 1], in_channels=3,
        initializer_range=0.02,
    )
    if spec.family == "qwen3_vl":
        return _qwen3_config(text, vision, ids, head_dim)
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, dtype="float32", **ids)


def _qwen3_config(text: dict, vision: dict, ids: dict, head_dim: int) -> Any:
    """Qwen3-VL's config of the same sizes: patch 16, learned vision positions on an 8 x 8 grid (resampled to each
    image's), one deepstack merger, interleaved mrope; the text model has no sliding window."""
    from transformers import Qwen3VLConfig

    text = {k: v for k, v in text.items() if k != "use_sliding_window"}
    text["head_dim"] = head_dim
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_interleaved": True}
    vision = {k: v for k, v in vision.items() if k not in ("window_size", "fullatt_block_indexes")}
    vision.update(patch_size=VLM_FAMILIES["qwen3_vl"], num_position_embeddings=64, deepstack_visual_indexes=[0],
                  hidden_act="gelu_pytorch_tanh")
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, dtype="float32", **ids)


def make_tiny_vlm(out_dir: str, spec: TinyVLMSpec | None = None, *, overwrite: bool = False) -> str:
    """Write the tokenizer, processor and randomly initialised Qwen2.5-VL (or Qwen3-VL) of ``spec`` to ``out_dir``.

    A non-empty ``out_dir`` is refused (ValueError) unless ``overwrite``.
    """
    from transformers import GenerationConfig, Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration

    spec = spec or TinyVLMSpec()
    spec.validate()
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise ValueError(f"{out_dir} already exists and is not empty; choose another folder or pass overwrite=True")
    base = tiny_vlm_tokenizer(spec)
    image_processor = tiny_image_processor(spec)
    config = _config(spec, base)
    torch.manual_seed(spec.seed)
    family = Qwen3VLForConditionalGeneration if spec.family == "qwen3_vl" else Qwen2_5_VLForConditionalGeneration
    model = family(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id, pad_token_id=base.pad_token_id
    )
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out_dir))}.tmp-", dir=parent)
    try:
        model.save_pretrained(staging)
        base.save_pretrained(staging)
        image_processor.save_pretrained(staging)
        os.makedirs(out_dir, exist_ok=True)
        for name in sorted(os.listdir(staging)):
            os.replace(os.path.join(staging, name), os.path.join(out_dir, name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info(
        "wrote a tiny %s to %s: %d parameters (vision tower %d), vocab %d, pixels %d..%d",
        type(model).__name__, out_dir, sum(p.numel() for p in model.parameters()),
        sum(p.numel() for p in model.model.visual.parameters()), len(base), spec.min_pixels, spec.max_pixels,
    )
    return out_dir
