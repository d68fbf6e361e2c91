"""``create_app``: the FastAPI app that serves a policy checkpoint.

Routes:

| route | body | answers |
| --- | --- | --- |
| ``GET /health`` | | ``{"status": "ok", "engine", "stats"}`` (no API key needed) |
| ``GET /model`` | | name, trainer step, engine, config summary, limits |
| ``POST /generate`` | ``{"prompts": [...]}`` or ``{"messages": [[...], ...]}``, ``"sampling": {...}`` | texts, token ids, logprobs |
| ``GET /v1/models`` | | the OpenAI model list (one model) |
| ``POST /v1/completions`` | OpenAI's completions body | OpenAI's completion (SSE chunks with ``stream``) |
| ``POST /v1/chat/completions`` | OpenAI's chat body | OpenAI's chat completion (SSE chunks with ``stream``) |

Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, ``param`` naming
the field at fault: 400 for a body that is not JSON, a missing or unknown field, a value out of
range or above the server's limits; 401 without the API key (when one is set); 404 for a
``model`` that is not the served one. Streaming sends the whole response as per-token chunks once
it is generated (the engines return finished samples), then ``data: [DONE]``.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

from verl.rollout.base import Sample, SamplingSpec
from verl.serving.engine import ServedModel, ServeLimits
from verl.serving.schema import ChatRequest, CompletionRequest, GenerateRequest

logger = logging.getLogger(__name__)

__all__ = ["RequestError", "create_app", "create_model_app", "require_api_key"]

_BODIES = {
    "/generate": GenerateRequest,
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatRequest,
}
_OPEN_ROUTES = ("/health",)


class RequestError(Exception):
    """A request the server refuses: HTTP ``status``, the field at fault (``param``) and why."""

    def __init__(
        self, status: int, message: str, *, param: str | None, kind: str = "invalid_request_error"
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def _error_body(message: str, param: str | None, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def _validation_message(err: dict[str, Any], path: str) -> tuple[str, str]:
    """(param, message) of one pydantic error of a request body."""
    loc = [str(p) for p in err.get("loc", ())]
    if loc and loc[0] == "body":
        loc = loc[1:]
    kind = err.get("type", "")
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return "body", f"the request body is not valid JSON ({detail})"
    param = ".".join(loc) or "body"
    if kind == "extra_forbidden":
        body = _BODIES.get(path)
        known = (
            f"; accepted fields: {sorted(body.model_fields)}" if body is not None and len(loc) == 1 else ""
        )
        return param, f"unknown field {param!r}: not a setting this server accepts{known}"
    if kind == "missing":
        return param, ("the request needs a JSON body" if param == "body" else f"{param} is required")
    return param, f"{param}: {err.get('msg', 'invalid value')}"


def require_api_key(
    app: Any, api_key: str | None, *, open_paths: tuple[str, ...] = (), query_param: str | None = None
) -> None:
    """With ``api_key`` set, answer 401 to every request outside ``open_paths`` that does not send
    ``Authorization: Bearer <api_key>`` (or, when ``query_param`` is given, ``?<query_param>=<api_key>``:
    how a browser opens the review page)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    if api_key is None:
        return
    if not api_key:
        raise ValueError("api_key is empty; pass None for no key or a non-empty key")
    expected = api_key.encode()

    @app.middleware("http")
    async def _check_key(request: Request, call_next: Any) -> Any:
        if request.url.path not in open_paths:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            token = token.strip() if scheme.lower() == "bearer" else ""
            if not token and query_param is not None:
                token = request.query_params.get(query_param, "")
            if not hmac.compare_digest(token.encode(), expected):
                return JSONResponse(
                    _error_body(
                        "missing or wrong API key; send the header 'Authorization: Bearer <key>'",
                        "Authorization",
                        "authentication_error",
                    ),
                    status_code=401,
                )
        return await call_next(request)


def create_app(
    model_dir: str,
    *,
    engine: str = "auto",
    limits: ServeLimits | None = None,
    api_key: str | None = None,
    name: str | None = None,
    device: str | None = None,
    seed: int = 0,
) -> Any:
    """A FastAPI app serving the Hugging Face checkpoint ``model_dir`` (see the module docstring).

    Args:
        model_dir: a Hugging Face model directory (a trainer's ``huggingface/`` export).
        engine: ``"auto"`` (vLLM when installed, else transformers), ``"vllm"`` or ``"hf"``.
        limits: request limits and batching (:class:`ServeLimits`).
        api_key: when set, every route but ``/health`` needs ``Authorization: Bearer <api_key>``.
        name: the model's name (``model`` in OpenAI requests); the directory's name by default.
        device: the hf engine's device (None: CUDA when available).
        seed: the engine's sampling seed.

    The engine lives as long as the app: ``app.state.model.close()`` frees it.
    """
    if api_key is not None and not api_key:  # before the model loads
        raise ValueError("api_key is empty; pass None for no key or a non-empty key")
    model = ServedModel(model_dir, engine=engine, limits=limits, name=name, device=device, seed=seed)
    return create_model_app(model, api_key=api_key)


