"""Session-wide test settings: nothing reaches a hub, every cache lands in a temp dir."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

_CACHE_ROOT = tempfile.mkdtemp(prefix="verl-test-cache-")
# Set before any test module imports transformers or vLLM.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(_CACHE_ROOT, "vllm"))
os.environ.setdefault("VLLM_RPC_BASE_PATH", os.path.join(_CACHE_ROOT, "vllm-rpc"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_CACHE_ROOT, "inductor"))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VERL_CACHE_DIR", os.path.join(_CACHE_ROOT, "verl"))  # the CPU matmul rate (verl.trainer.perf)


@pytest.hookimpl(optionalhook=True)  # xdist's hook: known only when xdist is loaded (not with -p no:xdist)
def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts): one worker per core up to 4 on a CPU-only machine (most
    tests use one core; the distributed ones run their own 2-4 ranks), one on a machine with a
    GPU (the CUDA tests each size vLLM's memory for a GPU of their own)."""
    try:
        import torch

        if torch.cuda.is_available():
            return 1
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    """The files that hold the most slow tests first, then the rest (ties in collection order): with
    the files spread over xdist workers (``--dist loadfile``) the long files start early, instead
    of one worker running the last of them alone while the other idles."""
    slow: dict[object, int] = {}
    for item in items:
        if item.get_closest_marker("slow"):
            slow[item.path] = slow.get(item.path, 0) + 1
    items.sort(key=lambda item: -slow.get(item.path, 0))  # most slow tests first; a stable sort


@pytest.fixture
def run_dist():
    """``verl.testing.distributed.run_distributed``: run a module-level body on N ranks (persistent pools)."""
    from verl.testing.distributed import run_distributed

    return run_distributed


_SEMAPHORES_BEFORE: set[str] = set()


def pytest_sessionstart(session):
    if os.path.isdir("/dev/shm"):
        _SEMAPHORES_BEFORE.update(n for n in os.listdir("/dev/shm") if n.startswith("sem.mp-"))


def pytest_sessionfinish(session, exitstatus):
    """Stop the distributed worker pools with the session, so no worker outlives pytest; then
    unlink the named semaphores that processes killed on purpose (SIGKILL tests) left behind,
    and remove the session's cache directory."""
    import sys

    module = sys.modules.get("verl.testing.distributed")
    if module is not None:
        module.shutdown_pools()
    from tests.semaphores import remove_orphaned_semaphores

    remove_orphaned_semaphores(_SEMAPHORES_BEFORE)
    # After the pools are down (their workers inherited the cache paths above).
    shutil.rmtree(_CACHE_ROOT, ignore_errors=True)
