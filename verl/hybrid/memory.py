"""The memory handoff between the actor's training state and the rollout engine's KV cache.

Around a rollout on colocated ranks (DESIGN.md, "One step of PPO/GRPO"):

1. ``train``: parameters, gradients and optimizer state are resident on the device;
2. ``offloaded``: :meth:`TrainingStateOffload.offload` copies the chosen categories
   (``actor_rollout_ref.actor.megatron.param_offload`` / ``grad_offload`` / ``optimizer_offload``)
   to a host buffer and releases their device storage;
3. ``rollout``: the rollout engine's KV cache takes the room (``RolloutEngine.resume``: vLLM's
   wake-up on GPU, the CPU build's re-allocation) and generates;
4. ``reloaded``: the KV cache is released (``RolloutEngine.release``) and
   :meth:`TrainingStateOffload.reload` restores the training state, bit-exactly.

:class:`MemoryLedger` records what each phase holds (params / grads / optimizer state / KV cache
bytes) and the peak, set against what the step would need without the handoff (the training
state and the KV cache at once).

Offload works on storages, not tensors: every tensor object, view and ``Parameter`` stays what it
was, only its storage shrinks to 0 bytes (``untyped_storage().resize_(0)``) and grows back
(``resize_(nbytes)`` and a copy). Megatron's DDP keeps each gradient buffer as one flat
``grad_data`` tensor that every parameter's ``main_grad`` views, parameters may view DDP's
``param_data``, and the optimizer's ``state`` dict and fp32 master copies (bf16 training) are
referenced from several places; none of them notices. Storages shared by several tensors move
once.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from verl.hybrid.copy_shards import copy_shards_
from verl.utils.logging import log_rank0, warn_once

if TYPE_CHECKING:
    from verl.config.schema import MegatronConfig
    from verl.engine import MegatronEngine

logger = logging.getLogger(__name__)

__all__ = ["CATEGORIES", "PHASES", "Category", "MemoryLedger", "Phase", "PhaseMemory", "TrainingStateOffload", "memory_handoff"]

Category = Literal["params", "grads", "optimizer"]
CATEGORIES: tuple[Category, ...] = ("params", "grads", "optimizer")
Phase = Literal["train", "offloaded", "rollout", "reloaded"]
PHASES: tuple[Phase, ...] = ("train", "offloaded", "rollout", "reloaded")

# Offsets of storages in the host buffer are rounded up to this many bytes, so every copy starts
# on a cache-line (CPU) / DMA-friendly (pinned host memory) boundary.
_HOST_ALIGN = 512


@dataclass(frozen=True)
class _Slot:
    """One device storage moved to the host buffer: ``host[offset : offset + nbytes]``."""

    category: Category
    storage: torch.UntypedStorage
    nbytes: int
    offset: int


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor ``[nbytes]`` over ``storage`` (shares it; valid while it is allocated)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


def _align(n: int) -> int:
    return -(-n // _HOST_ALIGN) * _HOST_ALIGN


_libc: ctypes.CDLL | None = None


def _trim_host_heap() -> None:
    """Give freed heap pages back to the OS (glibc ``malloc_trim``).

    Storages of a few MB come from the malloc heap once glibc has raised its mmap threshold
    (it does after the first large free); freeing them keeps the pages mapped, so the process's
    resident memory would not drop. ``malloc_trim`` returns free pages anywhere in the heap.
    """
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        _libc = ctypes.CDLL(name) if name else ctypes.CDLL(None)
    trim = getattr(_libc, "malloc_trim", None)
    if trim is None:
        warn_once(logger, "no malloc_trim in this C library: freed host storages may stay resident")
        return
    trim(0)


class TrainingStateOffload:
    """Move a :class:`~verl.engine.MegatronEngine`'s training state off its device and back.

    Args:
        engine: the role's engine on this rank.
        params: move the model parameters (``param_offload``).
        grads: move the gradient buffers (``grad_offload``; needs a trainable engine).
        optimizer: move the optimizer state, fp32 master weights included (``optimizer_offload``;
            needs an engine built with an optimizer).

    :meth:`offload` copies every chosen storage into one host buffer (allocated at the first
    offload and reused; pinned on CUDA) and frees the device storage in place; :meth:`reload`
    re-allocates it and copies the bytes back. Both are idempotent. In between, the engine must
    not run (its tensors have no memory); state read through other references (a checkpoint
    save, say) must wait for :meth:`reload` too.

    How bytes move:

    - device <-> host on CUDA: ``Tensor.copy_(non_blocking=True)`` between the device storage
      and pinned host memory on a side stream. That is a DMA transfer by the GPU's copy engines:
      they drive PCIe at full bandwidth without occupying SMs, overlap with kernels on the
      compute stream, and need pinned pages; a kernel reading host memory directly (zero-copy)
      would spend SMs on PCIe latency and reach a fraction of the bandwidth.
      :meth:`offload` waits for its copies before freeing (so the memory can go to the KV cache
      at once); :meth:`reload` does not block the host: the compute stream waits on an event
      recorded after the copies, so the next forward runs after them.
    - host <-> host (CPU training, where the "device" is host memory):
      ``verl.hybrid.copy_shards_``, one flat byte range per storage. Freed heap pages are
      returned to the OS, so the process's resident memory really drops; the host buffer
      itself stays resident between offloads (on CPU the handoff is a test of the code path,
      not a saving: the state then lives in the host buffer instead).
    """

    def __init__(self, engine: MegatronEngine, *, params: bool, grads: bool, optimizer: bool) -> None:
        if grads and not engine.trainable:
            raise ValueError(
                "TrainingStateOffload: grads=True (megatron.grad_offload) but the engine was built without an "
                "optimizer (optim=None), so it has no gradient buffers; set grad_offload=false for this role"
            )
        if optimizer and engine.optimizer is None:
            raise ValueError(
                "TrainingStateOffload: optimizer=True (megatron.optimizer_offload) but the engine was built "
                "without an optimizer (optim=None); set optimizer_offload=false for this role"
            )
        self.engine = engine
        self.device = engine.device
        self.chosen: tuple[Category, ...] = tuple(
            c for c, on in zip(CATEGORIES, (params, grads, optimizer), strict=True) if on
        )
        self._host: torch.Tensor | None = None  # uint8 [capacity], pinned on CUDA
        self._slots: list[_Slot] = []  # what is offloaded now (empty when resident)
        self._offloaded = False
        on_cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=self.device) if on_cuda else None
        self._reloaded: torch.cuda.Event | None = None

    @classmethod
    def from_config(cls, engine: MegatronEngine, megatron: MegatronConfig) -> TrainingStateOffload:
        """The offload that ``megatron.param_offload`` / ``grad_offload`` / ``optimizer_offload`` ask for."""
        return cls(
            engine, params=megatron.param_offload, grads=megatron.grad_offload, optimizer=megatron.optimizer_offload
        )

    @property
    def offloaded(self) -> bool:
        """Whether the chosen state is on the host now."""
        return self._offloaded

    @property
    def host_capacity_bytes(self) -> int:
        """Size of the host buffer (0 before the first offload)."""
        return 0 if self._host is None else self._host.numel()

    # ------------------------------------------------------------------------------------------
    # what the engine holds

    def _tensors(self) -> Iterator[tuple[Category, torch.Tensor]]:
        """Every tensor of the training state, by category (a storage may appear many times)."""
        from megatron.core.distributed import DistributedDataParallel

        engine = self.engine
        model_params = [p for chunk in engine.chunks for p in chunk.parameters()]
        for chunk in engine.chunks:
            if isinstance(chunk, DistributedDataParallel):
                for buffer in chunk.buffers + chunk.expert_parallel_buffers:
                    if buffer.param_data is not None:
                        yield "params", buffer.param_data
        for p in model_params:
            yield "params", p.data
        for chunk in engine.chunks:
            if isinstance(chunk, DistributedDataParallel):
                for buffer in chunk.buffers + chunk.expert_parallel_buffers:
                    yield "grads", buffer.grad_data
        for p in model_params:
            main_grad = getattr(p, "main_grad", None)
            if main_grad is not None:
                yield "grads", main_grad
            if p.grad is not None:
                yield "grads", p.grad
        if engine.optimizer is None:
            return
        for wrapper in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
            inner = getattr(wrapper, "optimizer", None)
            if inner is None:  # a stub optimizer of a rank without parameters
                continue
            for group in inner.param_groups:
                for p in group["params"]:
                    # fp32 master copies (bf16 training); in fp32 these are the model's own
                    # parameters, already claimed above.
                    yield "optimizer", p.data
                    if p.grad is not None:
                        yield "grads", p.grad
            for state in inner.state.values():
                for value in state.values():
                    if torch.is_tensor(value):
                        yield "optimizer", value

    def _resident(self) -> dict[Category, list[torch.UntypedStorage]]:
        """The distinct allocated storages on the engine's device, by category.

        A storage belongs to the first category that names it (params, grads, optimizer), so
        two views of one buffer, or a master weight that is the parameter itself, count once.
        """
        seen: set[int] = set()
        out: dict[Category, list[torch.UntypedStorage]] = {c: [] for c in CATEGORIES}
        for category, tensor in self._tensors():
            if tensor.device != self.device:
                continue  # e.g. Adam's step counter, kept on the host by torch on CUDA
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0:
                continue
            # Distinct allocated storages have distinct data pointers.
            key = storage.data_ptr()
            if key in seen:
                continue
            seen.add(key)
            out[category].append(storage)
        return out

    def held_bytes(self) -> dict[Category, int]:
        """Bytes of params / grads / optimizer state allocated on the engine's device now."""
        return {c: sum(s.nbytes() for s in storages) for c, storages in self._resident().items()}

    # ------------------------------------------------------------------------------------------
    # moving

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        """The host buffer, grown when the state outgrew it (Adam's state appears at the first step)."""
        if self._host is not None and self._host.numel() >= nbytes:
            return self._host
        if self._stream is not None:
            self._stream.synchronize()  # the old buffer may still feed a reload's copies
        self._host = None
        self._host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        if nbytes:  # nothing to move (no offload asked for, or Adam's state not there yet): say nothing
            log_rank0(logger, logging.INFO, "training-state host buffer: %.1f MiB", nbytes / 2**20)
        return self._host

    def offload(self) -> None:
        """Copy the chosen state to the host buffer and free its device storage (no-op when offloaded)."""
        if self._offloaded:
            return
        resident = self._resident()
        slots: list[_Slot] = []
        end = 0
        for category in self.chosen:
            for storage in resident[category]:
                if not storage.resizable():
                    raise RuntimeError(
                        f"TrainingStateOffload: a {category} storage of {storage.nbytes()} bytes is not resizable "
                        "(memory torch does not own); it cannot be released in place"
                    )
                slots.append(_Slot(category, storage, storage.nbytes(), end))
                end = _align(end + storage.nbytes())
        host = self._host_buffer(end)
        if self._stream is None:
            for slot in slots:
                copy_shards_(host, _byte_view(slot.storage), [(0, slot.offset, slot.nbytes)])
        else:
            stream = self._stream
            # The copies read what the compute stream last wrote (the optimizer step).
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for slot in slots:
                    host.narrow(0, slot.offset, slot.nbytes).copy_(_byte_view(slot.storage), non_blocking=True)
            # Freed device memory may be reused at once: the copies must have read it.
            stream.synchronize()
        for slot in slots:
            slot.storage.resize_(0)
        if self._stream is None:
            _trim_host_heap()
        else:
            # Back to the driver, where the rollout engine's allocator can take it.
            torch.cuda.empty_cache()
        self._slots = slots
        self._offloaded = True
        moved = {c: sum(s.nbytes for s in slots if s.category == c) for c in self.chosen}
        log_rank0(
            logger,
            logging.DEBUG,
            "offloaded training state to host: %s",
            ", ".join(f"{c} {n / 2**20:.1f} MiB" for c, n in moved.items()) or "nothing chosen",
        )

    def reload(self) -> None:
        """Re-allocate the offloaded storages and copy their bytes back (no-op when resident).

        On CUDA the copies are queued on the side stream and the compute stream waits for them;
        the host does not block.
        """
        if not self._offloaded:
            return
        for slot in self._slots:
            if slot.storage.nbytes() != 0:
                raise RuntimeError(
                    f"TrainingStateOffload.reload: a {slot.category} storage was re-allocated while offloaded "
                    f"({slot.storage.nbytes()} bytes); nothing may touch the engine between offload() and reload()"
                )
        for slot in self._slots:
            slot.storage.resize_(slot.nbytes)
        host = self._host
        assert host is not None
        if self._stream is None:
            for slot in self._slots:
                copy_shards_(_byte_view(slot.storage), host, [(slot.offset, 0, slot.nbytes)])
        else:
            stream, compute = self._stream, torch.cuda.current_stream(self.device)
            # The new allocations may reuse memory that queued compute-stream work frees.
            stream.wait_stream(compute)
            with torch.cuda.stream(stream):
                for slot in self._slots:
                    _byte_view(slot.storage).copy_(host.narrow(0, slot.offset, slot.nbytes), non_blocking=True)
                self._reloaded = torch.cuda.Event()
                self._reloaded.record(stream)
            compute.wait_event(self._reloaded)
        # Drop the references: a storage the engine replaces later must be free to go.
        self._slots = []
        self._offloaded = False
        log_rank0(logger, logging.DEBUG, "training state reloaded")


