"""The step's model FLOPs against hand counts (dense, Mixture-of-Experts, LoRA), the MFU arithmetic, the
GPU peak table and the CPU matmul rate's cache (verl.trainer.perf).

Each hand count writes every term out: a linear of ``in x out`` is ``2 * in * out`` FLOPs per token;
attention's two matmuls cost ``2 * 2 * heads * head_dim`` per (token, key) pair, a causal sequence of
``L`` tokens scoring ``L (L + 1) / 2`` pairs; the head ``2 * hidden * vocab`` per row it runs on.
All counts are integers held in floats well below 2**53: compared exactly.
"""

from __future__ import annotations

import json

import pytest
import torch

from verl.models.hf_config import parse_hf_config
from verl.models.lora import LoRASpec
from verl.protocol import Batch
from verl.trainer import perf
from verl.trainer.perf import (
    DevicePeak,
    ModelShape,
    StepFlops,
    batch_lengths,
    cpu_matmul_peak,
    generation_terms,
    gpu_peak,
    training_flops,
    training_terms,
)

# The tiny default's shape: hidden 64, 2 layers, 2 query heads of 32, 1 key/value head, SwiGLU 256, vocab 1024.
DENSE = dict(model_type="qwen2", vocab_size=1024, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-6, rope_theta=10000.0,
             max_position_embeddings=256, tie_word_embeddings=True)
# Qwen2-MoE: 8 experts of 32, top-2, a shared expert of 48 with its sigmoid gate; 4 heads of 16, 2 kv heads.
MOE = dict(model_type="qwen2_moe", vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0,
           max_position_embeddings=256, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
           moe_intermediate_size=32, shared_expert_intermediate_size=48)

# Two sequences: prompts of 3 and 5 real tokens, responses of 4 and 2.
PROMPTS, RESPONSES = [3, 5], [4, 2]
LENGTHS = [7, 7]
TOKENS = 14
CAUSAL_PAIRS = 7 * 8 // 2 + 7 * 8 // 2  # sum over sequences of L (L + 1) / 2


def _shape(raw: dict, lora: LoRASpec | None = None) -> ModelShape:
    return ModelShape.from_spec(parse_hf_config(dict(raw), source="test"), lora)


def _dense_per_token() -> int:
    q, k, v, o = 2 * 64 * 64, 2 * 64 * 32, 2 * 64 * 32, 2 * 64 * 64
    gate, up, down = 2 * 64 * 256, 2 * 64 * 256, 2 * 256 * 64
    return 2 * (q + k + v + o + gate + up + down)  # 2 layers


