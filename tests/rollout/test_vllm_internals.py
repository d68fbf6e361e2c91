"""verl.rollout.vllm_internals: the table of private vLLM uses, one guard per entry, and the public-API path.

Each entry of ``INTERNALS`` names tests that fail when vLLM's behaviour under it changes; the
unit tests here check the vLLM code it relies on directly (a call-time lookup, a tuple position,
a signature), the engine tests elsewhere check the effect (bit-identical outputs, files gone).
Two tests hold the table to the engine: every private use in ``vllm_engine.py`` goes through
this module, and every entry is one the engine uses. The last part builds an engine with the
installed vLLM's version string replaced by one outside every entry's versions: it must run on
vLLM's public API, refuse what has no public route, and say so in one log line.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import logging
import os
import tempfile
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from verl.rollout import vllm_internals as internals  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENGINE_FILE = os.path.join(REPO, "verl", "rollout", "vllm_engine.py")
# The table's own machinery, not a private use.
TABLE_API = {"INTERNALS", "Internal", "installed_version", "select", "log_turned_off"}


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


cpu_build = pytest.mark.skipif(not _on_cpu(), reason="an entry of the CPU build of vLLM")


def _engine_tree() -> ast.Module:
    with open(ENGINE_FILE) as f:
        return ast.parse(f.read())


# ---------------------------------------------------------------------------------------------
# the table


def test_table_entries_are_complete_and_each_names_existing_tests():
    names = list(internals.INTERNALS)
    api_owner: dict[str, str] = {}
    for position, (name, entry) in enumerate(internals.INTERNALS.items()):
        assert entry.name == name
        assert entry.versions and all(v.endswith(".") for v in entry.versions), name  # prefixes: "0.32."
        assert entry.touches and entry.why and entry.without and entry.tests, name
        # Required entries come first: select() decides them before the entries built on them.
        assert all(r in names[:position] for r in entry.requires), name
        for test in entry.tests:
            path, function = test.split("::")
            module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
            assert callable(getattr(module, function, None)), f"{name}: {test} does not exist"
        for api in entry.api:
            assert api not in api_owner, f"{api} belongs to {api_owner[api]} and {name}"
            assert hasattr(internals, api), f"{name}: vllm_internals.{api} does not exist"
            api_owner[api] = name
    # Everything the module exports is the table's machinery or belongs to exactly one entry.
    assert set(internals.__all__) == TABLE_API | set(api_owner)


def test_engine_reaches_vllm_internals_only_through_the_module():
    """No private vLLM name in vllm_engine.py; every entry is one the engine uses."""
    tree = _engine_tree()
    private_paths = {
        "engine_core", "model_executor", "driver_worker", "worker", "model_runner", "scheduler",
        "kv_cache_manager", "mq_broadcaster", "sampler", "destroy_process_group", "destroy_model_parallel",
        "destroy_distributed_environment", "abort_request",
    }
    used_api, named_entries = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if owner == "internals":
                used_api.add(node.attr)
                continue
            assert node.attr not in private_paths, f"vllm_engine.py touches .{node.attr} (line {node.lineno})"
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                assert owner == "self", f"vllm_engine.py reads a private .{node.attr} (line {node.lineno})"
        elif isinstance(node, ast.keyword):
            assert node.arg != "internal", f"vllm_engine.py aborts by internal ids (line {node.value.lineno})"
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vllm"):
            assert node.module in {"vllm", "vllm.inputs", "vllm.logprobs", "vllm.platforms"}, node.module
        elif (
            isinstance(node, ast.Compare)
            and isinstance(node.left, ast.Constant)
            and isinstance(node.ops[0], (ast.In, ast.NotIn))
            and ast.unparse(node.comparators[0]) == "self._internals"
        ):
            named_entries.add(node.left.value)
    assert named_entries <= set(internals.INTERNALS), named_entries - set(internals.INTERNALS)
    assert used_api <= set(internals.__all__), used_api - set(internals.__all__)
    used = named_entries | {e.name for e in internals.INTERNALS.values() if set(e.api) & used_api}
    unused = set(internals.INTERNALS) - used
    assert not unused, f"entries the engine does not use: {unused}"


def test_select_by_engine_shape_and_refusal_outside_the_versions(monkeypatch):
    usable, off = internals.select(on_cpu=True, world_size=1, owns_world=True, release_kv=True)
    assert off == {}
    assert "plain_cpu_linear" in usable and "rendezvous_file" in usable
    assert not usable & {"unique_shm_names", "ipc_socket_files", "caller_world_kept"}
    usable, _ = internals.select(on_cpu=False, world_size=2, owns_world=False, release_kv=False)
    assert usable == {"in_process_worker", "kv_cache_tensors", "abort_internal_ids", "engine_shutdown",
                      "caller_world_kept", "ipc_socket_files"}

    monkeypatch.setattr(internals, "installed_version", lambda: "0.99.0")
    usable, off = internals.select(on_cpu=True, world_size=1, owns_world=True, release_kv=False)
    assert usable == frozenset()
    assert "kv_cache_release" not in off  # free_cache_engine=false: the engine never releases
    assert off["plain_cpu_linear"].startswith("checked on 0.32.x only: weights stay packed")
    # No public route keeps the caller's world through vLLM's shutdown: refuse, naming the versions.
    refusal = r"caller_world_kept .* checked on vllm 0\.32\.x, but vllm 0\.99\.0"
    with pytest.raises(RuntimeError, match=refusal):
        internals.select(on_cpu=False, world_size=2, owns_world=False, release_kv=True)


# ---------------------------------------------------------------------------------------------
# one guard per entry: the vLLM behaviour each relies on


@cpu_build
def test_plain_cpu_linear_keeps_the_weights_vllm_would_pack():
    """vLLM's CPU linear/embedding methods look dispatch_cpu_unquantized_gemm up at call time:
    under plain_cpu_linear they keep the weight and compute with F.linear; without it vLLM packs
    the linear weight and drops it (the reason for the patch)."""
    from vllm.model_executor.layers import utils as layer_utils
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    def layer() -> torch.nn.Module:
        module = torch.nn.Module()
        module.weight = torch.nn.Parameter(torch.randn(64, 64), requires_grad=False)
        return module

    own = layer()
    UnquantizedLinearMethod().process_weights_after_loading(own)
    assert own.weight.numel() == 0 and own.cpu_linear is not torch.nn.functional.linear  # packed, dropped
    original = layer_utils.dispatch_cpu_unquantized_gemm
    x = torch.randn(3, 64)
    for method in (UnquantizedLinearMethod(), UnquantizedEmbeddingMethod()):
        plain = layer()
        weight = plain.weight
        with internals.plain_cpu_linear():
            method.process_weights_after_loading(plain)
        assert plain.weight is weight and plain.cpu_linear is torch.nn.functional.linear
        assert torch.equal(method.apply(plain, x), torch.nn.functional.linear(x, weight))
    assert layer_utils.dispatch_cpu_unquantized_gemm is original


@cpu_build
def test_plain_cpu_moe_keeps_the_expert_weights_and_packs_a_copy():
    """vLLM's CPU fused experts prepack w13/w2 in place of the layer's weights; under plain_cpu_moe the
    layer keeps its (same) plain parameters, the kernel computes with vLLM's packed copy (equal to
    the experts' math), and repack_cpu_moe renews the copy after the plain weights change."""
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    e, f, h, tokens, k = 4, 64, 64, 5, 2
    g = torch.Generator().manual_seed(0)

    def layer_and_experts() -> tuple[torch.nn.Module, CPUUnquantizedExperts]:
        layer = torch.nn.Module()
        layer.w13_weight = torch.nn.Parameter(torch.randn(e, 2 * f, h, generator=g) * 0.1, requires_grad=False)
        layer.w2_weight = torch.nn.Parameter(torch.randn(e, h, f, generator=g) * 0.1, requires_grad=False)
        experts = object.__new__(CPUUnquantizedExperts)  # only what its processing and apply read
        experts.moe_config = SimpleNamespace(intermediate_size_per_partition=f, activation=MoEActivation.SILU)
        experts.quant_config = SimpleNamespace(w1_bias=None, w2_bias=None)
        return layer, experts

    def run(experts, layer, x, ids, weights) -> torch.Tensor:
        out = torch.zeros(tokens, h)
        experts.apply(output=out, hidden_states=x, w1=layer.w13_weight, w2=layer.w2_weight, topk_weights=weights,
                      topk_ids=ids, activation=MoEActivation.SILU, global_num_experts=e, expert_map=None,
                      a1q_scale=None, a2_scale=None, workspace13=None, workspace2=None, expert_tokens_meta=None,
                      apply_router_weight_on_input=False)
        return out

    def math(layer, x, ids, weights) -> torch.Tensor:
        out = torch.zeros(tokens, h)
        for t in range(tokens):
            for j in range(k):
                w13, w2 = layer.w13_weight[ids[t, j]], layer.w2_weight[ids[t, j]]
                act = torch.nn.functional.silu(w13[:f] @ x[t]) * (w13[f:] @ x[t])
                out[t] += weights[t, j] * (w2 @ act)
        return out

    x = torch.randn(tokens, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)]).to(torch.int32)
    weights = torch.rand(tokens, k, generator=g)

    own, own_experts = layer_and_experts()
    plain = own.w13_weight.detach().clone()
    own_experts.process_weights_after_loading(own)
    assert not torch.equal(own.w13_weight, plain)  # vLLM's own: the layer's weight is now the packed one

    layer, experts = layer_and_experts()
    w13, w2 = layer.w13_weight, layer.w2_weight
    before = (w13.detach().clone(), w2.detach().clone())
    with internals.plain_cpu_moe():
        experts.process_weights_after_loading(layer)
        assert layer.w13_weight is w13 and layer.w2_weight is w2  # the same parameters, unchanged
        assert torch.equal(w13, before[0]) and torch.equal(w2, before[1])
        packed13, packed2 = experts._verl_cpu_moe_packed
        assert torch.equal(packed13, cpu_prepack_moe_weight(w13, experts.isa))
        assert torch.equal(packed2, cpu_prepack_moe_weight(w2, experts.isa))
        # fp32 kernel vs the same math in another summation order: rounding only.
        assert torch.allclose(run(experts, layer, x, ids, weights), math(layer, x, ids, weights), atol=1e-5)

        with torch.no_grad():
            w13.mul_(-1.5)  # new weights written in place: the kernel still has the old copy ...
        assert torch.allclose(run(experts, layer, x, ids, weights),
                              math(SimpleNamespace(w13_weight=before[0], w2_weight=w2), x, ids, weights), atol=1e-5)
        owner = torch.nn.Sequential(layer)
        assert internals.repack_cpu_moe(owner) == 1  # ... until it is renewed
        assert torch.allclose(run(experts, layer, x, ids, weights), math(layer, x, ids, weights), atol=1e-5)
    assert CPUUnquantizedExperts.process_weights_after_loading is not internals._plain_moe_process


