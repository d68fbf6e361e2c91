"""Top-k / top-p replay in the log-prob helpers (``verl.models.vocab_parallel``): the mask is the samplers'
(transformers' warpers, vLLM's ``apply_top_k_top_p``) bit for bit, the truncated log-probabilities, entropy
and gradients are those of the masked softmax, tensor parallel 2 gives the single rank's, and the
transformers engine's reported log-probabilities are what the helper computes from the same model's logits."""

from __future__ import annotations

import pytest
import torch

from verl.models.vocab_parallel import SamplingTruncation, truncation_mask, vocab_parallel_logprobs_entropy
from verl.testing.distributed import run_distributed

VOCAB, PADDED = 301, 304  # the vocabulary padded to split over 2 ranks (rank 1 holds 3 padding columns)
SETTINGS = [(20, 0.9), (0, 0.9), (20, 1.0), (5, 0.5), (1, 0.9)]


def _logits(seed: int = 0) -> torch.Tensor:
    """[40, VOCAB] float32 temperature-scaled logits; half the rows rounded to 0.5 so that ties sit on
    the top-k and top-p boundaries."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(40, VOCAB, generator=gen) * 2.5
    z[::2] = (z[::2] * 2).round() / 2
    return z


def _hf_kept(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    out = z.clone()
    if top_k > 0:
        out = TopKLogitsWarper(top_k)(None, out)
    if top_p < 1.0:
        out = TopPLogitsWarper(top_p)(None, out)
    return torch.isfinite(out)


@pytest.mark.parametrize(("top_k", "top_p"), SETTINGS)
def test_mask_is_the_transformers_samplers_mask(top_k, top_p):
    z = _logits()
    mine = truncation_mask(z, SamplingTruncation(top_k=top_k, top_p=top_p))
    assert torch.equal(mine, _hf_kept(z, top_k, top_p))  # the same operations: bit for bit, ties included
    assert mine.gather(-1, z.argmax(-1, keepdim=True)).all()  # the most probable token is always kept
    if top_k > 0:
        assert (mine.sum(-1) >= 1).all() and (mine.sum(-1) < VOCAB).all()


@pytest.mark.slow  # importing vLLM's sampler loads vLLM (tens of seconds here)
def test_mask_is_the_vllm_samplers_mask():
    """vLLM's ``apply_top_k_top_p`` sorts the logits once, before its top-k, where transformers sorts the
    top-k survivors: among logits tied at the top-p boundary the two may keep different members of the
    tie. Without ties the kept sets are equal; with them the kept counts and the normaliser (so every
    kept token's log-probability) are, which is what the replay needs."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    z = _logits()
    untied = torch.arange(len(z)) % 2 == 1  # _logits rounds the even rows
    for top_k, top_p in SETTINGS:
        mine = truncation_mask(z, SamplingTruncation(top_k=top_k, top_p=top_p))
        k = torch.full((len(z),), top_k, dtype=torch.long) if top_k > 0 else None
        p = torch.full((len(z),), top_p) if top_p < 1.0 else None
        theirs = torch.isfinite(apply_top_k_top_p_pytorch(z.clone(), k, p, allow_cpu_sync=True))
        assert torch.equal(mine[untied], theirs[untied]), (top_k, top_p)
        assert torch.equal(mine.sum(-1), theirs.sum(-1)), (top_k, top_p)
        # float32 logsumexp over the same values in another order: rounding only
        torch.testing.assert_close(z.masked_fill(~mine, float("-inf")).logsumexp(-1),
                                   z.masked_fill(~theirs, float("-inf")).logsumexp(-1), rtol=0, atol=1e-6)


def _reference(z: torch.Tensor, target: torch.Tensor, keep: torch.Tensor):
    """log p(target) and entropy of the softmax over ``keep`` (plus each target), float64."""
    keep = keep.clone()
    keep[torch.arange(len(target)), target] = True
    logp = torch.log_softmax(z.double().masked_fill(~keep, float("-inf")), dim=-1)
    entropy = -(logp.exp() * logp.masked_fill(~keep, 0.0)).sum(-1)
    return logp.gather(-1, target.unsqueeze(-1)).squeeze(-1), entropy


def _inputs():
    z = _logits(1)
    truncation = SamplingTruncation(top_k=20, top_p=0.9)
    keep = truncation_mask(z, truncation)
    gen = torch.Generator().manual_seed(2)
    target = torch.multinomial(keep.float(), 1, generator=gen).squeeze(-1)  # a kept token per row
    target[:3] = torch.randint(0, VOCAB, (3,), generator=gen)  # three that the mask may drop: kept anyway
    weights = torch.randn(len(z), generator=gen), torch.randn(len(z), generator=gen)
    return z, target, truncation, keep, weights


def test_truncated_logprobs_entropy_and_gradients_are_the_masked_softmax():
    z, target, truncation, keep, (w_lp, w_ent) = _inputs()
    expected_z = z.double().requires_grad_()
    exp_lp, exp_ent = _reference(expected_z, target, keep)
    (exp_lp * w_lp + exp_ent * w_ent).sum().backward()

    padded = torch.cat([z, torch.full((len(z), PADDED - VOCAB), 50.0)], dim=-1).requires_grad_()
    lp, ent = vocab_parallel_logprobs_entropy(padded, target, vocab_start=0, vocab_size=VOCAB, group=None,
                                              truncation=truncation)
    (lp * w_lp + ent * w_ent).sum().backward()
    # float32 against float64 over <= 301 columns: rounding only.
    torch.testing.assert_close(lp.double(), exp_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), exp_ent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded.grad[:, :VOCAB].double(), expected_z.grad, rtol=1e-5, atol=1e-6)
    dropped = ~keep
    dropped[torch.arange(len(target)), target] = False
    assert torch.count_nonzero(padded.grad[:, :VOCAB][dropped]) == 0 and torch.count_nonzero(padded.grad[:, VOCAB:]) == 0
    # the full vocabulary's log-probabilities are far from the truncated ones (what the replay fixes)
    full, _ = vocab_parallel_logprobs_entropy(z, target, vocab_start=0, vocab_size=VOCAB, group=None)
    assert (lp - full).min() > 0.1


