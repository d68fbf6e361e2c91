"""``GET /health`` (open without the API key), ``GET /model`` and ``GET /v1/models``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from verl.serving.engine import ServedModel


def info_router(model: ServedModel) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": model.name,
            "engine": model.engine_name,
            "stats": dict(model.batcher.stats),
        }

    @router.get("/model")
    async def model_info() -> dict[str, Any]:
        return model.summary()

    @router.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": model.name, "object": "model", "created": 0, "owned_by": "verl"}],
        }

    return router