def create_model_app(model: ServedModel, *, api_key: str | None = None) -> Any:
    """The app of :func:`create_app` on an already loaded :class:`ServedModel`."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title=f"verl serving: {model.name}", version="1")
    app.state.model = model
    app.state.api_key = api_key
    limits = model.limits

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(_error_body(exc.message, exc.param, exc.kind), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        param, message = _validation_message(errors[0], request.url.path)
        if len(errors) > 1:  # name every field at fault, not only the first
            others = [_validation_message(e, request.url.path)[0] for e in errors[1:]]
            message += f"; also at fault: {', '.join(others)}"
        return JSONResponse(_error_body(message, param, "invalid_request_error"), status_code=400)

    @app.exception_handler(Exception)
    async def _failed(request: Request, exc: Exception) -> JSONResponse:
        logger.error("serving: %s %s failed: %r", request.method, request.url.path, exc)
        return JSONResponse(
            _error_body(f"the server failed on this request: {exc!r}", None, "server_error"), status_code=500
        )

    require_api_key(app, api_key, open_paths=_OPEN_ROUTES)

    @app.middleware("http")
    async def _body_size(request: Request, call_next: Any) -> Any:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > limits.max_body_bytes:
            return JSONResponse(
                _error_body(
                    f"the request body is {size} bytes; this server takes at most {limits.max_body_bytes}",
                    "body",
                    "invalid_request_error",
                ),
                status_code=413,
            )
        return await call_next(request)

    # -- helpers --------------------------------------------------------------------------

    def check_model(requested: str) -> None:
        if requested != model.name:
            raise RequestError(
                404,
                f"model {requested!r} is not served here; this server serves {model.name!r}",
                param="model",
                kind="not_found_error",
            )

    def spec_of(
        *,
        n: int,
        temperature: float,
        top_p: float,
        top_k: int,
        max_tokens: int,
        stop: list[str],
        max_param: str = "max_tokens",
    ) -> SamplingSpec:
        if max_tokens > limits.max_tokens:
            raise RequestError(
                400,
                f"{max_param}={max_tokens} is above this server's limit of {limits.max_tokens}",
                param=max_param,
            )
        if n > limits.max_n:
            raise RequestError(400, f"n={n} is above this server's limit of {limits.max_n}", param="n")
        if temperature == 0.0:  # greedy: the other knobs do not apply
            top_p, top_k = 1.0, -1
        return SamplingSpec(
            n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens, stop=tuple(stop)
        )

    def check_count(count: int, param: str) -> None:
        if count == 0:
            raise RequestError(400, f"{param} is empty; send at least one", param=param)
        if count > limits.max_prompts:
            raise RequestError(
                400,
                f"{count} {param} in one request; this server takes at most {limits.max_prompts}",
                param=param,
            )

    def check_tokens(ids: list[int], param: str) -> list[int]:
        if not ids:
            raise RequestError(400, f"{param} is empty after tokenization", param=param)
        if len(ids) > limits.max_prompt_tokens:
            raise RequestError(
                400,
                f"{param} is {len(ids)} tokens; this server takes at most {limits.max_prompt_tokens}",
                param=param,
            )
        return ids

    def chat_ids(messages: list[Any], param: str) -> tuple[list[int], str]:
        try:
            ids, text = model.encode_chat([{"role": m.role, "content": m.text()} for m in messages])
        except ValueError as exc:
            raise RequestError(400, str(exc), param=param) from None
        return check_tokens(ids, param), text

    def usage(prompt_ids: list[list[int]], samples: list[Sample]) -> dict[str, int]:
        p = sum(len(i) for i in prompt_ids)
        c = sum(len(s.token_ids) for s in samples)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def sse(chunks: Iterator[dict[str, Any]]) -> StreamingResponse:
        def body() -> Iterator[str]:
            for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(
            body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    # -- routes ---------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": model.name,
            "engine": model.engine_name,
            "stats": dict(model.batcher.stats),
        }

    @app.get("/model")
    async def model_info() -> dict[str, Any]:
        return model.summary()

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": model.name, "object": "model", "created": 0, "owned_by": "verl"}],
        }

    @app.post("/generate")
    async def generate(req: GenerateRequest) -> dict[str, Any]:
        if (req.prompts is None) == (req.messages is None):
            raise RequestError(
                400, "send exactly one of 'prompts' (texts) and 'messages' (conversations)", param="prompts"
            )
        if req.prompts is not None:
            check_count(len(req.prompts), "prompts")
            prompt_ids = [check_tokens(model.encode(p), f"prompts.{i}") for i, p in enumerate(req.prompts)]
            texts = list(req.prompts)
        else:
            check_count(len(req.messages), "messages")
            for i, conv in enumerate(req.messages):
                if not conv:
                    raise RequestError(400, f"messages.{i} is an empty conversation", param=f"messages.{i}")
            pairs = [chat_ids(conv, f"messages.{i}") for i, conv in enumerate(req.messages)]
            prompt_ids, texts = [p[0] for p in pairs], [p[1] for p in pairs]
        s = req.sampling
        spec = spec_of(
            n=s.n,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_tokens=s.max_tokens or limits.max_tokens,
            stop=s.stop,
            max_param="sampling.max_tokens",
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

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> Any:
        check_model(req.model)
        prompts = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
        check_count(len(prompts), "prompt")
        prompt_ids = [check_tokens(model.encode(p), "prompt") for p in prompts]
        spec = spec_of(
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

        def chunks() -> Iterator[dict[str, Any]]:
            head = {"id": rid, "object": "text_completion", "created": created, "model": model.name}
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
            if req.stream_options is not None and req.stream_options.include_usage:
                yield {**head, "choices": [], "usage": usage(prompt_ids, samples)}

        return sse(chunks())

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest) -> Any:
        check_model(req.model)
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            raise RequestError(
                400, "send max_tokens or max_completion_tokens, not both", param="max_completion_tokens"
            )
        ids, _ = chat_ids(req.messages, "messages")
        wanted = req.max_completion_tokens or req.max_tokens
        spec = spec_of(
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

        def chunks() -> Iterator[dict[str, Any]]:
            head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model.name}
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
            if req.stream_options is not None and req.stream_options.include_usage:
                yield {**head, "choices": [], "usage": usage([ids], samples)}

        return sse(chunks())

    return app
