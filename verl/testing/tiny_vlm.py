"""A tiny Qwen2.5-VL made locally (random weights, a locally trained tokenizer) for tests.

Two decoder layers of hidden 64, a one-block vision tower over 14-pixel patches merged 2x2, and a
``Qwen2_5_VLProcessor`` whose image processor keeps images between 28x28 and 56x56 pixels (at
most 4 merged patches, so at most 4 ``<|image_pad|>`` tokens per image). Saved with
``save_pretrained`` (model, tokenizer, processor), it loads with ``AutoProcessor`` and
``Qwen2_5_VLForConditionalGeneration.from_pretrained``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

__all__ = ["IMAGE_TOKEN", "VISION_TOKENS", "cached_tiny_vlm", "make_tiny_vlm", "tiny_vlm_processor"]

IMAGE_TOKEN = "<|image_pad|>"
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", IMAGE_TOKEN, "<|video_pad|>")

# ChatML with Qwen's image parts: a content list's {"type": "image"} item renders as the vision
# span the processor expands to one <|image_pad|> per merged patch.
VLM_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def tiny_vlm_processor(*, vocab: int = 512, seed: int = 0) -> Any:
    """The processor (tokenizer with the vision tokens + image processor) of the tiny VLM."""
    from transformers import Qwen2VLImageProcessorPil

    from verl.data.processor import ImageTextProcessor

    from verl.data.corpus import generate_corpus
    from verl.data.tiny_model import train_tokenizer

    tokenizer = train_tokenizer(generate_corpus(400, seed=seed), vocab_size=vocab)
    tokenizer.add_special_tokens({"extra_special_tokens": list(tokenizer.extra_special_tokens) + list(VISION_TOKENS)})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    image_processor = Qwen2VLImageProcessorPil(  # (the torchvision-free one)
        patch_size=14, temporal_patch_size=2, merge_size=2, min_pixels=28 * 28, max_pixels=56 * 56,
        size={"shortest_edge": 28 * 28, "longest_edge": 56 * 56},
    )
    return ImageTextProcessor(image_processor, tokenizer, chat_template=VLM_CHAT_TEMPLATE)


def tiny_vlm_config(tokenizer: Any) -> Any:
    """The tiny Qwen2.5-VL config with ``tokenizer``'s special token ids."""
    from transformers import Qwen2_5_VLConfig

    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in zip(
        ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"), VISION_TOKENS)}
    text = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024, rms_norm_eps=1e-6,
        # mrope over (time, height, width): the sections sum to head_dim / 2 = 16.
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, initializer_range=0.02,
    )
    vision = dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[0], in_channels=3,
    )
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids, tie_word_embeddings=False)


def make_tiny_vlm(out_dir: str, *, seed: int = 0) -> str:
    """Build the tiny Qwen2.5-VL (random init with ``seed``) and its processor into ``out_dir``."""
    from transformers import GenerationConfig, Qwen2_5_VLForConditionalGeneration

    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise ValueError(f"{out_dir} already exists and is not empty; give an empty or new folder for the tiny VLM")
    processor = tiny_vlm_processor(seed=seed)
    tok = processor.tokenizer
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(tiny_vlm_config(tok)).float()
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    processor.save_pretrained(out_dir)
    # Named as the model's own processor class, which AutoProcessor builds where torchvision exists.
    config_path = os.path.join(out_dir, "processor_config.json")
    with open(config_path, encoding="utf-8") as f:
        saved = json.load(f)
    saved["processor_class"] = "Qwen2_5_VLProcessor"
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(saved, f, indent=2)
    return out_dir


_CACHED: dict[int, str] = {}


def cached_tiny_vlm(seed: int = 0) -> str:
    """A tiny VLM directory built once per process (tests of several files share it); removed at exit."""
    import atexit
    import shutil
    import tempfile

    if seed not in _CACHED:
        root = tempfile.mkdtemp(prefix="verl-tiny-vlm-")
        atexit.register(shutil.rmtree, root, True)
        _CACHED[seed] = make_tiny_vlm(os.path.join(root, "tiny-qwen2.5-vl"), seed=seed)
    return _CACHED[seed]
