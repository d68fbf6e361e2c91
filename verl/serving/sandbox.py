"""A local server that speaks SandboxFusion's ``run_code`` API, backed by ``verl.sandbox``.

So configs written for the reference verl's SandboxFusion client (``sandbox_fusion.url=
http://HOST:PORT/run_code``) work against this machine's sandbox::

    python -m verl.serving.sandbox [--host 127.0.0.1] [--port 8080] [key=value ...]

``key=value`` overrides set the ``SandboxConfig`` (``limits.memory_mb=512``, ``max_concurrent=4``).
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
import base64
import binascii
import dataclasses
import logging
import os
from typing import Any

from verl.config.schema import SandboxConfig
from verl.sandbox.runner import RunResult, Sandbox, SandboxUnavailable
from verl.utils.cli import fail

logger = logging.getLogger(__name__)

API_KEY_ENV = "VERL_SANDBOX_API_KEY"
LANGUAGES = ("python", "python3")


def _run_status(result: RunResult) -> str:
    if result.reason == "timeout":
        return "TimeLimitExceeded"
    if result.reason == "sandbox_error":
        return "Error"
    return "Finished" if result.exit_code is not None else "Error"


def response_body(result: RunResult) -> dict[str, Any]:
    """SandboxFusion's answer for one run."""
    if result.reason == "sandbox_error":
        return {
            "status": "SandboxError",
            "message": result.detail,
            "compile_result": None,
            "run_result": None,
            "files": {},
        }
    return {
        "status": "Success" if result.reason == "ok" else "Failed",
        "message": result.detail,
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


def create_app(sandbox: Sandbox, *, api_key: str | None = None) -> Any:
    """The FastAPI app; with ``api_key`` every route but ``/v1/ping`` needs it."""
    from fastapi import Body, FastAPI
    from fastapi.responses import JSONResponse

    from verl.serving.app import require_api_key

    app = FastAPI(title="verl sandbox (SandboxFusion run_code API)")
    app.state.api_key = api_key
    require_api_key(app, api_key, open_paths=("/v1/ping",), query_param="key")
    base = sandbox.config.limits

    @app.get("/v1/ping")
    def ping() -> str:
        return "pong"

    @app.post("/run_code")
    def run_code(body: dict[str, Any] = Body(...)) -> Any:  # noqa: B008 - FastAPI's idiom
        def bad(message: str) -> Any:
            return JSONResponse(
                {"status": "SandboxError", "message": message, "run_result": None}, status_code=400
            )

        code = body.get("code")
        if not isinstance(code, str):
            return bad("'code' must be a string")
        language = body.get("language", "python")
        if language not in LANGUAGES:
            return bad(f"language {language!r} is not supported here (only {', '.join(LANGUAGES)})")
        stdin = body.get("stdin") or ""
        if not isinstance(stdin, str):
            return bad("'stdin' must be a string or null")
        files: dict[str, bytes] = {}
        for path, content in (body.get("files") or {}).items():
            try:
                files[path] = base64.b64decode(content or "", validate=True)
            except (binascii.Error, TypeError):
                return bad(f"files[{path!r}] is not base64")
        limits = base
        try:
            if body.get("run_timeout") is not None:
                seconds = float(body["run_timeout"])
                limits = dataclasses.replace(limits, wall_time_s=seconds, cpu_time_s=seconds)
            if body.get("memory_limit_MB") is not None:
                limits = dataclasses.replace(limits, memory_mb=int(body["memory_limit_MB"]))
        except (TypeError, ValueError) as exc:
            return bad(f"bad limit: {exc}")
        try:
            result = sandbox.run(code, stdin=stdin, files=files, limits=limits)
        except ValueError as exc:
            return bad(str(exc))
        return response_body(result)

    return app


def main(argv: list[str] | None = None) -> None:
    from verl.config.loader import load_config
    from verl.serving.server import run

    parser = argparse.ArgumentParser(
        prog="python -m verl.serving.sandbox", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--host", default="127.0.0.1", help=f"bind address (others need {API_KEY_ENV})")
    parser.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    parser.add_argument("overrides", nargs="*", help="SandboxConfig overrides, key=value")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(SandboxConfig, overrides=args.overrides)
        api_key = os.environ.get(API_KEY_ENV) or None
        sandbox = Sandbox(config)
        _ = sandbox.confined  # refuse at start when confinement is impossible and not waived
        run(create_app(sandbox, api_key=api_key), host=args.host, port=args.port)
    except (ValueError, SandboxUnavailable) as exc:
        # check_bind names the serving module's key variable; this server reads its own.
        fail("python -m verl.serving.sandbox", str(exc).replace("VERL_SERVING_API_KEY", API_KEY_ENV))


if __name__ == "__main__":
    main()