@cpu_build
def test_cpu_runner_replaces_the_accelerator_hooks():
    """The CPU model runner makes torch.accelerator.synchronize/empty_cache no-ops process-wide
    when it is built; accelerator_hooks_restored puts the originals back."""
    from vllm.v1.worker import cpu_model_runner

    assert "_set_torch_accelerator_to_noop()" in inspect.getsource(cpu_model_runner.CPUModelRunner.__init__)
    originals = torch.accelerator.synchronize, torch.accelerator.empty_cache
    with internals.accelerator_hooks_restored():
        cpu_model_runner._set_torch_accelerator_to_noop()
        assert torch.accelerator.synchronize is not originals[0]
        assert torch.accelerator.empty_cache is not originals[1]
    assert (torch.accelerator.synchronize, torch.accelerator.empty_cache) == originals
    # The CPU build's shm module replaces torch.cuda.current_stream when it is imported.
    from vllm.v1.worker.cpu import shm

    assert "torch.cuda.current_stream = " in inspect.getsource(shm)


@cpu_build
def test_shm_group_names_are_made_unique_and_removed(monkeypatch, tmp_path):
    """The CPU all-reduce names its segments by the staticmethod make_group_name, looked up on the
    instance when it is built; under unique_shm_names the name carries this job and engine."""
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    assert isinstance(_CPUSHMDistributed.__dict__["make_group_name"], staticmethod)
    assert "self.make_group_name(communicator)" in inspect.getsource(_CPUSHMDistributed.__init__)
    monkeypatch.setenv("VLLM_DIST_IDENT", "//")  # what every env:// (torchrun) job gets
    monkeypatch.setenv("MASTER_PORT", "29123")
    communicator = SimpleNamespace(unique_name="tp:0", ranks=[0, 1])
    plain = _CPUSHMDistributed.make_group_name(communicator)
    created: list[str] = []
    with internals.unique_shm_names(created):
        first = _CPUSHMDistributed.make_group_name(communicator)
    with internals.unique_shm_names(created):
        second = _CPUSHMDistributed.make_group_name(communicator)
    assert _CPUSHMDistributed.make_group_name(communicator) == plain  # restored
    assert first.startswith(plain) and "verl29123-" in first and first != second
    assert created == [first, second]
    # Segments are "<name without leading slashes>_<rank>"; only this job's go.
    for name in (first.lstrip("/") + "_0", first.lstrip("/") + "_1", plain.lstrip("/") + "_0"):
        (tmp_path / name).write_bytes(b"")
    removed = internals.remove_shm_segments([first], shm_dir=str(tmp_path))
    assert sorted(removed) == [first.lstrip("/") + "_0", first.lstrip("/") + "_1"]
    assert os.listdir(tmp_path) == [plain.lstrip("/") + "_0"]


