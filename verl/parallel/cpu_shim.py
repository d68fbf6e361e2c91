"""Run Megatron-core on a machine without CUDA (development boxes, CI) with gloo.

Megatron-core assumes a GPU in a handful of places. ``apply_cpu_shim()`` answers each of
them, and does nothing when CUDA is available (the GPU path is never altered):

1. ``torch.cuda.current_device()`` returns the CPU device. Megatron calls it to place
   buffers: ``GlobalMemoryBuffer.get_tensor``, the tensor-parallel ``mappings`` and
   ``param_and_grad_buffer`` (``torch.empty(..., device=torch.cuda.current_device())``).
2. An RNG states tracker that keeps ``torch.get_rng_state()`` snapshots stands in for
   ``CudaRNGStatesTracker``, so ``model_parallel_cuda_manual_seed`` and
   ``get_cuda_rng_tracker().fork()`` (weight init of TP layers, dropout) work unchanged.
3. Hard-coded CUDA placements go to the CPU: ``torch.zeros(..., device="cuda")`` in the
   pipeline schedules (``total_num_tokens``), ``param_and_grad_buffer`` (warm-up tensor),
   ``transformer.utils`` (causal masks), the optimizers (``_scale``, ``found_inf``), and
   ``tensor.cuda()`` in ``tensor_parallel.broadcast_data``.
4. ``torch.cuda.synchronize()`` is a no-op (p2p communication with ``batch_p2p_comm=True``
   calls it after ``batch_isend_irecv``).
5. ``WrappedTorchNorm`` (the local spec's norm) asserts ``not config.sequence_parallel``: no
   patch; verl's models use ``verl.models.builder.RMSNorm`` in the local spec
   (``local_layer_spec``), which accepts sequence parallel and tags its weight
   ``sequence_parallel=True`` so ``finalize_model_grads`` all-reduces its grads over TP.
6. ``torch.cuda.current_stream()`` returns a dummy stream (megatron-core 0.19 calls it in
   the DDP grad-sync path; 0.16 does not).
7. (start-up time, not correctness) ``megatron.core.jit.jit_fuser`` is ``torch.compile``, applied
   at import to every fused helper: each decoration imports dynamo and inductor (seconds),
   while verl's CPU runs call none of them (its models turn the fusions off). The shim makes
   ``jit_fuser`` compile on the first call instead, which ``torch.compile`` does anyway.
8. The float16/bfloat16 optimizers (``Float16OptimizerWithFloat16Params``, the distributed
   optimizer) sort parameters into fp32 master copies by ``param.type()`` strings, which name
   only CUDA types (``torch.cuda.BFloat16Tensor``), and refuse any other. ``Tensor.type()`` with
   no argument answers a CPU tensor's CUDA name when called from a ``megatron.*`` frame (as
   ``Tensor.cuda`` below), so bf16 training with fp32 master weights runs on CPU as on GPU.
9. ``torch.cuda.Stream()`` returns the dummy stream of fix 6 and ``torch.cuda.stream(s)`` is an
   empty context: Megatron's MoE all-to-all token dispatcher (``MoEAlltoAllTokenDispatcher``)
   makes a side stream for its device-to-host copies of the routing counts, and synchronises on
   the event that stream records (a dummy that is always complete).

10. ``maybe_move_tensor_to_cpu(t, as_numpy=True)`` (MoE utilities) converts only CUDA tensors to
    numpy; the all-to-all token dispatcher passes its result to ``all_to_all_single`` as split
    sizes, which refuses a tensor. On CPU a tensor asked for as numpy becomes numpy (the swap is
    made in the ``megatron.core.transformer.moe.*`` modules that hold the name).

11. Factories asked for ``pin_memory=True`` (context parallelism's rotary slice,
    ``get_pos_emb_on_this_cp_rank``, pins a two-element index before ``.cuda()``) get ordinary
    memory: CPU torch has no pinned-memory allocator and raises.

Scope. vLLM runs in the same process later, so fixes 1, 3 (factories), 4 and 6 are visible
to Megatron's modules only: every ``megatron.*`` module's global ``torch`` (and any global
bound to ``torch.cuda``) is replaced by a proxy module whose ``cuda`` namespace and tensor
factories carry the fixes; everything else is the real torch object. Modules imported after
the shim is applied get the same treatment through an import hook. ``Tensor.cuda`` is a
method, so it is patched on ``torch.Tensor`` (as is ``Tensor.type``, fix 8) but redirects only
when called from a ``megatron.*`` frame; everyone else gets the original (which raises without CUDA anyway).
The RNG fix swaps names inside ``megatron.core.tensor_parallel.random`` only.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import logging
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_applied = False
_CPU = torch.device("cpu")
_REAL_TENSOR_CUDA = torch.Tensor.cuda
_REAL_TENSOR_TYPE = torch.Tensor.type

# Tensor factories that take an explicit ``device=`` Megatron hard-codes to "cuda" (fix 3).
_FACTORIES = (
    "empty",
    "zeros",
    "ones",
    "full",
    "tensor",
    "as_tensor",
    "arange",
    "rand",
    "randn",
    "randint",
    "randperm",
    "eye",
)


def _is_megatron_module(name: str) -> bool:
    return name == "megatron" or name.startswith("megatron.")


def _cpu_if_cuda(device: Any) -> Any:
    """Map any CUDA device spec ("cuda", "cuda:1", torch.device("cuda", 0), an int ordinal) to CPU."""
    if device is None:
        return None
    if isinstance(device, int):  # a bare int is a CUDA ordinal in torch's device arguments
        return _CPU
    if isinstance(device, str):
        return _CPU if device.startswith("cuda") else device
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


def _redirecting_factory(fn):
    def factory(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        if kwargs.get("pin_memory"):  # fix 11: no pinned-memory allocator without an accelerator
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)

    factory.__name__ = fn.__name__
    factory.__qualname__ = getattr(fn, "__qualname__", fn.__name__)
    factory.__doc__ = fn.__doc__
    factory.__wrapped__ = fn
    return factory


class _DummyEvent:
    """What the dummy stream records (fix 9): CPU work is done when recorded."""

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        del stream

    def query(self) -> bool:
        return True


_DUMMY_EVENT = _DummyEvent()


class _DummyStream:
    """Stands in for ``torch.cuda.Stream`` (fix 6): CPU work is ordered, so every wait is a no-op."""

    device = _CPU

    def wait_stream(self, stream: Any) -> None:
        del stream

    def wait_event(self, event: Any) -> None:
        del event

    def record_event(self, event: Any = None) -> Any:
        return _DUMMY_EVENT if event is None else event

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


_DUMMY_STREAM = _DummyStream()


def _current_device() -> torch.device:
    # Fix 1: GlobalMemoryBuffer / mappings / param_and_grad_buffer place tensors on this device.
    return _CPU


def _synchronize(device: Any = None) -> None:
    # Fix 4: p2p_communication._batched_p2p_ops calls torch.cuda.synchronize() after batch_isend_irecv.
    del device


def _current_stream(device: Any = None) -> _DummyStream:
    # Fix 6 (megatron-core 0.19): the DDP grad-sync path asks for the current stream.
    del device
    return _DUMMY_STREAM


def _new_stream(*args: Any, **kwargs: Any) -> _DummyStream:
    # Fix 9: the MoE all-to-all token dispatcher makes a side stream for device-to-host copies.
    del args, kwargs
    return _DUMMY_STREAM


@contextlib.contextmanager
def _stream_context(stream: Any = None) -> Iterator[None]:
    # Fix 9: ``with torch.cuda.stream(side_stream)`` around those copies runs in order on CPU.
    del stream
    yield


def _make_proxy(name: str, real: types.ModuleType, overrides: dict[str, Any]) -> types.ModuleType:
    """A module that is ``real`` except for ``overrides``; names ``real`` gains later are forwarded."""
    proxy = types.ModuleType(name, real.__doc__)
    proxy.__dict__.update({k: v for k, v in real.__dict__.items() if not k.startswith("__")})
    proxy.__dict__.update(overrides)

    def __getattr__(attr: str) -> Any:  # PEP 562: attributes torch adds after the snapshot
        return getattr(real, attr)

    proxy.__getattr__ = __getattr__  # type: ignore[attr-defined]
    proxy.__verl_cpu_shim_proxy__ = True  # type: ignore[attr-defined]
    return proxy


def _build_proxies() -> tuple[types.ModuleType, types.ModuleType]:
    cuda_proxy = _make_proxy(
        "torch.cuda",
        torch.cuda,
        {
            "current_device": _current_device,
            "synchronize": _synchronize,
            "current_stream": _current_stream,
            "Stream": _new_stream,
            "stream": _stream_context,
        },
    )
    torch_overrides: dict[str, Any] = {"cuda": cuda_proxy}
    for fname in _FACTORIES:
        torch_overrides[fname] = _redirecting_factory(getattr(torch, fname))
    torch_proxy = _make_proxy("torch", torch, torch_overrides)
    return torch_proxy, cuda_proxy


_TORCH_PROXY, _CUDA_PROXY = _build_proxies()


def megatron_torch() -> types.ModuleType:
    """The ``torch`` that Megatron's modules see once the shim is applied (for tests and debugging)."""
    return _TORCH_PROXY


