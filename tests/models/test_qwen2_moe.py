"""Qwen2-MoE: routed experts plus a shared expert scaled by a sigmoid gate, against transformers.

Its logits, log-probs, exports (1 rank, EP 2, TP 2 + SP, EP 2 x TP 2 + SP) and megatron2hf round trips
(written at EP 2 and at TP 2) are in test_moe.py with the other MoE families; here: the config, the
refusals, the gate guard, the push into transformers after a step and the reshard at TP 2.

Megatron-core 0.16.1 builds the shared expert as ``SharedExpertMLP`` with ``moe_shared_expert_gate``
(``sigmoid(x @ gate_weight.T)`` times the expert's output, the formula of transformers'
``Qwen2MoeSparseMoeBlock``); the shared expert is a dense MLP split over TP, its gate replicated.

Tolerances: float32 on both sides; the router picks the same experts (logits spread so no two
experts nearly tie) and the rest is the same math in another order (matmul blocking, the shared
expert added before or after the routed ones): 2.4e-7 on logits measured at 1 rank, EP 2 and TP 2
+ SP. 1e-5 absolute catches a wrong expert or a dropped gate (zeroing the gate weights, sigmoid 0.5
everywhere, moves logits by 3.2e-2). Exports, checkpoint round trips and weight pushes only move
bytes: exact.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.models.tiny import hf_outputs, make_tiny_model, padded_batch
from verl.testing.distributed import run_distributed

ATOL = 1e-5
VOCAB = 1001


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("qwen2_moe") / "m"), "qwen2_moe", seed=11)


def _config(**changes) -> dict:
    from tests.models.test_moe import _config as moe_config

    return moe_config("qwen2_moe", **changes)


def test_config_parses_the_shared_expert_and_megatron_gates_it():
    from verl.models.builder import ModelBuildConfig, moe_config_kwargs
    from verl.models.hf_config import parse_hf_config

    spec = parse_hf_config(_config())
    assert (spec.num_experts, spec.moe_topk, spec.moe_intermediate_size) == (4, 2, 48)
    assert spec.shared_expert_intermediate_size == 80 and spec.has_shared_expert
    assert spec.qkv_bias and not spec.qk_layernorm and not spec.moe_renormalize
    assert not parse_hf_config(_config(qkv_bias=False)).qkv_bias
    kwargs = moe_config_kwargs(spec, ModelBuildConfig(), ep_size=2)
    assert kwargs["moe_shared_expert_intermediate_size"] == 80 and kwargs["moe_shared_expert_gate"] is True
    assert kwargs["moe_router_pre_softmax"] is True  # softmax over every expert, then the top 2 as they are
    # Qwen3-MoE has no shared expert: no shared-expert settings reach Megatron.
    qwen3 = parse_hf_config({**_config(), "model_type": "qwen3_moe", "shared_expert_intermediate_size": None})
    assert "moe_shared_expert_intermediate_size" not in moe_config_kwargs(qwen3, ModelBuildConfig(), ep_size=1)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size"),
        ({"mlp_only_layers": [1]}, "mlp_only_layers"),
        ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
        ({"model_type": "qwen3_moe", "moe_intermediate_size": 48}, "shared_expert_intermediate_size"),
    ],
)
def test_unsupported_configs_name_the_field(change, field):
    from verl.models.hf_config import parse_hf_config

    with pytest.raises(ValueError, match=f"field '{field}'"):
        parse_hf_config(_config(**change))


def test_a_tp_that_does_not_divide_the_shared_expert_is_refused_before_building():
    from verl.models.builder import split_problems
    from verl.models.hf_config import parse_hf_config

    spec = parse_hf_config(_config(shared_expert_intermediate_size=90, num_attention_heads=4, num_key_value_heads=4))
    assert split_problems(spec, tp_size=2, pp_size=1) == []
    problems = split_problems(spec, tp_size=4, pp_size=1)
    assert any("shared_expert_intermediate_size=90" in p for p in problems), problems


def test_weight_names_match_the_saved_checkpoint(model_dir):
    from verl.models.hf_config import parse_hf_config
    from verl.models.safetensors_io import SafetensorsReader
    from verl.models.weight_mapping import hf_param_names

    names = set(hf_param_names(parse_hf_config(model_dir)))
    assert names == set(SafetensorsReader(model_dir).names())
    assert "model.layers.1.mlp.shared_expert_gate.weight" in names


def test_the_shared_expert_gate_changes_the_output(model_dir, tmp_path):
    """Guards the test above: a model whose gate weights are zeroed (sigmoid 0.5 everywhere) gives
    logits far outside the tolerance, so a builder that dropped the gate could not pass it."""
    import shutil

    from safetensors.torch import load_file, save_file

    altered = str(tmp_path / "altered")
    shutil.copytree(model_dir, altered)
    path = os.path.join(altered, "model.safetensors")
    tensors = load_file(path)
    for name in tensors:
        if name.endswith("shared_expert_gate.weight"):
            tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, path, metadata={"format": "pt"})
    batch = padded_batch(4, 12, seed=2)
    mask = batch["attention_mask"].bool()
    diff = (hf_outputs(altered, batch)[mask] - hf_outputs(model_dir, batch)[mask]).abs().max()
    assert diff > 100 * ATOL


@pytest.mark.distributed
def test_engine_step_at_ep2_pushes_into_transformers(model_dir):
    """A training step at EP 2, then the weight push into a transformers Qwen2-MoE (its fused experts,
    the shared expert and its gate): every element written, and its logprobs equal the actor's."""
    from tests.models.test_moe import _engine_body

    batches = [padded_batch(4, 12, seed=10 + r) for r in range(2)]
    for r, batch in zip(run_distributed(_engine_body, 2, model_dir, 2, batches, 0.5, timeout=300), batches):
        assert r["untouched"] == 0 and r["fused"]
        # transformers' float32 kernels against Megatron's: rounding (the rollout tests' 1e-4).
        m = (batch["attention_mask"][:, 1:] * batch["attention_mask"][:, :-1]).float()
        torch.testing.assert_close(r["engine_lp"] * m, r["after"][:, 1:] * m, rtol=0, atol=1e-4)


