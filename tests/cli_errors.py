"""How the tests check that an entry point failed as a user error: exit status 2, no traceback,
and one ``PROG: error: ...`` line that says what is wrong."""

from __future__ import annotations

import subprocess


def one_error_line(proc: subprocess.CompletedProcess, prog: str) -> str:
    """The ``PROG: error: ...`` line of a run that failed as a user error (asserting that it did)."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"{prog}: error: "), proc.stderr[-3000:]
    return line