# ---------------------------------------------------------------------------------------------
# Fix 2: the RNG states tracker.
# ---------------------------------------------------------------------------------------------


def _make_cpu_rng_tracker_class(base: type) -> type:
    """Subclass Megatron's ``CudaRNGStatesTracker`` so isinstance checks in Megatron still hold."""

    class CpuRNGStatesTracker(base):  # type: ignore[misc, valid-type]
        """Named RNG streams kept as ``torch.get_rng_state()`` snapshots of the CPU generator.

        ``add(name, seed)`` seeds a fresh stream without disturbing the current one;
        ``fork(name)`` runs a block on that stream and puts the caller's stream back.
        """

        def __init__(self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False):
            if use_cudagraphable_rng:
                raise ValueError(
                    "use_cudagraphable_rng=True needs CUDA graphs; on CPU leave it False "
                    "(model_parallel_cuda_manual_seed(use_cudagraphable_rng=False))"
                )
            super().__init__(use_cudagraphable_rng=False, is_inference_rng_tracker=is_inference_rng_tracker)

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise ValueError(f"RNG tracker: seed {seed} is already used by another stream")
            if name in self.states_:
                raise ValueError(f"RNG tracker: stream {name!r} already exists")
            self.seeds_.add(seed)
            saved = torch.get_rng_state()
            try:
                torch.manual_seed(seed)
                self.states_[name] = torch.get_rng_state()
            finally:
                torch.set_rng_state(saved)

        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
            if name not in self.states_:
                raise ValueError(f"RNG tracker: stream {name!r} was never added (call add() first)")
            saved = torch.get_rng_state()
            outer_name = self._current_state_name
            if outer_name != "default-rng":
                self.states_[outer_name] = saved
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                restored = self.states_[outer_name] if outer_name != "default-rng" else saved
                torch.set_rng_state(restored)
                self._current_state_name = outer_name

    return CpuRNGStatesTracker


