"""Partial rollout (``verl.trainer.step.partial``) on the transformers and the vLLM (CPU build)
engines behind the ``Rollout`` role: a batch generated in segments, with the weights changed between segments as an actor
update would change them.

- each response token records the version that sampled it: a sample spanning two updates has
  version-0 tokens, then version-1, then version-2, at the segment boundaries;
- each segment's log-probs are those of the weights that sampled it (recomputed by an independent
  transformers copy of each version), and not those of the other versions;
- one segment as long as the response is the ordinary engine call (partial rollout off: unchanged);
- the samples are reproducible from the seed; a batch saved in flight and loaded continues to
  the very samples and per-token versions of the uninterrupted one;
- a sample that stops (eos) ends its segments.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from verl.config.schema import RolloutConfig, ValKwargsConfig
from verl.protocol import Batch
from verl.rollout.hf_engine import hf_response_logprobs
from verl.trainer.step.partial import PartialBatch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT_LEN, RESPONSE_LEN, N, SEGMENT = 10, 12, 2, 5  # segments of 5, 5 and 2 tokens
TEMPERATURE = 0.9
# float32 both sides; the engine's generate (KV cache; vLLM's own kernels) and one transformers
# forward differ in reduction order only: ~1e-6 here (test_engines.py measured ~5e-7 for vLLM). The versions' log-probs differ by >= 1e-2 (the weights are moved by 5%).
LOGPROB_ATOL = 1e-4
_TEXTS = ["hello world", "the cat sat", "1 2 3 4", "question: what is 7 + 5?"]


def _cfg(ignore_eos: bool = True, name: str = "hf") -> RolloutConfig:
    return RolloutConfig(
        name=name, n=N, temperature=TEMPERATURE, prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN,
        seed=7, val_kwargs=ValKwargsConfig(n=1), ignore_eos=ignore_eos,
    )


@pytest.fixture(scope="module")
def model_dir(tiny_models) -> str:
    return tiny_models["qwen2"]


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> Batch:
    enc = tokenizer(_TEXTS, padding="max_length", truncation=True, max_length=PROMPT_LEN, padding_side="left", return_tensors="pt")
    return Batch.from_dict(
        {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]},
        {"uid": np.array([f"uid-{i}" for i in range(len(_TEXTS))], dtype=object)},
    )


def _rollout(model_dir, tokenizer, cfg: RolloutConfig):
    from verl.roles.rollout import Rollout

    rollout = Rollout(cfg, model_dir, tokenizer, dp_group=None)
    rollout.attach_apart()  # weights written by the test, as the actor's push would
    return rollout


@pytest.fixture(scope="module")
def versions(model_dir) -> list[dict[str, torch.Tensor]]:
    """Three policy versions: the checkpoint, then each moved by 5% noise (as updates move it)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    states = [{k: v.clone() for k, v in model.state_dict().items()}]
    for _ in range(2):
        with torch.no_grad():  # through the parameters: the tied embedding / LM head stay one tensor
            for p in model.parameters():
                p.add_(0.05 * p.abs().mean() * torch.randn(p.shape, generator=gen))
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return states


def _load(rollout, state: dict[str, torch.Tensor]) -> None:
    rollout.engine.update_weights(state.items())