def test_dense_hand_count():
    shape = _shape(DENSE)
    linear = TOKENS * _dense_per_token()
    attention = 2 * 2 * 2 * 2 * 32 * CAUSAL_PAIRS  # 2 matmuls x 2 FLOPs x 2 layers x 2 heads x head_dim 32
    head = 2 * 64 * 1024 * TOKENS  # every real token's row (tied embeddings cost the same matmul)
    terms = training_terms(shape, LENGTHS)
    assert (terms.linear, terms.attention, terms.head, terms.adapters) == (linear, attention, head, 0)
    assert training_flops(shape, terms) == 3 * (linear + attention + head)  # forward + 2 x forward backward
    # Generation: prefill + decode over prompt + response - 1 tokens (6 and 6), the head on the 4 + 2 responses.
    gen = generation_terms(shape, PROMPTS, RESPONSES)
    assert gen.linear == 12 * _dense_per_token()
    assert gen.attention == 2 * 2 * 2 * 2 * 32 * (6 * 7 // 2 + 6 * 7 // 2)
    assert gen.head == 2 * 64 * 1024 * 6


def test_moe_hand_count_routes_each_token_through_its_top_k_and_the_shared_expert():
    shape = _shape(MOE)
    q, k, v, o = 2 * 64 * 64, 2 * 64 * 32, 2 * 64 * 32, 2 * 64 * 64
    router = 2 * 64 * 8
    routed = 2 * (2 * 64 * 32 + 2 * 64 * 32 + 2 * 32 * 64)  # top-2 of 8: gate, up, down of width 32
    shared = 2 * 64 * 48 + 2 * 64 * 48 + 2 * 48 * 64 + 2 * 64 * 1  # gate, up, down of 48 and its 1-column gate
    per_token = 2 * (q + k + v + o + router + routed + shared)
    terms = training_terms(shape, LENGTHS)
    assert terms.linear == TOKENS * per_token
    assert terms.attention == 2 * 2 * 2 * 4 * 16 * CAUSAL_PAIRS  # 4 heads of 16
    assert terms.head == 2 * 64 * 1000 * TOKENS
    assert training_flops(shape, terms) == 3 * (terms.linear + terms.attention + terms.head)
    # The same MoE with every expert active would count 4x the routed experts: top-k is what is computed.
    dense_equivalent = 2 * 4 * (2 * 64 * 32 + 2 * 64 * 32 + 2 * 32 * 64)
    assert terms.linear < TOKENS * (per_token + dense_equivalent)


def test_lora_hand_count_skips_the_frozen_weights_gradients():
    lora = LoRASpec(rank=4, alpha=8, target_modules=("q_proj", "v_proj"))
    shape = _shape(DENSE, lora)
    terms = training_terms(shape, LENGTHS)
    adapters = TOKENS * 2 * (2 * 4 * (64 + 64) + 2 * 4 * (64 + 32))  # 2 layers x (q: A 64->4, B 4->64; v: 64->4->32)
    assert terms.adapters == adapters
    linear, attention, head = TOKENS * _dense_per_token(), 2 * 2 * 2 * 2 * 32 * CAUSAL_PAIRS, 2 * 64 * 1024 * TOKENS
    first_qkv = TOKENS * (2 * 64 * 64 + 2 * 64 * 32 + 2 * 64 * 32)  # layer 0 reads the frozen embeddings
    expected = (
        (linear + head) * 2  # frozen: forward + the input's gradient, no weight gradient
        - first_qkv  # ... and no input gradient where the input is the frozen embeddings
        + 3 * attention  # no weights: forward and the gradients of Q, K and V
        + 3 * adapters  # trained: forward + input and weight gradients
    )
    assert training_flops(shape, terms) == expected
    # The forward passes: the old log-probs with the adapters, the reference without, generation merged.
    counter = StepFlops.__new__(StepFlops)
    counter.actor, counter.policy, counter.actor_epochs, counter.critic = shape, _shape(DENSE), 2, None
    flops = counter.phase_flops(PROMPTS, RESPONSES)
    assert flops["old_log_prob"] == linear + attention + head + adapters
    assert flops["ref"] == linear + attention + head
    assert flops["update_actor"] == 2 * expected  # ppo_epochs=2
    assert flops["gen"] == generation_terms(_shape(DENSE), PROMPTS, RESPONSES).forward


def test_a_sliding_window_caps_the_keys_each_token_scores():
    shape = ModelShape(hidden=8, layers=1, heads=1, kv_heads=1, head_dim=8, intermediate=8, vocab=8, window=3)
    assert shape.attention_keys(2) == 1 + 2
    assert shape.attention_keys(6) == 1 + 2 + 3 + 3 + 3 + 3


def test_mfu_is_flops_over_seconds_devices_and_the_phase_dtypes_peak():
    counter = StepFlops.__new__(StepFlops)
    counter.actor = counter.policy = _shape(DENSE)
    counter.actor_epochs, counter.critic, counter.streaming = 1, None, False
    counter.dtypes = {"gen": "fp32", "old_log_prob": "bf16", "ref": "bf16", "update_actor": "bf16"}
    flops = counter.phase_flops(PROMPTS, RESPONSES)
    peak = DevicePeak("test", {"bf16": 2.0, "fp32": 0.5}, "test")  # TFLOP/s
    seconds = {"gen": 1e-6, "update_actor": 2e-6, "reward": 1.0, "step": 1e-5}
    m = counter.metrics(PROMPTS, RESPONSES, seconds, peak, devices=2)
    assert set(m) == {f"perf/{k}/{p}" for k in ("tflops", "mfu") for p in ("gen", "update_actor", "step")}
    # Float division: within a few ulps of the same arithmetic written out.
    assert m["perf/tflops/gen"] == pytest.approx(flops["gen"] / 1e-6 / 2 / 1e12, rel=1e-12)
    assert m["perf/mfu/gen"] == pytest.approx(flops["gen"] / 1e-6 / 2 / 0.5e12, rel=1e-12)
    assert m["perf/mfu/update_actor"] == pytest.approx(flops["update_actor"] / 2e-6 / 2 / 2e12, rel=1e-12)
    total = flops["gen"] + flops["update_actor"]
    assert m["perf/tflops/step"] == pytest.approx(total / 1e-5 / 2 / 1e12, rel=1e-12)
    at_peak = flops["gen"] / 2 / 0.5e12 + flops["update_actor"] / 2 / 2e12  # seconds at peak
    assert m["perf/mfu/step"] == pytest.approx(at_peak / 1e-5, rel=1e-12)
    # A streaming rollout (trainer.rollout_mode=one_step_off/async) generated the batch beside earlier steps:
    # no gen rate, the step still counts one batch's generation.
    counter.streaming = True
    m = counter.metrics(PROMPTS, RESPONSES, {"update_actor": 2e-6, "step": 1e-5}, peak, devices=2)
    assert "perf/mfu/gen" not in m and m["perf/mfu/step"] == pytest.approx(at_peak / 1e-5, rel=1e-12)
    counter.streaming = False
    # No peak for the device: the rates stay, the utilisation goes.
    assert set(counter.metrics(PROMPTS, RESPONSES, seconds, None, devices=2)) == {
        "perf/tflops/gen", "perf/tflops/update_actor", "perf/tflops/step"}


def test_batch_lengths_reads_real_prompt_and_response_tokens():
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0, 0, 0]])  # width 10, responses 5
    batch = Batch.from_dict({"attention_mask": mask, "responses": torch.zeros(2, 5, dtype=torch.long)})
    assert batch_lengths(batch) == ([4, 5], [3, 2])
    assert batch_lengths(Batch.from_dict({"attention_mask": mask})) is None