@cpu_build
def test_kv_cache_release_internals(monkeypatch):
    """free_kv_cache/allocate_kv_cache rely on the runner's profiling cleanup dropping the cache
    and its kv_cache_config, and on the worker re-allocating from one KVCacheConfig."""
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    cleanup = inspect.getsource(GPUModelRunner._cleanup_profiling_kv_cache)
    assert "self.kv_caches.clear()" in cleanup and 'delattr(self, "kv_cache_config")' in cleanup
    assert list(inspect.signature(CPUWorker.initialize_from_config).parameters) == ["self", "kv_cache_config"]
    monkeypatch.setattr(internals, "installed_version", lambda: "0.99.0")
    with pytest.raises(RuntimeError, match="free_cache_engine=false"):
        internals.check_kv_release_supported()
    with pytest.raises(RuntimeError, match="vllm 0.99.0 is installed"):
        internals.free_kv_cache(SimpleNamespace())


def test_runner_kv_caches_are_the_bound_cache_tensors():
    """kv_cache_bytes reads runner.kv_caches: vLLM binds the allocated cache tensors into that list
    (one view per layer of one buffer) and the profiling cleanup empties it; storages count once."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert "self.kv_caches: list[torch.Tensor] = []" in inspect.getsource(GPUModelRunner.__init__)
    bind = inspect.getsource(GPUModelRunner.initialize_kv_cache_tensors)
    assert "bind_kv_cache(" in bind and "self.kv_caches," in bind
    assert "self.kv_caches.clear()" in inspect.getsource(GPUModelRunner._cleanup_profiling_kv_cache)
    buffer = torch.zeros(4096, dtype=torch.int8)
    layers = [buffer[:2048].view(torch.float32).view(2, 256), buffer[2048:].view(torch.float32).view(2, 256)]
    worker = SimpleNamespace(model_runner=SimpleNamespace(kv_caches=[layers[0], (layers[1],)]))
    assert internals.kv_cache_bytes(worker) == 4096
    assert internals.kv_cache_bytes(SimpleNamespace(model_runner=SimpleNamespace(kv_caches=[]))) == 0


@cpu_build
def test_runner_bookkeeping_keeps_tokens_at_3_and_request_ids_at_5():
    """SampledLogprobCapture reads _bookkeeping_sync's result by position and wraps the runner's
    sampler.sample and _bookkeeping_sync per instance: both must be looked up on the instance."""
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    function = ast.parse(textwrap.dedent(inspect.getsource(GPUModelRunner._bookkeeping_sync))).body[0]
    returned = [n for n in ast.walk(function) if isinstance(n, ast.Return)][-1].value
    assert isinstance(returned, ast.Tuple)
    assert ast.unparse(returned.elts[3]) == "valid_sampled_token_ids"
    assert ast.unparse(returned.elts[5]) == "req_ids_output_copy"
    assert "self._bookkeeping_sync(" in inspect.getsource(GPUModelRunner)
    assert "self.sample(logits, sampling_metadata)" in inspect.getsource(Sampler.forward)


@cpu_build
def test_inverse_cdf_logprobs_are_vllms_processed_logprobs():
    """For all-random batches the wrapper's processed logprobs are exactly vLLM's own sample's
    (temperature, then the argmax-invariant processors, then top-k/top-p, then log_softmax)."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    fields = {f.name for f in dataclasses.fields(SamplingMetadata)}
    read = {"all_random", "all_greedy", "generators", "temperature", "top_k", "top_p", "logitsprocs"}
    assert read <= fields
    torch.manual_seed(0)
    rows = 6
    logits = torch.randn(rows, 50) * 3
    sampler = Sampler(logprobs_mode="processed_logprobs")
    for top_k, top_p in [(None, None), (5, None), (None, 0.7), (10, 0.9)]:
        metadata = SimpleNamespace(
            all_random=True, all_greedy=False, generators={}, temperature=torch.full((rows,), 0.7),
            top_k=None if top_k is None else torch.full((rows,), top_k, dtype=torch.int32),
            top_p=None if top_p is None else torch.full((rows,), top_p),
            logitsprocs=LogitsProcessors(), max_num_logprobs=0, logprob_token_ids=None,
        )
        assert internals.inverse_cdf_applies(metadata)
        _, expected = sampler.sample(logits.clone(), metadata)
        _, actual = internals.inverse_cdf_sample(logits.clone(), metadata)
        # Same float32 operations in the same order: bit-identical, -inf where masked.
        assert torch.equal(actual, expected), (top_k, top_p)


