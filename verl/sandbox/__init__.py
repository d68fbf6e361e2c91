"""Confined execution of untrusted programs (the model's code, the agent's Python tool).

``run(code, stdin=..., files=..., limits=...) -> RunResult`` runs a Python program in its own
bubblewrap sandbox (no network, a private tmpfs, read-only system files, CPU/wall/memory/
process/output limits, the whole process tree killed at the end); ``Sandbox(config)`` holds a
``SandboxConfig`` of its own; ``configure(config)`` sets the process-wide default. ``PythonInterpreter`` is the agent
loop's stateful Python tool; ``python -m verl.serving.sandbox`` serves SandboxFusion's
``run_code`` API. See docs/sandbox.md.
"""

from verl.config.schema import SandboxConfig, SandboxLimitsConfig
from verl.sandbox.interpreter import PythonInterpreter, ToolOutput
from verl.sandbox.runner import (
    RunResult,
    Sandbox,
    SandboxUnavailable,
    choose_python,
    configure,
    default_sandbox,
    run,
)

__all__ = [
    "PythonInterpreter",
    "RunResult",
    "Sandbox",
    "SandboxConfig",
    "SandboxLimitsConfig",
    "SandboxUnavailable",
    "ToolOutput",
    "choose_python",
    "configure",
    "default_sandbox",
    "run",
]
