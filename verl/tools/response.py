"""A tool's answer with images: :class:`ToolResponse` (the reference verl's multimodal tool response).

``Tool.call`` returns a ``str`` or a ``ToolResponse``; the agent loop renders its images into the tool
turn for a vision-language policy (``verl.rollout.agent.images``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["ToolResponse"]


@dataclass
class ToolResponse:
    """A tool's answer with images (what ``Tool.call`` may return instead of a ``str``)."""

    text: str = ""
    """The answer's text (after the images in the tool turn); may be empty."""
    image: list[Any] = field(default_factory=list)
    """The answer's images, in order: ``PIL.Image`` objects, encoded bytes, ``{"bytes": ...}`` / ``{"path": ...}``
    dicts or paths. A single image is accepted as is."""

    def __post_init__(self) -> None:
        if self.image is None:
            self.image = []
        elif not isinstance(self.image, (list, tuple)):
            self.image = [self.image]
        else:
            self.image = list(self.image)
        if not isinstance(self.text, str):
            raise TypeError(f"ToolResponse.text must be a str, got {type(self.text).__name__}")