@pytest.mark.parametrize("name, label, bf16, fp32", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.0, 67.0),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756.0, 51.0),
    ("NVIDIA H100 NVL", "H100 NVL", 835.0, 60.0),
    ("NVIDIA H200", "H200 SXM", 989.0, 67.0),
    ("NVIDIA A100-SXM4-80GB", "A100", 312.0, 19.5),
    ("NVIDIA L40S", "L40S", 362.0, 91.6),
    ("NVIDIA L4", "L4", 121.0, 30.3),
    ("NVIDIA B200", "B200", 2250.0, 75.0),
])
def test_gpu_peaks_by_name(name, label, bf16, fp32):
    peak = gpu_peak(name)
    assert peak.source.startswith(label) and peak.of("bfloat16") == bf16 and peak.of("fp32") == fp32
    assert gpu_peak(name, tf32=True).of("fp32") > fp32  # float32 matmuls on the tensor cores


def test_an_unknown_gpu_has_no_peak():
    assert gpu_peak("Some Future Accelerator") is None


def test_the_cpu_rate_is_measured_once_reused_and_measured_again_from_a_corrupt_file(tmp_path, monkeypatch):
    monkeypatch.setattr(perf, "MATMUL_SHAPE", (64, 64, 64))  # the measurement's logic, not a real rate
    calls = []
    real = perf._measure
    monkeypatch.setattr(perf, "_measure", lambda *a: calls.append(a[0]) or real(*a))
    path = str(tmp_path / "cache" / "cpu_matmul_peak.json")
    first = cpu_matmul_peak(threads=1, path=path)
    assert first["measured"] and calls == [torch.bfloat16, torch.float32]
    assert first["bf16_gflops"] > 0 and first["fp32_gflops"] > 0 and first["threads"] == 1
    again = cpu_matmul_peak(threads=1, path=path)
    assert not again["measured"] and len(calls) == 2 and again["bf16_gflops"] == first["bf16_gflops"]
    # Another thread count is another entry of the same file.
    assert cpu_matmul_peak(threads=2, path=path)["measured"] and len(calls) == 4
    with open(path, encoding="utf-8") as f:
        assert len(json.load(f)) == 2
    with open(path, "w", encoding="utf-8") as f:
        f.write('{"half written')
    fresh = cpu_matmul_peak(threads=1, path=path)
    assert fresh["measured"] and len(calls) == 6
    with open(path, encoding="utf-8") as f:
        json.load(f)  # rewritten whole
    # An entry that is not a measurement (a zero rate) is measured again too.
    with open(path, "w", encoding="utf-8") as f:
        json.dump({f"{perf.cpu_model()} | 1 threads": {"bf16_gflops": 0, "fp32_gflops": 1.0}}, f)
    assert cpu_matmul_peak(threads=1, path=path)["measured"] and len(calls) == 8


