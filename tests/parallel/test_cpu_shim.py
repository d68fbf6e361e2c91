"""Each fix of the Megatron-core CPU shim, and that it stays inside Megatron's modules.

The bodies run in a 1-rank worker (through run_distributed) so the shim never lands in the
pytest process itself; the GPU no-op test runs in-process because it changes nothing.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from verl.parallel import cpu_shim
from verl.testing.distributed import run_distributed

needs_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is a no-op with CUDA")


def _cuda_call_raises(call) -> bool:
    try:
        call()
    except (AssertionError, RuntimeError):  # "Torch not compiled with CUDA enabled"
        return True
    return False


def _current_device_fix() -> tuple[str, str, bool]:
    cpu_shim.apply_cpu_shim()
    from megatron.core import parallel_state
    from megatron.core.utils import GlobalMemoryBuffer

    buffer = GlobalMemoryBuffer().get_tensor((3, 4), torch.float32, "shim-test")
    via_megatron = parallel_state.torch.cuda.current_device()
    return str(buffer.device), str(via_megatron), _cuda_call_raises(torch.cuda.current_device)


def _rng_tracker_fix() -> dict[str, bool]:
    cpu_shim.apply_cpu_shim()
    from megatron.core.tensor_parallel import random as mrandom

    seed = 77
    mrandom.model_parallel_cuda_manual_seed(seed, tp_rank=1, ep_rank=0, etp_rank=0)
    tracker = mrandom.get_cuda_rng_tracker()

    torch.manual_seed(5)
    expected_outside = torch.randn(4)  # [4] the default stream, undisturbed
    torch.manual_seed(5)
    with tracker.fork():
        first_draw = torch.randn(4)
    after_fork = torch.randn(4)
    with tracker.fork():
        second_draw = torch.randn(4)

    torch.manual_seed(seed + 2718 + 1)  # Megatron's TP stream seed: seed + 2718 + tp_rank
    expected_first = torch.randn(4)
    expected_second = torch.randn(4)
    return {
        "tracker_is_cpu": type(tracker).__name__ == "CpuRNGStatesTracker",
        "fork_uses_tp_seed": torch.equal(first_draw, expected_first),
        "fork_continues_its_stream": torch.equal(second_draw, expected_second),
        "outside_stream_restored": torch.equal(after_fork, expected_outside),
    }


def _cuda_placements_fix() -> dict[str, object]:
    cpu_shim.apply_cpu_shim()
    from megatron.core.transformer.utils import get_default_causal_mask

    from verl.parallel import megatron_state

    mask = get_default_causal_mask(4)  # torch.ones(..., device="cuda") inside Megatron
    megatron_state.initialize_model_parallel()
    from megatron.core.tensor_parallel import broadcast_data

    # broadcast_data calls torch.tensor(..., device="cuda") and tensor.cuda().
    data = {"ids": torch.arange(6, dtype=torch.int64).reshape(2, 3)}
    out = broadcast_data(["ids"], data, torch.int64)
    return {
        "mask_device": str(mask.device),
        "mask_ok": torch.equal(mask, torch.ones(4, 4).triu(1).bool()),
        "broadcast_ok": torch.equal(out["ids"], data["ids"]),
        "broadcast_device": str(out["ids"].device),
        "outside_factory_raises": _cuda_call_raises(lambda: torch.zeros(1, device="cuda")),
        "outside_tensor_cuda_raises": _cuda_call_raises(lambda: torch.zeros(1).cuda()),
    }


def _synchronize_and_stream_fix() -> tuple[object, bool, bool]:
    cpu_shim.apply_cpu_shim()
    from megatron.core.pipeline_parallel import p2p_communication

    synced = p2p_communication.torch.cuda.synchronize()
    stream = cpu_shim.megatron_torch().cuda.current_stream()
    stream.wait_stream(stream)
    stream.synchronize()
    return synced, _cuda_call_raises(torch.cuda.synchronize), _cuda_call_raises(torch.cuda.current_stream)


def _import_hook_covers_late_modules() -> tuple[bool, bool, bool]:
    cpu_shim.apply_cpu_shim()
    name = "megatron.core.energy_monitor"  # a leaf module nothing else holds on to
    sys.modules.pop(name, None)
    module = importlib.import_module(name)
    return module.torch is cpu_shim.megatron_torch(), module.torch.cuda is not torch.cuda, torch.cuda.is_available()


def _idempotent() -> tuple[bool, int]:
    cpu_shim.apply_cpu_shim()
    cpu_shim.apply_cpu_shim()
    hooks = sum(1 for finder in sys.meta_path if type(finder).__name__ == "_MegatronImportHook")
    return cpu_shim.shim_applied(), hooks


def _norm_fix() -> dict[str, object]:
    cpu_shim.apply_cpu_shim()
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from verl.models.builder import RMSNorm, local_layer_spec

    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=2, use_cpu_initialization=True,
        tensor_model_parallel_size=2, sequence_parallel=True, normalization="RMSNorm",
    )
    try:
        WrappedTorchNorm(config, 64)
        megatron_refuses = False
    except AssertionError:
        megatron_refuses = True
    norm = RMSNorm(config, 64, eps=1e-6)
    block = local_layer_spec(config, vp_stage=None, pp_rank=0)
    layer = block.layer_specs[0].submodules
    return {
        "megatron_refuses": megatron_refuses,
        "norm_type": type(norm).__name__,
        "tagged": all(getattr(p, "sequence_parallel", False) for p in norm.parameters()),
        "config_untouched": config.sequence_parallel,
        "num_layer_specs": len(block.layer_specs),
        "final_norm": block.layer_norm is RMSNorm,
        "input_norm": layer.input_layernorm is RMSNorm,
        "pre_mlp_norm": layer.pre_mlp_layernorm is RMSNorm,
    }


@needs_cpu_only
@pytest.mark.distributed
def test_fix1_current_device_is_cpu_inside_megatron_only() -> None:
    buffer_device, megatron_device, outside_raises = run_distributed(_current_device_fix, 1)[0]
    assert buffer_device == "cpu" and megatron_device == "cpu"
    assert outside_raises, "torch.cuda.current_device must keep raising outside Megatron"


@needs_cpu_only
@pytest.mark.distributed
def test_fix2_rng_tracker_forks_cpu_streams() -> None:
    assert run_distributed(_rng_tracker_fix, 1)[0] == {
        "tracker_is_cpu": True,
        "fork_uses_tp_seed": True,
        "fork_continues_its_stream": True,
        "outside_stream_restored": True,
    }


@needs_cpu_only
@pytest.mark.distributed
def test_fix3_hard_coded_cuda_placements_go_to_cpu_inside_megatron_only() -> None:
    actual = run_distributed(_cuda_placements_fix, 1)[0]
    assert actual == {
        "mask_device": "cpu",
        "mask_ok": True,
        "broadcast_ok": True,
        "broadcast_device": "cpu",
        "outside_factory_raises": True,
        "outside_tensor_cuda_raises": True,
    }


@needs_cpu_only
@pytest.mark.distributed
def test_fix4_and_fix6_synchronize_and_stream_inside_megatron_only() -> None:
    synced, outside_sync_raises, outside_stream_raises = run_distributed(_synchronize_and_stream_fix, 1)[0]
    assert synced is None
    assert outside_sync_raises and outside_stream_raises


@needs_cpu_only
@pytest.mark.distributed
def test_fix5_sequence_parallel_torch_norm() -> None:
    assert run_distributed(_norm_fix, 1)[0] == {
        "megatron_refuses": True,
        "norm_type": "RMSNorm",
        "tagged": True,
        "config_untouched": True,
        "num_layer_specs": 2,
        "final_norm": True,
        "input_norm": True,
        "pre_mlp_norm": True,
    }


@needs_cpu_only
@pytest.mark.distributed
def test_modules_imported_after_the_shim_are_redirected() -> None:
    assert run_distributed(_import_hook_covers_late_modules, 1)[0] == (True, True, False)


@needs_cpu_only
@pytest.mark.distributed
def test_apply_is_idempotent() -> None:
    assert run_distributed(_idempotent, 1)[0] == (True, 1)


def test_noop_when_cuda_is_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    meta_path_before = list(sys.meta_path)
    tensor_cuda_before = torch.Tensor.cuda
    cpu_shim.apply_cpu_shim()
    assert sys.meta_path == meta_path_before
    assert torch.Tensor.cuda is tensor_cuda_before
    assert not cpu_shim.shim_needed()


_JIT_FUSER_CHECK = """
import sys, torch
from verl.parallel import cpu_shim
cpu_shim.apply_cpu_shim()
from megatron.core.fusions.fused_bias_gelu import bias_gelu  # decorated with jit_fuser at import
decorated_without_dynamo = "torch._dynamo" not in sys.modules
compiled = []
def record(fn, **options):  # stands in for torch.compile, which would build a C++ kernel here
    compiled.append(fn.__name__)
    return fn