# ----------------------------------------------------------------------------------------------
# phase accounting


@dataclass(frozen=True, kw_only=True)
class PhaseMemory:
    """What one phase of a step held on this rank's device (bytes)."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    kv_cache_bytes: int
    peak_bytes: int
    """CUDA: the most allocated since the previous phase (at least the tracked sum below);
    CPU: the tracked sum (params + grads + optimizer + KV cache)."""

    @property
    def training_bytes(self) -> int:
        """Params + grads + optimizer state."""
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def tracked_bytes(self) -> int:
        """Training state + KV cache."""
        return self.training_bytes + self.kv_cache_bytes


class MemoryLedger:
    """Per-phase memory of one step (``train``, ``offloaded``, ``rollout``, ``reloaded``).

    Call :meth:`record` at the end of each phase with ``TrainingStateOffload.held_bytes()`` and
    ``RolloutEngine.kv_cache_bytes()``; :meth:`metrics` gives flat metrics, :meth:`reset` starts
    the next step. The step's "sum" is what it would hold without the handoff: the largest
    training state and the largest KV cache seen, at once; ``memory/peak_vs_sum`` below 1 is the
    saving.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.phases: dict[Phase, PhaseMemory] = {}
        self._reset_peak()

    def _reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def reset(self) -> None:
        """Forget the recorded phases (a new step)."""
        self.phases = {}
        self._reset_peak()

    def record(self, phase: Phase, *, held: Mapping[Category, int], kv_cache_bytes: int) -> PhaseMemory:
        """Record the end of ``phase``: ``held`` from ``held_bytes()``, the rollout engine's KV cache bytes."""
        if phase not in PHASES:
            raise ValueError(f"MemoryLedger.record: phase {phase!r} is not one of {PHASES}")
        missing = [c for c in CATEGORIES if c not in held]
        if missing:
            raise ValueError(f"MemoryLedger.record: held has no {missing} (pass TrainingStateOffload.held_bytes())")
        tracked = sum(int(held[c]) for c in CATEGORIES) + int(kv_cache_bytes)
        peak = tracked
        if self.device.type == "cuda":
            # At least the tracked sum: the KV cache may live in an allocator pool of vLLM's that
            # torch's statistics do not count.
            peak = max(peak, int(torch.cuda.max_memory_allocated(self.device)))
            torch.cuda.reset_peak_memory_stats(self.device)
        entry = PhaseMemory(
            params_bytes=int(held["params"]),
            grads_bytes=int(held["grads"]),
            optimizer_bytes=int(held["optimizer"]),
            kv_cache_bytes=int(kv_cache_bytes),
            peak_bytes=peak,
        )
        self.phases[phase] = entry
        log_rank0(
            logger,
            logging.DEBUG,
            "memory %s: params %.1f MiB, grads %.1f MiB, optimizer %.1f MiB, KV cache %.1f MiB, peak %.1f MiB",
            phase,
            *(v / 2**20 for v in (entry.params_bytes, entry.grads_bytes, entry.optimizer_bytes,
                                  entry.kv_cache_bytes, entry.peak_bytes)),
        )
        return entry

    def peak_bytes(self) -> int:
        """The largest phase peak of the step."""
        return max((p.peak_bytes for p in self.phases.values()), default=0)

    def sum_bytes(self) -> int:
        """Training state + KV cache: the largest of each over the phases, held at once."""
        training = max((p.training_bytes for p in self.phases.values()), default=0)
        kv = max((p.kv_cache_bytes for p in self.phases.values()), default=0)
        return training + kv

    def metrics(self) -> dict[str, float]:
        """``memory/<phase>/{params,grads,optimizer,kv_cache,peak}_bytes`` per recorded phase, and
        ``memory/peak_bytes``, ``memory/sum_bytes``, ``memory/peak_vs_sum`` for the step."""
        out: dict[str, float] = {}
        for phase, entry in self.phases.items():
            for name, value in _phase_fields(entry):
                out[f"memory/{phase}/{name}"] = float(value)
        total = self.sum_bytes()
        out["memory/peak_bytes"] = float(self.peak_bytes())
        out["memory/sum_bytes"] = float(total)
        out["memory/peak_vs_sum"] = self.peak_bytes() / total if total else 0.0
        return out


