"""Serving a trained policy (OpenAI-compatible FastAPI app) and the human-review page.

- :func:`create_app` (``verl.serving.app``): the app of a Hugging Face checkpoint directory;
  ``python -m verl.serving --model DIR`` runs it under uvicorn; ``DataStream.export_as_api()``
  exports a stream's actor and returns its app (``verl.export_as_api``, the Python API's).
- :mod:`verl.serving.review`: the SQLite review queue and the page of
  :class:`verl.HumanReviewOperator`.

See docs/serving.md. FastAPI and uvicorn are the ``serve`` extra (``pip install -e ".[serve]"``).
"""

import importlib
from typing import Any

_LAZY = {
    "create_app": "verl.serving.app",
    "create_model_app": "verl.serving.app",
    "RequestError": "verl.serving.errors",
    "ServeLimits": "verl.serving.engine",
    "ServedModel": "verl.serving.engine",
    "BackgroundServer": "verl.serving.server",
    "run": "verl.serving.server",
    "ReviewStore": "verl.serving.review",
    "create_review_app": "verl.serving.review",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'verl.serving' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = sorted(_LAZY)
