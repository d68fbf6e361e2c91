"""``POST /generate``: verl's own body, ``{"prompts": [...]}`` (texts) or ``{"messages": [[...], ...]}``
(conversations) with ``"sampling": {...}``; answers texts, token ids and logprobs per response."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from verl.serving.errors import RequestError
from verl.serving.engine import ServedModel
from verl.serving.routes.common import RequestChecks, usage
from verl.serving.schema import GenerateRequest


def _prompts(req: GenerateRequest, model: ServedModel, checks: RequestChecks) -> tuple[list[list[int]], list[str]]:
    """The request's prompts as token ids and as the texts echoed back (a conversation's: its
    chat-template text)."""
    if (req.prompts is None) == (req.messages is None):
        raise RequestError(
            400, "send exactly one of 'prompts' (texts) and 'messages' (conversations)", param="prompts"
        )
    if req.prompts is not None:
        checks.check_count(len(req.prompts), "prompts")
        prompt_ids = [checks.check_tokens(model.encode(p), f"prompts.{i}") for i, p in enumerate(req.prompts)]
        return prompt_ids, list(req.prompts)
    checks.check_count(len(req.messages), "messages")
    for i, conv in enumerate(req.messages):
        if not conv:
            raise RequestError(400, f"messages.{i} is an empty conversation", param=f"messages.{i}")
    pairs = [checks.chat_ids(conv, f"messages.{i}") for i, conv in enumerate(req.messages)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def generate_router(model: ServedModel) -> APIRouter:
    router = APIRouter()
    checks = RequestChecks(model)

    @router.post("/generate")
    async def generate(req: GenerateRequest) -> dict[str, Any]:
        prompt_ids, texts = _prompts(req, model, checks)
        s = req.sampling
        spec = checks.spec_of(
            n=s.n,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_tokens=s.max_tokens or model.limits.max_tokens,
            stop=s.stop,
            max_param="sampling.max_tokens",
            top_k_param="sampling.top_k",
        )
        samples = await model.batcher.submit(prompt_ids, spec, s.seed)
        outputs = []
        for i, (ids, text) in enumerate(zip(prompt_ids, texts)):
            responses = []
            for sample in samples[i * spec.n : (i + 1) * spec.n]:
                out_text, finish = model.response_text(sample, s.stop)
                responses.append(
                    {
                        "text": out_text,
                        "token_ids": sample.token_ids,
                        "logprobs": sample.logprobs,
                        "finish_reason": finish,
                    }
                )
            outputs.append({"prompt": text, "prompt_tokens": len(ids), "responses": responses})
        return {
            "model": model.name,
            "step": model.step,
            "outputs": outputs,
            "usage": usage(prompt_ids, samples),
        }

    return router
