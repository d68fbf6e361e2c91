"""What every command-line entry point shares: one error line and exit status 2 for a user's
mistake, and argparse types that refuse nonsensical numbers.

The policy: library code raises ``ValueError`` (``verl.config.ConfigError`` is one) for anything
a user can cause, naming the file, field or row and the fix, and lets ``OSError`` from the file
system through (it names the file). An entry point runs its work inside :func:`user_errors`,
which turns those two into ``PROG: error: MESSAGE`` on stderr (on rank 0 only, under torchrun)
and exit status 2. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import NoReturn

__all__ = [
    "USER_ERRORS",
    "error_message",
    "fail",
    "hf_model_dir",
    "non_negative_float",
    "non_negative_int",
    "positive_float",
    "positive_int",
    "user_errors",
]

USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError)


def error_message(exc: BaseException) -> str:
    """The text shown for a user error: ``PATH: reason`` for an OSError that names its file."""
    if isinstance(exc, OSError) and exc.strerror and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror}"
    return str(exc) or type(exc).__name__


def report(lines: Iterable[str]) -> None:
    """A command's closing result on stdout, one line each (on rank 0 of a torchrun world): what a
    launcher prints after the run's log, for a person or a script to read."""
    if os.environ.get("RANK", "0") == "0":
        for line in lines:
            sys.stdout.write(f"{line}\n")
        sys.stdout.flush()


def fail(prog: str, message: str) -> NoReturn:
    """Print ``PROG: error: MESSAGE`` (on rank 0 of a torchrun world) and exit with status 2."""
    if os.environ.get("RANK", "0") == "0":  # every rank exits; one of them says why
        sys.stderr.write(f"{prog}: error: {message}\n")
        sys.stderr.flush()
    raise SystemExit(2)


@contextlib.contextmanager
def user_errors(prog: str) -> Iterator[None]:
    """Turn the :data:`USER_ERRORS` raised inside the block into :func:`fail`."""
    try:
        yield
    except USER_ERRORS as exc:
        fail(prog, error_message(exc))


def _number(kind: Callable[[str], float], text: str, what: str) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(_number(int, text, "a whole number"))
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = int(_number(int, text, "a whole number"))
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = _number(float, text, "a number")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value:g}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    value = _number(float, text, "a number")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value:g}")
    return value


def hf_model_dir(text: str) -> str:
    """argparse type: a Hugging Face model directory (see :func:`verl.utils.paths.check_model_dir`)."""
    from verl.utils.paths import check_model_dir

    try:
        check_model_dir(text, None)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text