def _run(rollout, prompts, versions, *, seed=11, stop_ids=frozenset(), save_after=None, folder=None):
    """Segments under versions 0, 1, then finished under 2; with ``save_after=k`` the batch is saved
    to ``folder`` after segment k and the rest runs on the loaded copy."""
    batch = PartialBatch(prompts, n=N, response_length=RESPONSE_LEN, segment_tokens=SEGMENT, stop_ids=stop_ids,
                         seed=seed, pad_token_id=rollout.engine.pad_token_id)
    with rollout.phase():
        for v in range(3):
            _load(rollout, versions[v])
            if save_after is not None and batch.segments == save_after:
                batch.save(str(folder))
                batch = PartialBatch.load(str(folder))
            if v < 2:
                batch.advance(rollout.generate_segment, v)
            else:
                batch.finish(rollout.generate_segment, v)
    return batch.assemble()


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_tokens_carry_the_versions_that_sampled_them(engine, model_dir, tokenizer, prompts, versions, tmp_path, one_thread):
    from transformers import AutoModelForCausalLM

    rollout = _rollout(model_dir, tokenizer, _cfg(name=engine))
    out, metrics = _run(rollout, prompts, versions)
    rows = len(prompts) * N
    # ignore_eos: every sample runs to the limit, across both updates, at the segment boundaries
    expected = torch.tensor([0] * SEGMENT + [1] * SEGMENT + [2] * (RESPONSE_LEN - 2 * SEGMENT)).expand(rows, -1)
    assert torch.equal(out["rollout_token_versions"], expected)
    assert out["rollout_version"].tolist() == [0] * rows  # the version that began it
    assert metrics["async/partial_segments"] == 3.0 and metrics["async/partial_spanning"] == 1.0
    assert int(out["response_mask"].sum()) == rows * RESPONSE_LEN
    # each segment's log-probs from the weights that sampled it, not from the others'
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    position_ids = (out["attention_mask"].cumsum(1) - 1).clamp(min=0)
    for v, state in enumerate(versions):
        model.load_state_dict(state)
        recomputed = hf_response_logprobs(model, out["input_ids"], out["attention_mask"], position_ids,
                                          response_length=RESPONSE_LEN, temperature=TEMPERATURE)
        mine = out["rollout_token_versions"] == v
        others = ~mine & (out["response_mask"] > 0)
        expected_lp, actual_lp = recomputed[mine], out["rollout_log_probs"][mine]
        assert torch.allclose(actual_lp, expected_lp, atol=LOGPROB_ATOL), (v, (actual_lp - expected_lp).abs().max())
        assert (out["rollout_log_probs"][others] - recomputed[others]).abs().max() > 1e-2, v
    # reproducible from the seed and the weights of each segment; another seed samples otherwise
    again, _ = _run(rollout, prompts, versions)
    assert torch.equal(again["responses"], out["responses"])
    assert torch.equal(again["rollout_log_probs"], out["rollout_log_probs"])
    other, _ = _run(rollout, prompts, versions, seed=12)
    assert not torch.equal(other["responses"], out["responses"])
    # saved in flight after the first segment and loaded: the same samples and per-token versions
    resumed, _ = _run(rollout, prompts, versions, save_after=1, folder=tmp_path / "inflight")
    for key in ("responses", "rollout_log_probs", "rollout_token_versions", "rollout_version", "input_ids"):
        assert torch.equal(resumed[key], out[key]), key
    assert list(resumed.non_tensors["uid"]) == list(out.non_tensors["uid"])
    rollout.shutdown()


def test_one_segment_is_the_ordinary_call_and_stops_end_samples(model_dir, tokenizer, prompts, versions, one_thread):
    rollout = _rollout(model_dir, tokenizer, _cfg(ignore_eos=False))
    _load(rollout, versions[0])
    with rollout.phase():
        whole = rollout.generate(prompts, seed=5)
        one = PartialBatch(prompts, n=N, response_length=RESPONSE_LEN, segment_tokens=RESPONSE_LEN, stop_ids=set(),
                           seed=5, pad_token_id=rollout.engine.pad_token_id)
        one.advance(rollout.generate_segment, 0)
        assert one.finished  # a single segment as long as the response ends every sample
        out, _ = one.assemble()
    for key in whole.keys():
        expected, actual = whole[key], out[key]
        assert (torch.equal(actual, expected) if torch.is_tensor(expected) else list(actual) == list(expected)), key
    assert out["rollout_token_versions"][out["response_mask"] > 0].eq(0).all()
    # a stop token ends a sample in the segment that sampled it: take the token the first sample
    # drew second as the "stop" token, so that sample ends after 2 tokens and is never resumed
    stop = int(whole["responses"][0, 1])
    rollout.shutdown()
    rollout = _rollout(model_dir, tokenizer, dataclasses.replace(_cfg(ignore_eos=False), stop_token_ids=[stop]))
    _load(rollout, versions[0])
    cut = PartialBatch(prompts, n=N, response_length=RESPONSE_LEN, segment_tokens=SEGMENT, stop_ids={stop},
                       seed=5, pad_token_id=rollout.engine.pad_token_id)
    with rollout.phase():
        cut.advance(rollout.generate_segment, 0)
        assert cut.done[0] and cut.tokens[0][-1] == stop and len(cut.tokens[0]) <= 2
        running = [i for i, d in enumerate(cut.done) if not d]
        _load(rollout, versions[1])
        cut.finish(rollout.generate_segment, 1)
    assert cut.versions[0] == [0] * len(cut.tokens[0])  # ended in its first segment: never resumed
    assert running and all(cut.versions[i][SEGMENT] == 1 for i in running)  # the others went on under version 1
    rollout.shutdown()
