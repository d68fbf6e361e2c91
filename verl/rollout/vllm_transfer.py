"""verl's weight push as a vLLM weight-transfer engine (``vllm.distributed.weight_transfer``).

vLLM (0.32 and later) builds one weight-transfer engine per worker when the engine is started with
a ``weight_transfer_config``, hands it the worker's model, and drives it through its public calls:
``init_weight_transfer_engine``, then per update ``start_weight_update``, ``update_weights``
(one or more chunks), ``finish_weight_update``. ``register_engine`` admits a trainer's own engine.

verl registers :class:`InPlaceTransferEngine` as backend ``"verl_inplace"``: its ``update_weights``
runs the caller's write on the model vLLM handed it (verl's reshard, :mod:`verl.hybrid`: local
copies and buckets exchanged with the actor's ranks, each rank writing its own pieces in place;
or whole Hugging Face tensors through the model's ``load_weights``), so the
push reaches the engine's parameters through vLLM's session, with vLLM's bookkeeping around it
(one update at a time, LoRA state reset at the end). The write travels as a Python callable in
the update info: the engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one worker
per rank), where ``collective_rpc`` calls the local worker with its arguments as they are.

Why not vLLM's own engines: ``nccl``, ``sparse_nccl`` and ``nccl_m2n`` open a PyNccl communicator
and ``ipc`` shares CUDA IPC handles, so none runs on the CPU build; all of them also send whole
Hugging Face tensors from one sender rank (``nccl``, ``ipc``) or their own plan (``nccl_m2n``),
while verl's plan already writes each rank's shard straight from the ranks that hold it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer import WeightTransferEngineFactory
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

__all__ = ["BACKEND", "InPlaceTransferEngine", "register"]

BACKEND = "verl_inplace"
"""The backend name verl's engine is registered under."""

_lock = threading.Lock()
_registered = False


def register() -> None:
    """Register :class:`InPlaceTransferEngine` with vLLM's factory (once per process)."""
    global _registered
    with _lock:
        if not _registered:
            WeightTransferEngineFactory.register_engine(BACKEND, InPlaceTransferEngine)
            _registered = True


@dataclass
class InPlaceInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: the writer is in this process."""


@dataclass
class InPlaceUpdateInfo(WeightTransferUpdateInfo):
    write: Callable[[torch.nn.Module], Any]
    """Called with the model vLLM handed the engine: writes into its parameters in place (verl's
    reshard) or loads whole Hugging Face tensors with its ``load_weights``."""


class InPlaceTransferEngine(WeightTransferEngine[InPlaceInitInfo, InPlaceUpdateInfo]):
    """Runs verl's in-place write into the model vLLM hands the engine (module docstring)."""

    init_info_cls = InPlaceInitInfo
    update_info_cls = InPlaceUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: InPlaceInitInfo) -> None:
        self.updates = 0
        """Chunks received (``update_weights`` calls) since the engine started."""

    def start_weight_update(self) -> None:
        """Parameters are written in place: nothing to prepare."""

    def receive_weights(self, update_info: InPlaceUpdateInfo) -> None:
        with torch.no_grad():
            update_info.write(self.model)
        self.updates += 1

    def finish_weight_update(self) -> None:
        """Nothing cached to rebuild (the rollout adapter resets vLLM's prefix cache)."""

    def shutdown(self) -> None:
        """No transport to close."""
