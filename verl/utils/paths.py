"""Checks of paths a user gives, so that a wrong one is named for what it is (no torch import).

A model directory that does not exist is "does not exist", a file given for it "is not a
directory", and only a directory without one "has no config.json"; a config.json that is not
JSON names the file and the line.
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["check_dir", "check_model_dir", "load_json_object"]

_MODEL_DIR = "give a Hugging Face model directory (config.json + weights)"


def load_json_object(path: str) -> dict[str, Any]:
    """The JSON object in file ``path``; ValueError naming the file when it is not JSON or not an object."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
            "a truncated or hand-edited copy? Restore the file"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got a {type(data).__name__}")
    return data


def check_dir(path: str | None, key: str | None, *, fix: str) -> str:
    """The user-expanded ``path`` of a directory set by config key ``key`` (None: name only the
    path, as for a command-line flag that argparse names); ValueError ending in ``fix`` when it is
    unset, does not exist, is not a directory or cannot be read."""
    if not path:
        raise ValueError(f"{key} is not set; {fix}")
    given = f"{key}={path!r}" if key else repr(path)
    full = os.path.expanduser(path)
    if not os.path.exists(full):
        raise ValueError(f"{given} does not exist; {fix}")
    if not os.path.isdir(full):
        raise ValueError(f"{given} is not a directory; {fix}")
    if not os.access(full, os.R_OK | os.X_OK):
        raise ValueError(f"{given} cannot be read (permission denied)")
    return full


def check_model_dir(path: str | None, key: str | None) -> str:
    """The user-expanded ``path`` of a Hugging Face model directory set by config key ``key``.

    Raises ValueError naming ``key`` (see :func:`check_dir`) when it is not a readable
    directory, or has no (valid) config.json.
    """
    full = check_dir(path, key, fix=_MODEL_DIR)
    config = os.path.join(full, "config.json")
    if not os.path.isfile(config):
        inside = sorted(
            os.path.join(path, name)
            for name in os.listdir(full)
            if os.path.isfile(os.path.join(full, name, "config.json"))
        )
        hint = f"; did you mean {' or '.join(repr(p) for p in inside[:3])}?" if inside else ""
        given = f"{key}={path!r}" if key else repr(path)
        raise ValueError(f"{given} has no config.json; give a Hugging Face model directory{hint}")
    load_json_object(config)
    return full