def _get_rng_state_cpu(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    # Activation recompute (CheckpointFunction) saves the "cuda" RNG state; on CPU that is the CPU one.
    del device, graph_safe
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _set_rng_state_cpu(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    del device, graph_safe
    torch.set_rng_state(new_state)


def _patch_rng_module(random_mod: types.ModuleType) -> None:
    if getattr(random_mod, "__verl_cpu_shim_rng__", False):
        return
    original = random_mod.CudaRNGStatesTracker
    tracker_cls = _make_cpu_rng_tracker_class(original)
    # initialize_rng_tracker() instantiates the module-global name, so model_parallel_cuda_manual_seed
    # builds our tracker without being changed.
    random_mod.CudaRNGStatesTracker = tracker_cls
    random_mod._get_cuda_rng_state = _get_rng_state_cpu
    random_mod._set_cuda_rng_state = _set_rng_state_cpu
    current = getattr(random_mod, "_CUDA_RNG_STATE_TRACKER", None)
    if current is not None and not isinstance(current, tracker_cls):
        random_mod._CUDA_RNG_STATE_TRACKER = None
        random_mod._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    random_mod.__verl_cpu_shim_rng__ = True


# ---------------------------------------------------------------------------------------------
# Module redirection and the import hook.
# ---------------------------------------------------------------------------------------------


def _compile_on_first_call(fn: Any = None, **options: Any) -> Any:
    """Fix 7: ``torch.compile(fn, **options)`` made at ``fn``'s first call, not at decoration."""
    if fn is None:  # used as @jit_fuser(...)
        return functools.partial(_compile_on_first_call, **options)
    compiled = None

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if compiled is None:
            compiled = torch.compile(fn, **options)
        return compiled(*args, **kwargs)

    return call


def _redirect_module(module: types.ModuleType) -> None:
    """Point a Megatron module's ``torch`` / ``torch.cuda`` globals at the proxies."""
    if module.__name__ == "megatron.core.jit" and module.__dict__.get("jit_fuser") is torch.compile:
        module.jit_fuser = _compile_on_first_call
    namespace = module.__dict__
    for key, value in list(namespace.items()):
        if value is torch:
            namespace[key] = _TORCH_PROXY
        elif value is torch.cuda:
            namespace[key] = _CUDA_PROXY
    if module.__name__ == "megatron.core.tensor_parallel.random":
        _patch_rng_module(module)
    move = namespace.get("maybe_move_tensor_to_cpu")
    if module.__name__.startswith("megatron.core.transformer.moe.") and callable(move):
        if not getattr(move, "__verl_cpu_shim__", False):
            namespace["maybe_move_tensor_to_cpu"] = _numpy_splits_on_cpu(move)


def _numpy_splits_on_cpu(move: Any) -> Any:
    """Fix 10: Megatron's ``maybe_move_tensor_to_cpu(t, as_numpy=True)`` converts only CUDA tensors; the
    all-to-all token dispatcher then passes the CPU tensor as split sizes, which gloo's
    ``all_to_all_single`` refuses. A CPU tensor asked for as numpy becomes numpy, as on GPU."""

    @functools.wraps(move)
    def wrapper(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    wrapper.__verl_cpu_shim__ = True  # type: ignore[attr-defined]
    return wrapper


class _RedirectingLoader(importlib.abc.Loader):
    """Wraps a Megatron module's loader: run the module, then redirect its globals."""

    def __init__(self, inner: importlib.abc.Loader):
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._inner.exec_module(module)
        _redirect_module(module)

    def __getattr__(self, attr: str) -> Any:  # get_source, get_filename, resource readers...
        return getattr(self._inner, attr)


class _MegatronImportHook(importlib.abc.MetaPathFinder):
    """Gives every ``megatron.*`` module imported after the shim the same redirection."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not _is_megatron_module(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _RedirectingLoader(spec.loader)
        return spec


_IMPORT_HOOK = _MegatronImportHook()


def _tensor_cuda(self: torch.Tensor, device: Any = None, non_blocking: bool = False, **kwargs: Any):
    # Fix 3: tensor_parallel.broadcast_data and the fp16 optimizer call tensor.cuda(); redirect only
    # Megatron's calls so the rest of the process keeps torch's own behaviour.
    caller = sys._getframe(1).f_globals.get("__name__", "")
    if _is_megatron_module(caller):
        return self
    return _REAL_TENSOR_CUDA(self, device, non_blocking, **kwargs)


def _tensor_type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any):
    # Fix 8: the fp16/bf16 optimizers accept parameters by their CUDA type names.
    if dtype is None and not kwargs:
        name = _REAL_TENSOR_TYPE(self)
        if self.device.type == "cpu" and name.startswith("torch.") and not name.startswith("torch.cuda."):
            if _is_megatron_module(sys._getframe(1).f_globals.get("__name__", "")):
                return "torch.cuda." + name[len("torch."):]
        return name
    return _REAL_TENSOR_TYPE(self, dtype, non_blocking, **kwargs)


def shim_needed() -> bool:
    """True when Megatron-core must run on CPU (no usable CUDA device)."""
    return not torch.cuda.is_available()


def shim_applied() -> bool:
    """Whether ``apply_cpu_shim`` has taken effect in this process."""
    return _applied


def apply_cpu_shim() -> None:
    """Make Megatron-core run on CPU; idempotent, and a no-op when CUDA is available."""
    global _applied
    if not shim_needed():
        return
    with _lock:
        if _applied:
            return
        if _IMPORT_HOOK not in sys.meta_path:
            sys.meta_path.insert(0, _IMPORT_HOOK)
        for name, module in list(sys.modules.items()):
            if module is not None and _is_megatron_module(name):
                _redirect_module(module)
        torch.Tensor.cuda = _tensor_cuda  # type: ignore[method-assign]
        torch.Tensor.type = _tensor_type  # type: ignore[method-assign]
        _applied = True
    logger.debug("Megatron-core CPU shim applied")
