"""A command's ``main(argv)`` run in the test's own process, returned as a finished command.

Refusal and error-line tests check a command's exit status and what it printed; running one case as a
real command and the others through ``main(argv)`` here spares a Python start (torch, Megatron, vLLM
imports) per case. ``main()`` configures the root logger as a command does; the logger's handlers and
level are put back afterwards, and so is the working directory.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import subprocess
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any


def load_script(path: str | os.PathLike) -> ModuleType:
    """Import a script by its file path (``tools/*.py`` are not a package) under a name of its own."""
    name = os.path.basename(os.fspath(path)).removesuffix(".py") + "_script"
    spec = importlib.util.spec_from_file_location(name, os.fspath(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_main(main: Callable[[list[str]], Any], argv: Sequence[str], *, capsys: Any = None,
             cwd: str | os.PathLike | None = None, name: str = "main") -> subprocess.CompletedProcess:
    """``main(argv)`` as a finished command: its exit status (``SystemExit``'s code, else the return
    value) and its stdout/stderr, read from pytest's ``capsys`` when given, else captured here."""
    root = logging.getLogger()
    handlers, level, here = root.handlers[:], root.level, os.getcwd()
    out_buf, err_buf = io.StringIO(), io.StringIO()
    if capsys is not None:
        capsys.readouterr()
    if cwd is not None:
        os.chdir(cwd)
    try:
        with contextlib.ExitStack() as stack:
            if capsys is None:
                stack.enter_context(contextlib.redirect_stdout(out_buf))
                stack.enter_context(contextlib.redirect_stderr(err_buf))
            try:
                code = main(list(argv))
            except SystemExit as exc:
                code = exc.code
    finally:
        os.chdir(here)
        root.handlers[:] = handlers
        root.setLevel(level)
    out, err = capsys.readouterr() if capsys is not None else (out_buf.getvalue(), err_buf.getvalue())
    return subprocess.CompletedProcess([name, *argv], code, out, err)
