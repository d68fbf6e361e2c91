"""``python -m verl.serving --model DIR [--host 127.0.0.1] [--port 8000]``: serve a checkpoint.

A host other than a loopback address needs an API key, read from the environment variable
``VERL_SERVING_API_KEY``; clients send it as ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from verl.serving.engine import ENGINE_CHOICES, ServeLimits
from verl.serving.server import API_KEY_ENV


def parser() -> argparse.ArgumentParser:
    d = ServeLimits()
    p = argparse.ArgumentParser(
        prog="python -m verl.serving",
        description="Serve a Hugging Face checkpoint (a verl trainer's export) with an OpenAI-compatible API: "
        "POST /v1/completions, /v1/chat/completions, /generate; GET /health, /model.",
    )
    p.add_argument("--model", required=True, help="Hugging Face model directory to serve")
    p.add_argument(
        "--host", default="127.0.0.1", help=f"bind address (default 127.0.0.1; others need {API_KEY_ENV})"
    )
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument(
        "--engine",
        choices=ENGINE_CHOICES,
        default="auto",
        help="generation engine: vllm, hf (transformers), auto (vllm when installed; default)",
    )
    p.add_argument(
        "--name", default=None, help="model name clients send as 'model' (default: the directory's name)"
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=d.max_tokens,
        help=f"largest max_tokens a request may ask (default {d.max_tokens})",
    )
    p.add_argument(
        "--max-prompts",
        type=int,
        default=d.max_prompts,
        help=f"prompts per request at most (default {d.max_prompts})",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=d.max_prompt_tokens,
        help=f"tokens per prompt at most (default {d.max_prompt_tokens})",
    )
    p.add_argument(
        "--batch-wait-ms",
        type=float,
        default=d.batch_wait_ms,
        help=f"wait for more requests before generating (default {d.batch_wait_ms})",
    )
    p.add_argument(
        "--max-image-pixels",
        type=int,
        default=d.max_image_pixels,
        help=f"pixels (width x height) of one image of a vision-language model's request at most "
        f"(default {d.max_image_pixels})",
    )
    p.add_argument(
        "--max-images",
        type=int,
        default=d.max_images,
        help=f"images per request at most (default {d.max_images})",
    )
    p.add_argument("--device", default=None, help="the hf engine's device (default: cuda when available)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from verl.serving.app import create_app
    from verl.serving.server import check_bind, run

    api_key = os.environ.get(API_KEY_ENV) or None
    try:
        check_bind(args.host, api_key)  # before the model loads: a refused bind fails at once
        limits = ServeLimits(
            max_tokens=args.max_tokens,
            max_prompts=args.max_prompts,
            max_prompt_tokens=args.max_prompt_tokens,
            batch_wait_ms=args.batch_wait_ms,
            max_image_pixels=args.max_image_pixels,
            max_images=args.max_images,
            default_completion_tokens=min(ServeLimits().default_completion_tokens, args.max_tokens),
        )
        app = create_app(
            args.model, engine=args.engine, limits=limits, api_key=api_key, name=args.name, device=args.device
        )
    except ValueError as exc:
        sys.stderr.write(f"python -m verl.serving: {exc}\n")
        return 2
    try:
        run(app, host=args.host, port=args.port)
    finally:
        app.state.model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
