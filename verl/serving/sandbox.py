"""A local server that speaks SandboxFusion's ``run_code`` API, backed by ``verl.sandbox``.

So configs written for the reference verl's SandboxFusion client (``sandbox_fusion.url=
http://HOST:PORT/run_code``) work against this machine's sandbox::

    python -m verl.serving.sandbox [--host 127.0.0.1] [--port 8080] [key=value ...]

``key=value`` overrides set the ``SandboxConfig`` (``limits.memory_mb=512``, ``max_concurrent=4``;
a PPO config's ``sandbox.`` prefix is accepted too). Its limits are ceilings: a request's
``run_timeout`` and ``memory_limit_MB`` above them are capped to them (the answer's ``message``
says so), below the sandbox's smallest memory refused (400); output stays at ``limits.output_bytes``.
A body above ``--max-body-mb`` (16) is refused (413); a body that is not SandboxFusion's (an
unknown field, a field of the wrong type) gets a 400 naming the field. A run whose client
disconnects is ended; SIGTERM ends every run in flight, answers them 503, and stops the server.
It binds to 127.0.0.1 by default; any other host needs an API key, read from the environment
variable ``VERL_SANDBOX_API_KEY``, sent as ``Authorization: Bearer <key>`` or, for clients that
only take a URL (the reference's), as ``?key=<key>`` on it.

``POST /run_code`` takes ``{"code", "language", "stdin", "run_timeout", "compile_timeout",
"memory_limit_MB", "files": {path: base64}, "fetch_files": [path]}`` and answers
``{"status": "Success" | "Failed" | "SandboxError", "message", "compile_result": null,
"run_result": {"status": "Finished" | "TimeLimitExceeded" | "Error", "execution_time",
"return_code", "stdout", "stderr"}, "files": {}}``. Only Python runs (``python``/``python3``);
``fetch_files`` is accepted and answered with no files. ``GET /v1/ping`` answers ``"pong"``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import dataclasses
import functools
import json
import logging
import math
import os
import threading
from typing import Any

from verl.config.schema import SandboxConfig, SandboxLimitsConfig
from verl.sandbox.runner import RunResult, Sandbox, SandboxUnavailable
from verl.utils.cli import fail

logger = logging.getLogger(__name__)

API_KEY_ENV = "VERL_SANDBOX_API_KEY"
LANGUAGES = ("python", "python3")
FIELDS = ("code", "language", "stdin", "run_timeout", "compile_timeout", "memory_limit_MB", "files", "fetch_files")
MAX_BODY_BYTES = 16 << 20
"""Largest request body by default (``--max-body-mb``): the code, stdin and base64 files."""
MIN_MEMORY_MB = 16  # SandboxLimitsConfig.memory_mb's minimum
# How often a run's handler checks whether its client is still connected.
_WATCH_S = 0.1


def _run_status(result: RunResult) -> str:
    if result.reason == "timeout":
        return "TimeLimitExceeded"
    if result.reason == "sandbox_error":
        return "Error"
    return "Finished" if result.exit_code is not None else "Error"


def response_body(result: RunResult, notes: list[str] | None = None) -> dict[str, Any]:
    """SandboxFusion's answer for one run; ``notes`` (the limits the server capped) join ``message``."""
    message = "; ".join([m for m in (result.detail, *(notes or ())) if m])
    if result.reason in ("sandbox_error", "cancelled"):
        return {
            "status": "SandboxError",
            "message": message,
            "compile_result": None,
            "run_result": None,
            "files": {},
        }
    return {
        "status": "Success" if result.reason == "ok" else "Failed",
        "message": message,
        "compile_result": None,
        "run_result": {
            "status": _run_status(result),
            "execution_time": result.wall_time_s,
            "return_code": result.exit_code,
            "stdout": result.stdout,
            "stderr": result.stderr,
        },
        "files": {},
    }


class BadRequest(ValueError):
    """A ``/run_code`` body the server refuses (HTTP 400), with a one-line reason."""


@dataclasses.dataclass(frozen=True)
class RunRequest:
    """One checked ``/run_code`` body: what runs, under which limits, and the limits that were capped."""

    code: str
    stdin: str
    files: dict[str, bytes]
    limits: SandboxLimitsConfig
    notes: list[str]