def _phase_fields(entry: PhaseMemory) -> Iterable[tuple[str, int]]:
    return (
        ("params_bytes", entry.params_bytes),
        ("grads_bytes", entry.grads_bytes),
        ("optimizer_bytes", entry.optimizer_bytes),
        ("kv_cache_bytes", entry.kv_cache_bytes),
        ("peak_bytes", entry.peak_bytes),
    )


@contextlib.contextmanager
def memory_handoff(sync: Any, state: TrainingStateOffload, params: TrainingStateOffload) -> Iterator[dict[str, float]]:
    """The rollout half of a step around a weight push (collective): the memory handoff of
    :meth:`verl.hybrid.WeightSync.rollout_phase` for any push object ``sync`` with ``ledger``,
    ``rollout``, ``push()`` and ``last_metrics``.

    On entry: ``state`` (gradients, optimizer state) goes to host memory, the engine takes its
    memory back, ``sync.push()`` runs, then ``params`` go to host memory (after the push, which
    reads them). Yields the push's metrics. On exit: the engine's memory is released and the
    training state restored; ``sync.last_metrics`` gets the ledger's per-phase memory."""
    ledger, held, rollout = sync.ledger, state.held_bytes, sync.rollout
    ledger.reset()
    ledger.record("train", held=held(), kv_cache_bytes=rollout.kv_cache_bytes())
    state.offload()
    ledger.record("offloaded", held=held(), kv_cache_bytes=rollout.kv_cache_bytes())
    rollout.resume()
    try:
        metrics = sync.push()
        params.offload()
        yield metrics
        ledger.record("rollout", held=held(), kv_cache_bytes=rollout.kv_cache_bytes())
    finally:
        rollout.release()
        params.reload()
        state.reload()
    ledger.record("reloaded", held=held(), kv_cache_bytes=rollout.kv_cache_bytes())
    sync.last_metrics.update(ledger.metrics())
