"""Request bodies of the serving app, checked field by field (pydantic, unknown keys refused).

Every model forbids keys it does not define, so a misspelt or unsupported sampling setting
(``temprature``, ``frequency_penalty``) is a 400 naming it, never silently ignored. Limits that
depend on the server's settings (``max_tokens`` above the limit, too many prompts) are checked by
the app (:mod:`verl.serving.app`), which knows them.

No field names a file: the model is the server's, fixed at start-up; ``model`` in the OpenAI
bodies must be the served model's name.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "GenerateRequest",
    "ImagePart",
    "ImageURL",
    "Sampling",
    "StreamOptions",
    "TextPart",
]


# The engines' integer ranges: a seed seeds a 64-bit generator (torch's, vLLM's per request); top_k
# becomes an int32 tensor entry in vLLM's sampler. Beyond these a request was a 500, not a 400.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
TOP_K_MAX = 2**31 - 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Sampling(_Strict):
    """Sampling settings of ``POST /generate`` (None: the server's default)."""

    max_tokens: int | None = Field(None, ge=1, description="New tokens per response at most.")
    temperature: float = Field(1.0, ge=0.0, le=10.0, description="Sampling temperature; 0: greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus-sampling threshold.")
    top_k: int = Field(-1, ge=-1, le=TOP_K_MAX, description="Top-k; -1 or 0: off; at most the vocabulary.")
    n: int = Field(1, ge=1, description="Responses per prompt.")
    stop: list[str] = Field(default_factory=list, description="Stop strings (cut from the returned text).")
    seed: int | None = Field(
        None, ge=SEED_MIN, le=SEED_MAX, description="Seed of this request's own random stream (a 64-bit integer)."
    )


class TextPart(_Strict):
    """One text part of a message's content list (the OpenAI content-part shape)."""

    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    """The ``image_url`` of an image part: a ``data:image/...;base64,`` URL (no network fetches)."""

    url: str
    detail: Literal["auto", "low", "high"] | None = None  # OpenAI's resolution hint; the processor decides here


class ImagePart(_Strict):
    """One image part of a message's content list (OpenAI's ``image_url`` content part); read by a
    vision-language model only (``verl.serving.vlm``)."""

    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(_Strict):
    """One chat turn."""

    role: Literal["system", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None

    def text(self) -> str:
        """The text of the turn (its text parts joined); ValueError when it holds an image part."""
        if isinstance(self.content, str):
            return self.content
        for part in self.content:
            if isinstance(part, ImagePart):
                raise ValueError("holds an image part")
        return "".join(part.text for part in self.content)

    def has_images(self) -> bool:
        return not isinstance(self.content, str) and any(isinstance(p, ImagePart) for p in self.content)


class GenerateRequest(_Strict):
    """``POST /generate``: plain prompts or chat conversations (exactly one of the two)."""

    prompts: list[str] | None = None
    messages: list[list[ChatMessage]] | None = None
    sampling: Sampling = Field(default_factory=Sampling)


class StreamOptions(_Strict):
    include_usage: bool = False


class _OpenAISampling(_Strict):
    """The sampling fields the OpenAI bodies share (``top_k`` as vLLM's extension)."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=TOP_K_MAX)
    n: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the caller's own logs; not used here

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_OpenAISampling):
    """``POST /v1/completions`` (OpenAI's legacy completions)."""

    prompt: str | list[str]


class ChatRequest(_OpenAISampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