def _number(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise BadRequest(f"{key!r} must be a positive number or null, got {value!r}")
    return float(value)


def parse_request(body: Any, base: SandboxLimitsConfig) -> RunRequest:
    """Check a ``/run_code`` body against SandboxFusion's fields; BadRequest names the field at fault.

    The server's limits ``base`` are ceilings: ``run_timeout`` (wall and CPU seconds) and
    ``memory_limit_MB`` above them are capped to them, and a note says so in the answer's ``message``.
    """
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown}; accepted fields: {list(FIELDS)}")
    code = body.get("code")
    if not isinstance(code, str):
        raise BadRequest(f"'code' must be a string, got {type(code).__name__}")
    language = body.get("language", "python")
    if language not in LANGUAGES:
        raise BadRequest(f"language {language!r} is not supported here (only {', '.join(LANGUAGES)})")
    stdin = body.get("stdin") or ""
    if not isinstance(stdin, str):
        raise BadRequest(f"'stdin' must be a string or null, got {type(stdin).__name__}")
    raw_files = body.get("files") or {}
    if not isinstance(raw_files, dict):
        raise BadRequest(
            f"'files' must be an object of {{path: base64 string}} or null, got {type(raw_files).__name__}"
        )
    files: dict[str, bytes] = {}
    for path, content in raw_files.items():
        if content is not None and not isinstance(content, str):
            raise BadRequest(f"files[{path!r}] must be a base64 string, got {type(content).__name__}")
        try:
            files[path] = base64.b64decode(content or "", validate=True)
        except binascii.Error:
            raise BadRequest(f"files[{path!r}] is not base64") from None
    fetch = body.get("fetch_files") or []
    if not isinstance(fetch, list) or not all(isinstance(p, str) for p in fetch):
        raise BadRequest("'fetch_files' must be a list of paths or null")
    _number(body, "compile_timeout")  # checked, unused: Python has no compile step
    limits, notes = base, []
    seconds = _number(body, "run_timeout")
    if seconds is not None:
        wall, cpu = min(seconds, base.wall_time_s), min(seconds, base.cpu_time_s)
        if seconds > base.wall_time_s:
            notes.append(f"run_timeout {seconds:g} s capped at the server's limits.wall_time_s={base.wall_time_s:g}")
        limits = dataclasses.replace(limits, wall_time_s=wall, cpu_time_s=cpu)
    memory = _number(body, "memory_limit_MB")
    if memory is not None:
        if memory < MIN_MEMORY_MB:
            raise BadRequest(
                f"'memory_limit_MB' {memory:g} is below the smallest the sandbox runs ({MIN_MEMORY_MB} MB)"
            )
        if memory > base.memory_mb:
            notes.append(f"memory_limit_MB {memory:g} capped at the server's limits.memory_mb={base.memory_mb}")
        limits = dataclasses.replace(limits, memory_mb=min(int(memory), base.memory_mb))
    return RunRequest(code, stdin, files, limits, notes)