def _tp2_body():
    import torch.distributed as dist

    rank = dist.get_rank()
    z, target, truncation, _, (w_lp, w_ent) = _inputs()
    padded = torch.cat([z, torch.zeros(len(z), PADDED - VOCAB)], dim=-1)
    local = padded.chunk(2, dim=-1)[rank].clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs_entropy(local, target, vocab_start=rank * (PADDED // 2), vocab_size=VOCAB,
                                              group=dist.group.WORLD, truncation=truncation)
    (lp * w_lp + ent * w_ent).sum().backward()
    return lp.detach(), ent.detach(), local.grad


@pytest.mark.distributed
def test_tensor_parallel_2_replays_the_full_vocabulary_mask():
    z, target, truncation, keep, (w_lp, w_ent) = _inputs()
    expected_z = z.clone().requires_grad_()
    exp_lp, exp_ent = vocab_parallel_logprobs_entropy(expected_z, target, vocab_start=0, vocab_size=VOCAB, group=None,
                                                      truncation=truncation)
    (exp_lp * w_lp + exp_ent * w_ent).sum().backward()
    expected_grad = torch.cat([expected_z.grad, torch.zeros(len(z), PADDED - VOCAB)], dim=-1).chunk(2, dim=-1)
    for rank, (lp, ent, grad) in enumerate(run_distributed(_tp2_body, 2)):
        # The same float32 math with the sums split over two ranks: rounding only (~1e-6).
        torch.testing.assert_close(lp, exp_lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, exp_ent, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, expected_grad[rank], rtol=1e-5, atol=1e-6)


# The engine's log-probabilities come from transformers' KV-cached decoding, the helper's from one forward
# of the whole sequences: float32 rounding of two kernel paths only.
ENGINE_ATOL = 1e-5


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    from verl.data.tiny_model import TinyModelSpec, make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-llama-replay")), TinyModelSpec(corpus_lines=400))


def test_transformers_engine_logprobs_are_the_replayed_ones(tiny_model_dir):
    """The engine samples at top_k=20, top_p=0.9, temperature 0.8 and reports its log-probabilities; the
    helper, given the same model's logits of the sampled sequences (one forward), returns them within
    ENGINE_ATOL with the replay, and the full vocabulary's, far from them, without it."""
    from transformers import AutoModelForCausalLM

    from verl.config.schema import RolloutConfig
    from verl.protocol import Batch
    from verl.rollout.hf_engine import HFRollout

    cfg = RolloutConfig(name="hf", prompt_length=6, response_length=8, n=4, temperature=0.8, top_k=20, top_p=0.9,
                        dtype="float32")
    engine = HFRollout(cfg, tiny_model_dir, device="cpu")
    try:
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(3, 500, (4, 6), generator=gen)
        out = engine.generate(Batch.from_dict({"input_ids": prompts, "attention_mask": torch.ones_like(prompts)}), seed=1)
    finally:
        engine.shutdown()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids, mask = out["input_ids"], out["attention_mask"]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, 5:-1] / 0.8  # [B, R, V]: predict the responses
    responses, real = out["responses"], out["response_mask"].bool()
    vocab = dict(vocab_start=0, vocab_size=logits.shape[-1], group=None)
    replayed, _ = vocab_parallel_logprobs_entropy(logits, responses, truncation=SamplingTruncation(top_k=20, top_p=0.9),
                                                  **vocab)
    full, _ = vocab_parallel_logprobs_entropy(logits, responses, **vocab)
    engine_lp = out["rollout_log_probs"]
    assert real.sum() > 8
    assert (replayed - engine_lp)[real].abs().max() < ENGINE_ATOL
    assert (full - engine_lp)[real].abs().max() > 0.1  # the mask dropped: the full vocabulary's
