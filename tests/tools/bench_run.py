"""Running ``tools/bench.py`` in a process of its own, as a user would, for the bench tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "tools", "bench.py")


def run_bench(
    *args: str, timeout: float, threads: str | None = "1", env: dict[str, str] | None = None, one_line: bool = True
) -> tuple[dict[str, Any], subprocess.CompletedProcess]:
    """``python tools/bench.py ARGS`` outside any torchrun world (``WORLD_SIZE`` unset); asserts it
    succeeded and returns its JSON object (the last stdout line; ``one_line``: the only one) and the
    process. ``threads``: ``OMP_NUM_THREADS`` (None: unset); ``env``: more variables."""
    environ = dict(os.environ, PYTHONPATH=REPO, **(env or {}))
    environ.pop("WORLD_SIZE", None)
    if threads is None:
        environ.pop("OMP_NUM_THREADS", None)
    else:
        environ["OMP_NUM_THREADS"] = threads
    proc = subprocess.run(
        [sys.executable, BENCH, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=environ,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    if one_line:
        assert len(lines) == 1, proc.stdout
    return json.loads(lines[-1]), proc
