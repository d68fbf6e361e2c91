"""The test session itself leaves nothing behind in the system temp dir."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_pytest_session_removes_its_cache_dir(tmp_path):
    # A nested session with its own temp dir: tests/conftest.py creates verl-test-cache-* there.
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/utils/test_logging.py", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("verl-test-cache-"))
    assert left == [], f"the session left {left} in {tmp_path}"