@pytest.mark.distributed
def test_tp2_actor_reshards_into_rollout_shards_bit_exactly(model_dir):
    """The hybrid engine's push from a TP 2 actor (the shared expert split over TP) into Hugging Face
    shards at rollout TP' 1 and 2 (each expert and the shared expert split as vLLM splits an MLP, the
    gate whole): every destination tensor equals the checkpoint's slice, and nothing crosses ranks at
    TP' = TP."""
    from tests.hybrid.test_reshard import _reshard_body

    results = run_distributed(_reshard_body, 2, model_dir, 2, 1, None, (1, 2), 16 * 1024, timeout=300)
    for rank, per_tp in enumerate(results):
        for rollout_tp, r in per_tp.items():
            assert r["wrong"] == [], f"rank {rank} TP'={rollout_tp}: {r['wrong'][:5]}"
            assert r["received"] == r["planned_received"] and r["sent"] == r["planned_sent"]
        assert per_tp[2]["received"] == 0 and per_tp[2]["sent"] == 0


def test_the_planner_counts_the_shared_expert_over_tp_and_its_gate_whole():
    """The dry-run planner's per-GPU layer weights: the shared expert's gate/up/down split over TP plus
    its replicated [1, hidden] gate, on top of the same model without a shared expert."""
    import dataclasses

    from verl.models.hf_config import parse_hf_config
    from verl.planning.memory import _layer_params

    spec = parse_hf_config(_config())
    without = dataclasses.replace(spec, shared_expert_intermediate_size=0)
    for tp in (1, 2):
        assert _layer_params(spec, tp) - _layer_params(without, tp) == 3 * 64 * 80 // tp + 64
