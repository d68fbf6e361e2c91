"""What the routes share: the request checks against the server's limits (each a
:class:`~verl.serving.errors.RequestError` naming the field at fault), token usage and SSE framing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from fastapi.responses import StreamingResponse

from verl.rollout.base import Sample, SamplingSpec
from verl.serving.errors import RequestError
from verl.serving.engine import ServedModel


class RequestChecks:
    """A request's checks against ``model`` and its limits, shared by every route."""

    def __init__(self, model: ServedModel) -> None:
        self.model, self.limits = model, model.limits

    def check_model(self, requested: str) -> None:
        if requested != self.model.name:
            raise RequestError(
                404,
                f"model {requested!r} is not served here; this server serves {self.model.name!r}",
                param="model",
                kind="not_found_error",
            )

    def spec_of(
        self,
        *,
        n: int,
        temperature: float,
        top_p: float,
        top_k: int,
        max_tokens: int,
        stop: list[str],
        max_param: str = "max_tokens",
        top_k_param: str = "top_k",
    ) -> SamplingSpec:
        limits = self.limits
        if max_tokens > limits.max_tokens:
            raise RequestError(
                400,
                f"{max_param}={max_tokens} is above this server's limit of {limits.max_tokens}",
                param=max_param,
            )
        if n > limits.max_n:
            raise RequestError(400, f"n={n} is above this server's limit of {limits.max_n}", param="n")
        vocab = self.model.hf_config.get("vocab_size")
        if isinstance(vocab, int) and top_k > vocab:
            raise RequestError(
                400,
                f"{top_k_param}={top_k} is above the model's vocabulary of {vocab} tokens; use at most {vocab}, "
                "or -1 (or 0) for no top-k",
                param=top_k_param,
            )
        if temperature == 0.0:  # greedy: the other knobs do not apply
            top_p, top_k = 1.0, -1
        return SamplingSpec(
            n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens, stop=tuple(stop)
        )

    def check_count(self, count: int, param: str) -> None:
        if count == 0:
            raise RequestError(400, f"{param} is empty; send at least one", param=param)
        if count > self.limits.max_prompts:
            raise RequestError(
                400,
                f"{count} {param} in one request; this server takes at most {self.limits.max_prompts}",
                param=param,
            )

    def check_tokens(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise RequestError(400, f"{param} is empty after tokenization", param=param)
        if len(ids) > self.limits.max_prompt_tokens:
            raise RequestError(
                400,
                f"{param} is {len(ids)} tokens; this server takes at most {self.limits.max_prompt_tokens}",
                param=param,
            )
        return ids

    def chat_ids(self, messages: list[Any], param: str) -> tuple[list[int], str]:
        """(prompt, rendered text) of a conversation: token ids, or for a vision-language model with
        image parts an ``ImagePrompt`` (``verl.serving.vlm``), which reads as its token ids."""
        if getattr(self.model, "processor", None) is not None:
            prompt, text = self.model.encode_image_chat(messages, param)
            return self.check_tokens(prompt, param), text
        for i, message in enumerate(messages):
            if message.has_images():
                j = next(j for j, part in enumerate(message.content) if getattr(part, "type", "") == "image_url")
                where = f"{param}.{i}.content.{j}.image_url"
                raise RequestError(
                    400, f"{where}: {self.model.name} is a text model, it reads no images; send text parts only",
                    param=where,
                )
        try:
            ids, text = self.model.encode_chat([{"role": m.role, "content": m.text()} for m in messages])
        except ValueError as exc:
            raise RequestError(400, str(exc), param=param) from None
        return self.check_tokens(ids, param), text


def usage(prompt_ids: list[list[int]], samples: list[Sample]) -> dict[str, int]:
    p = sum(len(i) for i in prompt_ids)
    c = sum(len(s.token_ids) for s in samples)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def sse(chunks: Iterator[dict[str, Any]]) -> StreamingResponse:
    def body() -> Iterator[str]:
        for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