class _Runs:
    """The runs in flight, each with its cancel event; :meth:`stop` ends them all and every later one
    (SIGTERM: uvicorn waits for every open request, so a run left going would hold the server)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: set[threading.Event] = set()
        self.stopping = False

    def add(self) -> threading.Event:
        event = threading.Event()
        with self._lock:
            if self.stopping:
                event.set()
            self._events.add(event)
        return event

    def discard(self, event: threading.Event) -> None:
        with self._lock:
            self._events.discard(event)

    def stop(self) -> None:
        with self._lock:
            self.stopping = True
            events = list(self._events)
        for event in events:
            event.set()


def create_app(sandbox: Sandbox, *, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> Any:
    """The FastAPI app; with ``api_key`` every route but ``/v1/ping`` needs it.

    A request body above ``max_body_bytes`` is refused (413) before it is read whole. A run whose
    client disconnects is ended (checked every ``_WATCH_S``); ``app.state.stop_runs()`` ends every
    run in flight and refuses new ones (``main`` calls it at SIGTERM).
    """
    from concurrent.futures import ThreadPoolExecutor

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    from verl.serving.app import BodyLimit, require_api_key

    app = FastAPI(title="verl sandbox (SandboxFusion run_code API)")
    app.state.api_key = api_key
    require_api_key(app, api_key, open_paths=("/v1/ping",), query_param="key")
    app.add_middleware(
        BodyLimit,
        max_bytes=max_body_bytes,
        error_body=lambda message: _error(f"{message} (python -m verl.serving.sandbox --max-body-mb)"),
    )
    base = sandbox.config.limits
    runs = _Runs()
    app.state.stop_runs = runs.stop
    # Runs block a thread each; waiting ones sit in the slot queue (max_concurrent), cancellable.
    executor = ThreadPoolExecutor(max_workers=64, thread_name_prefix="verl-sandbox-run")

    @app.get("/v1/ping")
    def ping() -> str:
        return "pong"

    async def run_code(request: Request) -> Any:
        def bad(message: str) -> Any:
            return JSONResponse(_error(message), status_code=400)

        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError as exc:
            return bad(f"the request body is not valid JSON ({exc})")
        try:
            req = parse_request(body, base)
        except BadRequest as exc:
            return bad(str(exc))
        cancel = runs.add()
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(
            executor,
            functools.partial(
                sandbox.run, req.code, stdin=req.stdin, files=req.files, limits=req.limits, cancel=cancel
            ),
        )
        try:
            while not future.done():
                await asyncio.wait({future}, timeout=_WATCH_S)
                if not cancel.is_set() and await request.is_disconnected():
                    logger.info("sandbox: the client left; ending its run")
                    cancel.set()
            result = future.result()
        except ValueError as exc:  # inputs the work dir cannot take
            return bad(str(exc))
        finally:
            cancel.set()  # a cancelled handler (the server's forced exit) ends its run too
            runs.discard(cancel)
        if result.reason == "cancelled":
            return JSONResponse(response_body(result, req.notes), status_code=503)
        return response_body(result, req.notes)

    # FastAPI reads the annotation to inject the request; postponed annotations would leave it the
    # string "Request", which it resolves in this module's globals, where fastapi is not imported.
    run_code.__annotations__["request"] = Request
    app.post("/run_code")(run_code)
    return app


def _error(message: str) -> dict[str, Any]:
    return {"status": "SandboxError", "message": message, "compile_result": None, "run_result": None, "files": {}}


def main(argv: list[str] | None = None) -> None:
    from verl.config.loader import load_config
    from verl.serving.server import is_loopback, run
    from verl.utils.cli import positive_float

    parser = argparse.ArgumentParser(
        prog="python -m verl.serving.sandbox", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--host", default="127.0.0.1", help=f"bind address (others need {API_KEY_ENV})")
    parser.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    parser.add_argument(
        "--max-body-mb",
        type=positive_float,
        default=MAX_BODY_BYTES / (1 << 20),
        help=f"largest request body in MiB, code, stdin and base64 files together (default {MAX_BODY_BYTES >> 20})",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        help="SandboxConfig overrides, key=value (as in a PPO config, with or without its 'sandbox.' prefix)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    # The keys the library's messages name are a PPO config's (sandbox.allow_unconfined=true): taken as they are.
    overrides = [o.removeprefix("sandbox.") for o in args.overrides]
    try:
        config = load_config(SandboxConfig, overrides=overrides)
        api_key = os.environ.get(API_KEY_ENV) or None
        if not is_loopback(args.host) and not api_key:
            raise ValueError(
                f"binding to {args.host!r} makes the server reachable from other machines, which needs an API "
                f"key: set the environment variable {API_KEY_ENV}, or bind to 127.0.0.1"
            )
        sandbox = Sandbox(config)
        _ = sandbox.confined  # refuse at start when confinement is impossible and not waived
        app = create_app(sandbox, api_key=api_key, max_body_bytes=int(args.max_body_mb * (1 << 20)))
        run(app, host=args.host, port=args.port, on_exit=app.state.stop_runs)
    except (ValueError, SandboxUnavailable) as exc:
        fail("python -m verl.serving.sandbox", str(exc))


if __name__ == "__main__":
    main()