@cpu_build
def test_allocate_slots_is_called_as_the_fast_path_forwards_it():
    """DecodeSlotFastPath replaces allocate_slots on the manager instance and forwards the first
    six arguments by position; the state it reads must exist where it reads it."""
    from vllm.v1.core import kv_cache_coordinator as coordinators
    from vllm.v1.core import single_type_kv_cache_manager as single
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    params = list(inspect.signature(KVCacheManager.allocate_slots).parameters)
    assert params[:7] == [
        "self", "request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks",
        "num_lookahead_tokens", "num_external_computed_tokens",
    ]
    assert "self.kv_cache_manager.allocate_slots(" in inspect.getsource(Scheduler)
    assert "self.empty_kv_cache_blocks" in inspect.getsource(KVCacheManager.__init__)
    assert "self.req_to_blocks" in inspect.getsource(single.SingleTypeKVCacheManager.__init__)
    assert issubclass(single.FullAttentionManager, single.SingleTypeKVCacheManager)
    assert coordinators.KVCacheCoordinatorNoPrefixCache and coordinators.UnitaryKVCacheCoordinator
    other_layout = SimpleNamespace(coordinator=object())
    assert "coordinator" in internals.DecodeSlotFastPath.unsupported_reason(other_layout)


def test_vllm_teardown_destroys_the_default_group_unless_kept(tmp_path):
    """vLLM's destroy_distributed_environment destroys the default process group (the caller's,
    under torchrun) through torch.distributed.destroy_process_group, looked up at call time."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        internals.destroy_vllm_groups(keep_default=True)
        assert dist.is_initialized()
        with internals.caller_world_kept():
            dist.destroy_process_group()
        assert dist.is_initialized()
        internals.destroy_vllm_groups(keep_default=False)
        assert not dist.is_initialized()  # what vLLM does to the caller's world without the guard
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_writer_queue_socket_files_are_found():
    """A writer MessageQueue binds two ipc sockets whose files ZMQ leaves behind; readers bind none."""
    from vllm.distributed import parallel_state
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    assert "self.mq_broadcaster" in inspect.getsource(parallel_state.GroupCoordinator.__init__)
    os.makedirs(os.environ["VLLM_RPC_BASE_PATH"], exist_ok=True)
    queue = MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=2)
    files = internals.queue_socket_files(queue)
    try:
        assert len(files) == 2 and all(os.path.exists(f) for f in files)
        assert all(os.path.dirname(f) == os.environ["VLLM_RPC_BASE_PATH"] for f in files)
        reader = SimpleNamespace(_is_writer=False, handle=queue.handle)
        assert internals.queue_socket_files(reader) == []
        assert internals.ipc_socket_files() == []  # no vLLM group in this process now
    finally:
        queue.shutdown()
        for path in files:
            os.remove(path)


def test_in_process_client_shutdown_tears_down_distributed_state():
    """shutdown_engine calls the in-process client's shutdown, which ends in vLLM's
    cleanup_dist_env_and_memory; without it, the client's finalizer does the same."""
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.engine.core_client import InprocClient

    assert "self.engine_core.shutdown()" in inspect.getsource(InprocClient.shutdown)
    assert "weakref.finalize(self, self.engine_core.shutdown)" in inspect.getsource(InprocClient.__init__)
    assert "cleanup_dist_env_and_memory()" in inspect.getsource(EngineCore.shutdown)


