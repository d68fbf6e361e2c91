"""The serving errors in OpenAI's shape, shared by the app, its routes and the review page.

:class:`RequestError` is what a route raises for a request it refuses; :func:`openai_error_body`
is the JSON every refusal answers with, ``{"error": {"message", "type", "param", "code"}}``. They
live below :mod:`verl.serving.app` so that the routes the app composes need not import the app.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RequestError", "openai_error_body"]


class RequestError(Exception):
    """A request the server refuses: HTTP ``status``, the field at fault (``param``) and why."""

    def __init__(
        self, status: int, message: str, *, param: str | None, kind: str = "invalid_request_error"
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def openai_error_body(message: str, param: str | None, kind: str) -> dict[str, Any]:
    """OpenAI's error JSON: ``message``, its ``type`` (``kind``) and the field at fault (``param``)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
