"""Loading a vision-language model's processor (tokenizer + image processor), with or without torchvision.

transformers' ``Qwen2_5_VLProcessor`` (and its relatives) checks its video processor's class at
construction, and that class only exists when torchvision is installed, so ``AutoProcessor`` fails
on a machine without it even for image-only use. :func:`load_processor` then builds
:class:`ImageTextProcessor`: the same processor class with images and text only (its image
processor is transformers' PIL one), which tokenises, expands image placeholders and builds
``pixel_values`` / ``image_grid_thw`` exactly as the full one does for images.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["ImageTextProcessor", "image_token_id", "load_processor"]


def _image_only_class() -> type:
    from transformers import Qwen2_5_VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageTextProcessor(Qwen2_5_VLProcessor):
        """``Qwen2_5_VLProcessor`` without a video processor (see the module docstring)."""

        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None,
                     **kwargs: Any) -> None:
            self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
            self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            self.video_processor = None
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)

    return ImageTextProcessor


def __getattr__(name: str) -> Any:
    if name == "ImageTextProcessor":
        return _image_only_class()
    raise AttributeError(name)


def load_processor(path: str, *, trust_remote_code: bool = False) -> Any:
    """The processor saved in ``path``: ``AutoProcessor``'s, or without torchvision the image-and-text
    :class:`ImageTextProcessor` (Qwen2.5-VL's processor; its placeholder and grid rules are Qwen2-VL's
    and Qwen2.5-VL's) built from the directory's tokenizer and image processor."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    try:
        processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
        if getattr(processor, "image_processor", None) is None:  # (a tokenizer alone: no processor class known)
            raise ValueError(f"AutoProcessor gave a {type(processor).__name__}")
        return processor
    except (ValueError, AttributeError, ImportError, TypeError, OSError) as exc:
        if not os.path.isfile(os.path.join(path, "preprocessor_config.json")) and not os.path.isfile(
            os.path.join(path, "processor_config.json")
        ):
            raise ValueError(f"{path}: no processor saved there (preprocessor_config.json); save the model's "
                             "processor with save_pretrained beside it") from None
        logger.info("%s: AutoProcessor failed (%s); loading an image-and-text processor", path, str(exc)[:120])
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    image_processor = AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    return _image_only_class()(image_processor, tokenizer, chat_template=getattr(tokenizer, "chat_template", None))


def image_token_id(processor: Any) -> int:
    """The id of the token each merged image patch takes in the text (``<|image_pad|>``)."""
    return int(processor.image_token_id)
