"""vLLM in-process under a 2-rank torch.distributed world: TP'=2 (one engine over both ranks).

Everything runs in ONE call on the persistent 2-rank pool (engine start-up dominates): build,
sample, in-place update and restore, release/resume, shutdown. Each rank returns what it saw;
the checks run here. The model is a tiny untied Llama.
"""

from __future__ import annotations

import os

import pytest
import torch

from verl.testing.distributed import run_distributed

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(400)]

PROMPT_LEN, RESPONSE_LEN, N, TEMPERATURE = 8, 8, 2, 1.0
# float32 kernels of vLLM (TP=2: row/column-split GEMMs + all-reduce) vs transformers: rounding
# only, measured < 1e-5; see test_engines.py for why 1e-4.
LOGPROB_ATOL = 1e-4


def _tp2_body(model_dir: str, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict:
    import torch.distributed as dist
    from safetensors.torch import load_file

    from verl.config.schema import RolloutConfig
    from verl.protocol import Batch
    from verl.rollout import build_rollout_engine

    cfg = RolloutConfig(
        name="vllm", n=N, temperature=TEMPERATURE, prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN,
        tensor_model_parallel_size=2,
    )
    prompts = Batch.from_dict({"input_ids": input_ids, "attention_mask": attention_mask})
    rpc_dir = os.environ["VLLM_RPC_BASE_PATH"]
    rpc_before = set(os.listdir(rpc_dir)) if os.path.isdir(rpc_dir) else set()
    engine = build_rollout_engine(cfg, model_dir)
    result: dict = {}
    try:
        out = engine.generate(prompts, seed=5)
        result["responses"] = out["responses"]
        result["rollout_log_probs"] = out["rollout_log_probs"]
        result["input_ids"] = out["input_ids"]
        result["attention_mask"] = out["attention_mask"]
        result["position_ids"] = out["position_ids"]
        result["response_mask"] = out["response_mask"]
        params = dict(engine.named_parameters())
        # This rank's shards: 2 q heads + 1 kv head (k and v) of 32 split over 2 ranks... the
        # single kv head is replicated, so rows = 32 (q) + 32 (k) + 32 (v).
        result["qkv_shape"] = tuple(params["model.layers.0.self_attn.qkv_proj.weight"].shape)
        result["vocab_shard_rows"] = params["model.embed_tokens.weight"].shape[0]

        greedy = engine.generate(prompts, validate=True)["responses"]
        original = load_file(os.path.join(model_dir, "model.safetensors"))
        gen = torch.Generator().manual_seed(3)
        perturbed = {k: v + 0.5 * v.std() * torch.randn(v.shape, generator=gen) for k, v in original.items()}
        engine.update_weights(iter(perturbed.items()))
        result["changed"] = not torch.equal(engine.generate(prompts, validate=True)["responses"], greedy)
        engine.update_weights(iter(original.items()))
        result["restored"] = torch.equal(engine.generate(prompts, validate=True)["responses"], greedy)

        engine.release()
        engine.resume()
        again = engine.generate(prompts, seed=5)
        result["same_after_resume"] = torch.equal(again["rollout_log_probs"], out["rollout_log_probs"])
    finally:
        engine.shutdown()
    # The caller's world survives the engine; vLLM's shared-memory segments of this job are gone.
    result["world_alive"] = dist.is_initialized() and dist.get_world_size() == 2
    dist.barrier()  # every rank has shut down before anyone looks for leftovers
    port = os.environ["MASTER_PORT"]
    result["shm_left"] = [f for f in os.listdir("/dev/shm") if f"verl{port}-" in f]
    result["sockets_left"] = sorted(set(os.listdir(rpc_dir)) - rpc_before)
    return result


def test_vllm_tp2_in_process(tiny_models, one_thread):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl.rollout.checks import logprob_agreement
    from verl.rollout.hf_engine import hf_response_logprobs

    model_dir = tiny_models["llama"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    enc = tok(["one two", "three four five six", "x"], padding="max_length", truncation=True,
              max_length=PROMPT_LEN, padding_side="left", return_tensors="pt")
    rank0, rank1 = run_distributed(_tp2_body, 2, model_dir, enc["input_ids"], enc["attention_mask"], timeout=360.0)

    # Both ranks of the TP'=2 engine return the same samples.
    assert torch.equal(rank0["responses"], rank1["responses"])
    assert torch.equal(rank0["rollout_log_probs"], rank1["rollout_log_probs"])
    assert rank0["qkv_shape"] == (96, 64)  # q: 1 of 2 heads, k and v: the one kv head (replicated)
    assert rank0["vocab_shard_rows"] * 2 >= len(tok)
    assert rank0["changed"] and rank0["restored"] and rank0["same_after_resume"]
    assert rank0["world_alive"] and rank1["world_alive"]
    assert rank0["shm_left"] == [] and rank1["shm_left"] == []
    assert rank0["sockets_left"] == [] and rank1["sockets_left"] == []

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = hf_response_logprobs(
        hf, rank0["input_ids"], rank0["attention_mask"], rank0["position_ids"],
        response_length=RESPONSE_LEN, temperature=TEMPERATURE,
    )
    agreement = logprob_agreement(rank0["rollout_log_probs"], expected, rank0["response_mask"])
    assert agreement["logprob_max_abs_diff"] < LOGPROB_ATOL, agreement
