"""The serving app's routes, one ``APIRouter`` factory per group, each bound to a loaded
:class:`~verl.serving.engine.ServedModel` (``verl.serving.app.create_model_app`` composes them):

- :func:`info.info_router`: ``GET /health``, ``GET /model``, ``GET /v1/models``;
- :func:`generate.generate_router`: ``POST /generate`` (verl's own body: texts or conversations);
- :func:`completions.completions_router`: ``POST /v1/completions`` and ``POST /v1/chat/completions``
  (OpenAI's bodies, SSE chunks with ``stream``).

FastAPI is imported here at module level: these modules load only when an app is built (the
``serve`` extra).
"""
