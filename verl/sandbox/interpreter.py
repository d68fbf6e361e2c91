"""A stateful Python tool for the agent loop: one object per conversation, every call sandboxed.

``PythonInterpreter().execute(code)`` runs a cell in a fresh sandbox (``verl.sandbox``) after
replaying, silently, the cells of this conversation that ran without error, so names defined
by earlier calls (variables, functions, imports) are there. Like a notebook, the value of a
cell's last expression is shown. The tool's text for the model is the cell's stdout, then its
stderr, then a line saying why it stopped if it did not end normally, cut to ``max_chars``.

Why replay instead of a long-lived interpreter: each call stays one short confined process with
its own limits, and a cell that hangs or crashes cannot corrupt the state of the next. The cost
is that earlier cells run again (their time counts toward the new cell's limits) and that
their side effects repeat (random draws, files written in the work dir); a cell that failed is
not replayed, so what it did before failing is lost.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from verl.config.schema import SandboxLimitsConfig
from verl.sandbox.runner import RunResult, Sandbox, default_sandbox

CELLS_FILE = "cells.json"
_REPLAY_FAILED_MARK = "\x00verl-replay-failed\x00"

# Replays the earlier cells with output discarded, then runs the last one, echoing the value of a
# final expression as a notebook does.
_DRIVER = f"""
import ast, contextlib, io, json, sys
_cells = json.load(open({CELLS_FILE!r}))
_ns = {{"__name__": "__main__", "__builtins__": __builtins__}}
for _i, _cell in enumerate(_cells[:-1]):
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            exec(compile(_cell, f"<cell {{_i}}>", "exec"), _ns)
    except BaseException as _exc:
        sys.stderr.write({_REPLAY_FAILED_MARK!r} + f"cell {{_i}} failed on replay: {{type(_exc).__name__}}: {{_exc}}\\n")
_tree = ast.parse(_cells[-1], f"<cell {{len(_cells) - 1}}>")
_last = _tree.body.pop() if _tree.body and isinstance(_tree.body[-1], ast.Expr) else None
exec(compile(_tree, f"<cell {{len(_cells) - 1}}>", "exec"), _ns)
if _last is not None:
    _value = eval(compile(ast.Expression(_last.value), f"<cell {{len(_cells) - 1}}>", "eval"), _ns)
    if _value is not None:
        sys.stdout.write(repr(_value) + "\\n")  # the REPL's display of the last expression (the program's output)
"""


@dataclass(frozen=True)
class ToolOutput:
    """What one call returns: the text for the model and the run's full result."""

    text: str
    result: RunResult

    @property
    def ok(self) -> bool:
        return self.result.ok


class PythonInterpreter:
    """A conversation's Python tool (see the module doc). Not shared between conversations."""

    name = "python"
    description = (
        "Run Python 3 code in a sandbox without network access. Variables, functions and imports "
        "persist across calls in this conversation. Prints and the value of the last expression are returned."
    )

    def __init__(
        self, sandbox: Sandbox | None = None, limits: SandboxLimitsConfig | None = None, max_chars: int = 4000
    ) -> None:
        self.sandbox = sandbox
        self.limits = limits
        self.max_chars = max_chars
        self.cells: list[str] = []

    @property
    def schema(self) -> dict:
        """The tool's OpenAI function-calling schema."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {
                    "type": "object",
                    "properties": {"code": {"type": "string", "description": "Python code to run."}},
                    "required": ["code"],
                },
            },
        }

    def reset(self) -> None:
        """Forget every definition (a new conversation)."""
        self.cells.clear()

    def execute(self, code: str) -> ToolOutput:
        """Run ``code`` after this conversation's earlier successful cells; keep it if it succeeds."""
        sandbox = self.sandbox or default_sandbox()
        cells = [*self.cells, code]
        result = sandbox.run(_DRIVER, files={CELLS_FILE: json.dumps(cells)}, limits=self.limits)
        if result.ok:
            self.cells.append(code)
        return ToolOutput(self._text(result), result)

    def _text(self, result: RunResult) -> str:
        stderr = "".join(
            line
            for line in result.stderr.splitlines(keepends=True)
            if not line.startswith(_REPLAY_FAILED_MARK)
        )
        # The driver's own frames are noise to the model: keep the traceback from the cell on.
        cut = stderr.find('  File "<cell ')
        if cut >= 0 and stderr.startswith("Traceback"):
            stderr = "Traceback (most recent call last):\n" + stderr[cut:]
        parts = [result.stdout, stderr]
        if not result.ok and result.reason != "error":
            parts.append(f"[stopped: {result.reason}{': ' + result.detail if result.detail else ''}]\n")
        text = "".join(p if p.endswith("\n") or not p else p + "\n" for p in parts)
        if len(text) > self.max_chars:
            half = self.max_chars // 2
            text = text[:half] + f"\n... [{len(text) - self.max_chars} characters cut] ...\n" + text[-half:]
        return text
