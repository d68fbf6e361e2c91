"""vLLM in-process under a 2-rank torch.distributed world (external_launcher).

TP'=2: one engine over both ranks (same prompts, same samples on both). TP'=1: two data-parallel
replicas, one per rank, each with its own prompts. Each case runs in ONE call on the persistent
2-rank pool (engine start-up dominates): build, sample, update and restore the weights,
release/resume, shutdown. Each rank returns what it saw; the checks run here. The model is a
tiny untied Llama.
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


def _engine_body(model_dir: str, input_ids: torch.Tensor, attention_mask: torch.Tensor, tp: int) -> dict:
    import torch.distributed as dist
    from safetensors.torch import load_file

    from verl.config.schema import RolloutConfig
    from verl.protocol import Batch
    from verl.rollout import build_rollout_engine

    cfg = RolloutConfig(
        name="vllm", n=N, temperature=TEMPERATURE, prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN,
        tensor_model_parallel_size=tp,
    )
    if tp == 1:  # data-parallel replicas: each rank samples its own half of the prompts
        input_ids, attention_mask = input_ids[dist.get_rank() :: 2], attention_mask[dist.get_rank() :: 2]
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
        params = dict(engine.named_parameters())  # this rank's shards, vLLM layout
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


def _prompts(tok):
    return tok(["one two", "three four five six", "x", "seven eight nine"], padding="max_length", truncation=True,
               max_length=PROMPT_LEN, padding_side="left", return_tensors="pt")


def _check_logprobs(hf, out: dict) -> None:
    from verl.rollout.checks import logprob_agreement
    from verl.rollout.hf_engine import hf_response_logprobs

    expected = hf_response_logprobs(
        hf, out["input_ids"], out["attention_mask"], out["position_ids"],
        response_length=RESPONSE_LEN, temperature=TEMPERATURE,
    )
    agreement = logprob_agreement(out["rollout_log_probs"], expected, out["response_mask"])
    assert agreement["logprob_max_abs_diff"] < LOGPROB_ATOL, agreement


@pytest.mark.parametrize("tp", [2, 1], ids=["tp2", "tp1-dp2"])
def test_vllm_in_process_on_two_ranks(tiny_models, one_thread, tp):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = tiny_models["llama"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    enc = _prompts(tok)
    ranks = run_distributed(_engine_body, 2, model_dir, enc["input_ids"], enc["attention_mask"], tp, timeout=360.0)
    rank0, rank1 = ranks
    if tp == 2:
        # Both ranks of the TP'=2 engine return the same samples.
        assert torch.equal(rank0["responses"], rank1["responses"])
        assert torch.equal(rank0["rollout_log_probs"], rank1["rollout_log_probs"])
        assert rank0["qkv_shape"] == (96, 64)  # q: 1 of 2 heads; k, v: the one kv head, replicated
        assert rank0["vocab_shard_rows"] * 2 >= len(tok)
    else:
        # Two replicas, each its own prompts (rows 0, 2 and 1, 3) and full weights.
        assert torch.equal(rank0["input_ids"][:, :PROMPT_LEN], enc["input_ids"][0::2].repeat_interleave(N, 0))
        assert torch.equal(rank1["input_ids"][:, :PROMPT_LEN], enc["input_ids"][1::2].repeat_interleave(N, 0))
        assert rank0["qkv_shape"] == (128, 64)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for r in ranks:
        assert r["changed"] and r["restored"] and r["same_after_resume"]
        assert r["world_alive"]
        assert r["shm_left"] == [] and r["sockets_left"] == []
        _check_logprobs(hf, r)