torch.compile = record
bias, y = torch.tensor([0.5, -1.0]), torch.tensor([1.0, 2.0])
x = bias + y
expected = x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))
first, second = bias_gelu(bias, y), bias_gelu(bias, y)
print(decorated_without_dynamo, compiled, torch.equal(first, expected) and torch.equal(second, expected))
"""


@needs_cpu_only
def test_fix7_jit_fuser_compiles_at_the_first_call_not_at_import() -> None:
    """Megatron decorates its fused helpers with torch.compile at import, which imports dynamo and
    inductor (seconds of start-up); under the shim the compile happens at the first call, once."""
    import os
    import subprocess

    import verl

    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(verl.__file__))}
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", _JIT_FUSER_CHECK],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[-2] == "True ['bias_gelu'] True"


def _pinned_index_fix() -> dict[str, object]:
    cpu_shim.apply_cpu_shim()
    from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank

    from verl.parallel import megatron_state

    pg = megatron_state.initialize_model_parallel(context_parallel_size=2)
    emb = torch.arange(8.0).view(8, 1, 1, 1)  # the rotary table of 8 positions
    mine = get_pos_emb_on_this_cp_rank(emb, 0, pg.cp)  # torch.tensor(..., pin_memory=True).cuda() inside
    return {"positions": mine.flatten().tolist(), "outside_raises": _raises(lambda: torch.tensor([1], pin_memory=True))}


def _raises(fn) -> bool:
    try:
        fn()
    except RuntimeError:
        return True
    return False


@needs_cpu_only
@pytest.mark.distributed
def test_fix11_pinned_memory_inside_megatron_is_ordinary_memory() -> None:
    """Context parallelism's rotary slice pins its index: CP rank i keeps chunks i and 3 - i of 4."""
    results = run_distributed(_pinned_index_fix, 2)
    assert [r["positions"] for r in results] == [[0.0, 1.0, 6.0, 7.0], [2.0, 3.0, 4.0, 5.0]]
    assert all(r["outside_raises"] for r in results)