def test_enqueue_returns_internal_ids_that_abort_takes():
    """vLLM's own LLM aborts what enqueue added by the ids it returns, as internal ids."""
    from vllm import LLM
    from vllm.v1.engine.llm_engine import LLMEngine

    assert "internal" in inspect.signature(LLMEngine.abort_request).parameters
    source = inspect.getsource(LLM._render_and_add_requests)
    assert "abort_request(added_request_ids, internal=True)" in source
    assert "return added_request_ids" in source


# ---------------------------------------------------------------------------------------------
# outside the checked versions: an engine on vLLM's public API (CPU build, tiny untied Llama)

PROMPT_LEN, RESPONSE_LEN, N, TEMPERATURE = 8, 8, 2, 1.0
# float32 kernels of vLLM vs transformers: rounding only (see test_engines.py for why 1e-4).
LOGPROB_ATOL = 1e-4
OUTSIDE = "0.99.0"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def public_engine(tiny_models, one_thread, tmp_path_factory):
    """(engine, log records of vllm_internals, vLLM's temp dir): built with vLLM reporting OUTSIDE."""
    from verl.config.schema import RolloutConfig
    from verl.rollout import build_rollout_engine

    if not _on_cpu():
        pytest.skip("the public-API path is exercised on the CPU build")
    records = _Records()
    log = logging.getLogger(internals.__name__)
    log.addHandler(records)
    hooks = torch.accelerator.synchronize, torch.accelerator.empty_cache
    temp = tmp_path_factory.mktemp("vllm-temp")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(internals, "installed_version", lambda: OUTSIDE)
        patch.setattr(tempfile, "tempdir", str(temp))  # where vLLM puts its file store
        cfg = RolloutConfig(
            name="vllm", n=N, temperature=TEMPERATURE, prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN,
            seed=3,
        )
        engine = build_rollout_engine(cfg, tiny_models["llama"])
        try:
            yield engine, records.records, temp
        finally:
            engine.shutdown()
            log.removeHandler(records)
            # Without accelerator_hooks the CPU runner's no-ops stay: put them back for later tests.
            torch.accelerator.synchronize, torch.accelerator.empty_cache = hooks