def test_the_cpu_peak_says_how_it_was_measured_and_warns_when_the_machine_was_busy(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(perf, "MATMUL_SHAPE", (64, 64, 64))
    monkeypatch.setenv("VERL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(perf.os, "getloadavg", lambda: (99.0, 99.0, 99.0))
    with caplog.at_level("WARNING", logger="verl.trainer.perf"):
        peak = perf.device_peak("cpu")
    assert peak.of("bfloat16") > 0 and peak.of("fp32") > 0 and peak.of("fp16") is None
    assert "best of 5 [64x64]x[64x64] matmuls" in peak.source and "load average 99.0" in peak.source
    assert str(tmp_path / "cpu_matmul_peak.json") in peak.source
    assert any("measured while the machine was busy" in r.message for r in caplog.records)


def test_a_ppo_config_counts_the_critics_phases_in_their_dtypes(tmp_path):
    from verl.config import PPOConfig, load_config

    (tmp_path / "config.json").write_text(json.dumps(DENSE))
    cfg = load_config(PPOConfig, config_file="ppo_tiny_cpu", overrides=[
        f"actor_rollout_ref.model.path={tmp_path}", "actor_rollout_ref.model.lora_rank=4",
        "actor_rollout_ref.actor.megatron.dtype=bfloat16", "actor_rollout_ref.ref.megatron.dtype=float32",
        "trainer.device=cpu"])
    counter = StepFlops(cfg)
    assert counter.device == "cpu" and counter.actor.lora_targets == ("q_proj", "k_proj", "v_proj", "o_proj",
                                                                      "gate_proj", "up_proj", "down_proj")
    assert counter.dtypes == {"gen": "fp32", "old_log_prob": "bf16", "ref": "fp32", "update_actor": "bf16",
                              "values": "fp32", "update_critic": "fp32"}  # rollout and critic: auto, fp32 on CPU
    flops = counter.phase_flops(PROMPTS, RESPONSES)
    value_head = 2 * 64 * 1 * TOKENS  # one column per token
    critic_forward = TOKENS * _dense_per_token() + 2 * 2 * 2 * 2 * 32 * CAUSAL_PAIRS + value_head
    assert flops["values"] == critic_forward and flops["update_critic"] == 3 * critic_forward  # no LoRA on the critic
    assert flops["update_actor"] == training_flops(counter.actor, training_terms(counter.actor, LENGTHS))


def test_a_cache_folder_that_cannot_be_made_measures_in_the_process_only(tmp_path, monkeypatch):
    monkeypatch.setattr(perf, "MATMUL_SHAPE", (64, 64, 64))
    monkeypatch.setattr(perf, "_UNCACHED", {})
    (tmp_path / "file").write_text("")
    path = str(tmp_path / "file" / "cpu_matmul_peak.json")  # below a file: no folder can be made there
    first = cpu_matmul_peak(threads=1, path=path)
    assert first["measured"] and first["bf16_gflops"] > 0
    assert cpu_matmul_peak(threads=1, path=path)["bf16_gflops"] == first["bf16_gflops"]  # once per process
