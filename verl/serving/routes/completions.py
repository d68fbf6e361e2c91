"""OpenAI's ``POST /v1/completions`` and ``POST /v1/chat/completions``: the whole response, or with
``stream`` SSE chunks per token piece once it is generated (the engines return finished samples),
then ``data: [DONE]``."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter

from verl.rollout.base import Sample
from verl.serving.errors import RequestError
from verl.serving.engine import ServedModel
from verl.serving.routes.common import RequestChecks, sse, usage
from verl.serving.schema import ChatRequest, CompletionRequest


def _completion_chunks(
    model: ServedModel, head: dict[str, Any], samples: list[Sample], finals: list[tuple[str, str]],
    final_usage: dict[str, int] | None,
) -> Iterator[dict[str, Any]]:
    """``text_completion`` chunks: each choice's text pieces, then its finish reason; the usage last
    when asked for."""
    for k, (sample, (text, finish)) in enumerate(zip(samples, finals)):
        for piece in model.text_pieces(sample, text):
            yield {
                **head,
                "choices": [{"index": k, "text": piece, "logprobs": None, "finish_reason": None}],
            }
        yield {
            **head,
            "choices": [{"index": k, "text": "", "logprobs": None, "finish_reason": finish}],
        }
    if final_usage is not None:
        yield {**head, "choices": [], "usage": final_usage}


def _chat_chunks(
    model: ServedModel, head: dict[str, Any], samples: list[Sample], finals: list[tuple[str, str]],
    final_usage: dict[str, int] | None,
) -> Iterator[dict[str, Any]]:
    """``chat.completion.chunk`` chunks: each choice's role, its content pieces, then its finish
    reason; the usage last when asked for."""
    for k, (sample, (text, finish)) in enumerate(zip(samples, finals)):
        first = {
            "index": k,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        yield {**head, "choices": [first]}
        for piece in model.text_pieces(sample, text):
            yield {
                **head,
                "choices": [
                    {"index": k, "delta": {"content": piece}, "logprobs": None, "finish_reason": None}
                ],
            }
        yield {
            **head,
            "choices": [{"index": k, "delta": {}, "logprobs": None, "finish_reason": finish}],
        }
    if final_usage is not None:
        yield {**head, "choices": [], "usage": final_usage}


def completions_router(model: ServedModel) -> APIRouter:
    router = APIRouter()
    checks = RequestChecks(model)
    limits = model.limits

    @router.post("/v1/completions")
    async def completions(req: CompletionRequest) -> Any:
        checks.check_model(req.model)
        prompts = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
        checks.check_count(len(prompts), "prompt")
        prompt_ids = [checks.check_tokens(model.encode(p), "prompt") for p in prompts]
        spec = checks.spec_of(
            n=req.n or 1,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=req.top_p or 1.0,
            top_k=-1 if req.top_k is None else req.top_k,
            max_tokens=req.max_tokens or limits.default_completion_tokens,
            stop=req.stop_list(),
        )
        samples = await model.batcher.submit(prompt_ids, spec, req.seed)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        finals = [model.response_text(s, req.stop_list()) for s in samples]
        if not req.stream:
            choices = [
                {"index": k, "text": text, "logprobs": None, "finish_reason": finish}
                for k, (text, finish) in enumerate(finals)
            ]
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model.name,
                "choices": choices,
                "usage": usage(prompt_ids, samples),
            }
        head = {"id": rid, "object": "text_completion", "created": created, "model": model.name}
        wants_usage = req.stream_options is not None and req.stream_options.include_usage
        return sse(_completion_chunks(model, head, samples, finals,
                                      usage(prompt_ids, samples) if wants_usage else None))

    @router.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest) -> Any:
        checks.check_model(req.model)
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            raise RequestError(
                400, "send max_tokens or max_completion_tokens, not both", param="max_completion_tokens"
            )
        ids, _ = checks.chat_ids(req.messages, "messages")
        wanted = req.max_completion_tokens or req.max_tokens
        spec = checks.spec_of(
            n=req.n or 1,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=req.top_p or 1.0,
            top_k=-1 if req.top_k is None else req.top_k,
            max_tokens=wanted or limits.max_tokens,
            stop=req.stop_list(),
            max_param="max_completion_tokens" if req.max_completion_tokens else "max_tokens",
        )
        samples = await model.batcher.submit([ids], spec, req.seed)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        finals = [model.response_text(s, req.stop_list()) for s in samples]
        if not req.stream:
            choices = [
                {
                    "index": k,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": finish,
                }
                for k, (text, finish) in enumerate(finals)
            ]
            return {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": model.name,
                "choices": choices,
                "usage": usage([ids], samples),
            }
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model.name}
        wants_usage = req.stream_options is not None and req.stream_options.include_usage
        return sse(_chat_chunks(model, head, samples, finals, usage([ids], samples) if wants_usage else None))

    return router
