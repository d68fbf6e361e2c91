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

The routes are ``APIRouter`` groups in :mod:`verl.serving.routes`; this module holds what the app
and the review page share (the API key, the body-size limit) and composes the app; the errors
are :mod:`verl.serving.errors` (``RequestError`` is re-exported here).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from typing import Any

from verl.serving.engine import ServedModel, ServeLimits
from verl.serving.errors import RequestError, openai_error_body
from verl.serving.schema import ChatRequest, CompletionRequest, GenerateRequest

logger = logging.getLogger(__name__)

__all__ = ["BodyLimit", "RequestError", "create_app", "create_model_app", "require_api_key"]

_BODIES = {
    "/generate": GenerateRequest,
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatRequest,
}
_OPEN_ROUTES = ("/health",)


def _is_branch(part: Any) -> bool:
    """Whether a pydantic location part names a union member (``str``, ``list[...]``), not a field."""
    return isinstance(part, str) and (part == "str" or "[" in part)


def _chosen_branches(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The errors without those of a ``str | list[...]`` field's string member when its list member
    also failed (a content list with a bad part is about the part, not about not being a string)."""
    listed = {tuple(e["loc"][:i]) for e in errors for i, p in enumerate(e.get("loc", ())) if _is_branch(p) and p != "str"}
    kept = [e for e in errors if not (e.get("loc") and e["loc"][-1] == "str" and tuple(e["loc"][:-1]) in listed)]
    return kept or errors


def _field_path(loc: tuple[Any, ...]) -> list[str]:
    """A pydantic location as the body's own path: union members dropped, and a tagged union's tag
    after a list index (``content.1.image_url.image_url.url`` -> ``content.1.image_url.url``)."""
    out: list[str] = []
    tagged = False
    for k, part in enumerate(loc):
        if _is_branch(part):
            tagged = "tagged-union[" in str(part)
            continue
        if tagged and k >= 2 and isinstance(loc[k - 1], int) and "tagged-union[" in str(loc[k - 2]):
            tagged = False
            continue  # the tag names the member, not a field
        out.append(str(part))
    return out


def _validation_message(err: dict[str, Any], path: str) -> tuple[str, str]:
    """(param, message) of one pydantic error of a request body."""
    loc = _field_path(tuple(err.get("loc", ())))
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
                    openai_error_body(
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
    """The app of :func:`create_app` on an already loaded :class:`ServedModel`: OpenAI-shaped
    errors, the API key, the body-size limit, then the routers of :mod:`verl.serving.routes`."""
    from fastapi import FastAPI

    from verl.serving.routes.completions import completions_router
    from verl.serving.routes.generate import generate_router
    from verl.serving.routes.info import info_router

    app = FastAPI(title=f"verl serving: {model.name}", version="1")
    app.state.model = model
    app.state.api_key = api_key
    _install_error_handlers(app)
    require_api_key(app, api_key, open_paths=_OPEN_ROUTES)
    _limit_body_size(app, model.limits)
    app.include_router(info_router(model))
    app.include_router(generate_router(model))
    app.include_router(completions_router(model))
    return app


def _install_error_handlers(app: Any) -> None:
    """Every error as OpenAI's body: a :class:`RequestError` with its status, a body pydantic refuses
    as 400 naming every field at fault, anything else as 500 (logged)."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(openai_error_body(exc.message, exc.param, exc.kind), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = _chosen_branches(list(exc.errors()))
        param, message = _validation_message(errors[0], request.url.path)
        if len(errors) > 1:  # name every field at fault, not only the first
            others = [_validation_message(e, request.url.path)[0] for e in errors[1:]]
            message += f"; also at fault: {', '.join(others)}"
        return JSONResponse(openai_error_body(message, param, "invalid_request_error"), status_code=400)

    @app.exception_handler(Exception)
    async def _failed(request: Request, exc: Exception) -> JSONResponse:
        logger.error("serving: %s %s failed: %r", request.method, request.url.path, exc)
        return JSONResponse(
            openai_error_body(f"the server failed on this request: {exc!r}", None, "server_error"),
            status_code=500,
        )


def _limit_body_size(app: Any, limits: ServeLimits) -> None:
    """413 for a request body above ``limits.max_body_bytes`` (:class:`BodyLimit`)."""
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)


class _BodyTooLarge(Exception):
    """Raised into the app when the body it is reading passes the limit."""


class BodyLimit:
    """Pure ASGI middleware: a request whose body is above ``max_bytes`` gets a 413 (OpenAI's error
    shape, ``param: "body"``).

    A declared ``Content-Length`` above the limit is refused before anything is read. The body's
    chunks are counted as the app receives them, so a body without a length
    (``Transfer-Encoding: chunked``) or with a false one is refused as soon as it passes the
    limit: the app's read fails, whatever the app answers to that is dropped, and the 413 goes out
    in its place. A header-only check let chunked bodies of any size through.
    """

    def __init__(
        self, app: Any, *, max_bytes: int, error_body: Callable[[str], dict[str, Any]] | None = None
    ) -> None:
        if max_bytes < 1:
            raise ValueError(f"BodyLimit: max_bytes={max_bytes}; it must be >= 1")
        self.app, self.max_bytes = app, max_bytes
        # The 413's JSON from its one-line message; OpenAI's error shape by default (the sandbox
        # server answers in SandboxFusion's).
        self.error_body = error_body or (
            lambda message: openai_error_body(message, "body", "invalid_request_error")
        )

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"").decode("latin-1").strip()
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send, f"the request body is {int(declared)} bytes")
            return
        received, over, started = 0, False, False

        async def counted() -> dict[str, Any]:
            nonlocal received, over
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    over = True
                    raise _BodyTooLarge()
            return message

        async def guarded(message: dict[str, Any]) -> None:
            nonlocal started
            if over:  # the app's answer to its failed read; the 413 replaces it
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted, guarded)
        except Exception:
            if not over:
                raise
        if over and not started:
            await self._refuse(send, f"the request body is more than {self.max_bytes} bytes (counted as it arrived)")

    async def _refuse(self, send: Any, what: str) -> None:
        import json

        body = json.dumps(self.error_body(f"{what}; this server takes at most {self.max_bytes}")).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")],
            }
        )
        await send({"type": "http.response.body", "body": body})