@pytest.fixture(scope="module")
def prompts(tiny_models):
    from transformers import AutoTokenizer

    from verl.protocol import Batch

    tok = AutoTokenizer.from_pretrained(tiny_models["llama"])
    enc = tok(["one two", "three four five six", "x", "seven eight nine"], padding="max_length",
              truncation=True, max_length=PROMPT_LEN, padding_side="left", return_tensors="pt")
    mask = enc["attention_mask"]
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    return Batch.from_dict(
        {"input_ids": enc["input_ids"], "attention_mask": mask, "position_ids": positions},
        {"uid": np.array([f"p{i}" for i in range(4)], dtype=object)},
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_outside_the_versions_the_engine_runs_on_public_api_and_says_so_once(public_engine, prompts,
                                                                             tiny_models):
    from transformers import AutoModelForCausalLM

    from verl.rollout.checks import logprob_agreement
    from verl.rollout.hf_engine import hf_response_logprobs

    engine, records, _ = public_engine
    assert engine._internals == frozenset()
    assert engine._logprob_capture is None and engine._slot_fast_path is None and engine._worker is None
    out = engine.generate(prompts, seed=5)
    again = engine.generate(prompts, seed=5)
    assert torch.equal(out["responses"], again["responses"])
    # vLLM's own sampler and logprobs=0: the trainer's recomputation agrees.
    hf = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32).eval()
    expected = hf_response_logprobs(hf, out["input_ids"], out["attention_mask"], out["position_ids"],
                                    response_length=RESPONSE_LEN, temperature=TEMPERATURE)
    agreement = logprob_agreement(out["rollout_log_probs"], expected, out["response_mask"])
    assert agreement["logprob_max_abs_diff"] < LOGPROB_ATOL, agreement

    # One line at start, naming every entry this engine (CPU, a world of 1) went without.
    lines = [r for r in records if r.getMessage().startswith(f"vLLM {OUTSIDE}: rollout engine without")]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    expected_off = {"in_process_worker", "plain_cpu_linear", "plain_cpu_moe", "accelerator_hooks", "kv_cache_release",
                    "kv_cache_tensors", "sampled_logprob_capture", "inverse_cdf_sampler", "decode_slot_fast_path",
                    "abort_internal_ids", "engine_shutdown", "rendezvous_file"}
    message = lines[0].getMessage()
    assert {name for name in internals.INTERNALS if f"{name} (" in message} == expected_off
    assert len(records) == 1  # generate() logs nothing more


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_outside_the_versions_weights_memory_and_interrupts(public_engine, prompts, tiny_models,
                                                             interrupt_generate):
    """Packed weights: reload_weights only; no KV release; an interrupted call's requests are run out."""
    from safetensors.torch import load_file

    engine, _, _ = public_engine
    with pytest.raises(RuntimeError, match="method='reload_weights'"):
        engine.named_parameters()
    with pytest.raises(RuntimeError, match="unpacked"):
        engine.update_weights(iter([]))
    before = engine.generate(prompts, validate=True)
    original = load_file(os.path.join(tiny_models["llama"], "model.safetensors"))
    gen = torch.Generator().manual_seed(3)
    perturbed = {k: v + 0.5 * v.std() * torch.randn(v.shape, generator=gen) for k, v in original.items()}
    engine.update_weights(iter(perturbed.items()), method="reload_weights")
    assert not torch.equal(engine.generate(prompts, validate=True)["responses"], before["responses"])
    engine.update_weights(iter(original.items()), method="reload_weights")
    after = engine.generate(prompts, validate=True)
    assert torch.equal(after["responses"], before["responses"])
    assert torch.equal(after["rollout_log_probs"], before["rollout_log_probs"])

    with pytest.raises(RuntimeError, match="free_cache_engine=false"):
        engine.release()
    assert not engine.released
    # kv_cache_bytes from vLLM's public configs: the bytes of the cache tensors.
    assert engine.kv_cache_bytes() == internals.kv_cache_bytes(internals.in_process_worker(engine._llm)) > 0
    # kv_token_budget (what RolloutOperator(dynamic_batch_size=True) sizes calls by): the cache's
    # tokens; times the K and V bytes per token of every layer (float32 on CPU), the cache's bytes.
    with open(os.path.join(tiny_models["llama"], "config.json"), encoding="utf-8") as f:
        c = json.load(f)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    per_token = 2 * c["num_hidden_layers"] * c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim * 4
    assert engine.kv_token_budget() * per_token == engine.kv_cache_bytes()

    llm = engine._llm
    interrupt_generate(engine, prompts)  # raises KeyboardInterrupt after one engine step
    assert llm.llm_engine.has_unfinished_requests()  # not aborted: vLLM's internal ids are off limits
    assert len(engine.generate(prompts)) == len(prompts) * N  # run out and dropped first
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_in_process_worker_is_the_driver_worker(public_engine, prompts):
    """The worker reached through vLLM's object graph is the one collective_rpc runs on, and
    its runner's model is the one apply_model hands out; aborting by enqueue's ids empties the engine."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine, _, _ = public_engine
    llm = engine._llm
    [wrapper] = llm.collective_rpc(_itself)
    assert internals.in_process_worker(llm) is wrapper.worker
    [model] = llm.apply_model(_itself)
    assert internals.model_runner(llm).model is model
    requests = [TokensPrompt(prompt_token_ids=[5, 6, 7])] * 3
    ids = llm.enqueue(requests, SamplingParams(max_tokens=4), use_tqdm=False)
    assert llm.llm_engine.has_unfinished_requests()
    internals.abort_requests(llm, ids)
    assert not llm.llm_engine.has_unfinished_requests()


def _itself(obj):
    return obj


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_outside_the_versions_shutdown_is_left_to_vllms_finalizer(public_engine):
    """Runs last in this module: the dropped engine is collected and vLLM's finalizer shuts it down."""
    import torch.distributed as dist

    engine, _, temp = public_engine
    assert dist.is_initialized()  # vLLM's own world of 1
    stores = [f for f in os.listdir(temp) if f.startswith("vllm_dist_")]
    assert len(stores) == 1
    engine.shutdown()
    assert not dist.is_initialized()
    assert not os.path.exists(temp / stores[0])  # torch's FileStore removed it with the world
    engine.shutdown()  # idempotent
