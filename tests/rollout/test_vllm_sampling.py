"""verl.rollout.vllm_internals.inverse_cdf_sample: the CPU engine's draw, checked against its definition.

The engine replaces only the final random draw of vLLM's CPU sampler (one noise value per
vocabulary entry) with an inverse-CDF draw (one uniform per row). It must sample exactly the
distribution vLLM defines, ``softmax(top_k_top_p(logits / temperature))``, and return the same
processed logprobs. The metadata objects here carry only the fields the function reads.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from verl.rollout.vllm_internals import inverse_cdf_applies, inverse_cdf_sample  # noqa: E402


def _metadata(rows: int, *, temperature: float = 1.0, top_k=None, top_p=None, processors=(), **over):
    fields = dict(
        all_random=True,
        all_greedy=False,
        generators={},
        temperature=None if temperature is None else torch.full((rows,), temperature),
        top_k=None if top_k is None else torch.full((rows,), top_k, dtype=torch.int32),
        top_p=None if top_p is None else torch.full((rows,), top_p),
        logitsprocs=SimpleNamespace(argmax_invariant=list(processors)),
    )
    fields.update(over)
    return SimpleNamespace(**fields)


def _draw_counts(logits: torch.Tensor, draws: int, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of each token over ``draws`` rows that all carry ``logits`` [V]; and the logprobs."""
    batch = logits.unsqueeze(0).expand(draws, -1).clone()
    sampled, logprobs = inverse_cdf_sample(batch, _metadata(draws, **kw))
    assert sampled.shape == (draws,) and sampled.dtype == torch.int64
    return torch.bincount(sampled, minlength=logits.numel()).double(), logprobs


def _chi_square_ok(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """Pearson chi-square over the tokens with expected count >= 5, at the 1e-4 level."""
    expected = probs.double() * counts.sum()
    keep = expected >= 5
    assert float(counts[~keep].sum()) <= max(10.0, 0.01 * float(counts.sum()))
    chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    # Survival function of chi2(dof): the regularised upper incomplete gamma Q(dof/2, chi2/2).
    half = torch.tensor(dof / 2, dtype=torch.float64)
    p_value = float(torch.special.gammaincc(half, torch.tensor(chi2 / 2, dtype=torch.float64)))
    assert p_value > 1e-4, f"chi2 {chi2:.1f} over {int(keep.sum())} bins, p={p_value:.2e}"


def test_draws_follow_the_softmax_of_the_tempered_logits():
    torch.manual_seed(0)
    logits = torch.randn(50) * 2
    for temperature in (1.0, 0.7):
        counts, logprobs = _draw_counts(logits, 200_000, temperature=temperature)
        probs = torch.softmax(logits / temperature, dim=-1)
        _chi_square_ok(counts, probs)
        # The processed logprobs vLLM would return: log_softmax(logits / T), every row.
        expected = torch.log_softmax(logits / temperature, -1)
        torch.testing.assert_close(logprobs[0], expected, rtol=0, atol=1e-6)


def test_top_k_and_top_p_masked_tokens_are_never_drawn():
    torch.manual_seed(1)
    logits = torch.randn(40)
    order = logits.argsort(descending=True)
    counts, logprobs = _draw_counts(logits, 100_000, top_k=5)
    allowed = torch.zeros(40, dtype=torch.bool)
    allowed[order[:5]] = True
    assert float(counts[~allowed].sum()) == 0
    assert torch.isinf(logprobs[0][~allowed]).all() and torch.isfinite(logprobs[0][allowed]).all()
    _chi_square_ok(counts[allowed], torch.softmax(logits[allowed], -1))
    # top-p: the smallest set of top tokens whose mass reaches p keeps all its members.
    probs = torch.softmax(logits, -1)
    counts, _ = _draw_counts(logits, 100_000, top_p=0.5)
    mass = probs[order].cumsum(0)
    kept = order[: int((mass < 0.5).sum()) + 1]
    drawn = set(torch.nonzero(counts).view(-1).tolist())
    assert drawn == set(kept.tolist())


def test_zero_probability_tokens_at_the_edges_are_never_drawn():
    """-inf logits first and last in the vocabulary: the u in (0, total] bounds cover both ends."""
    logits = torch.tensor([float("-inf"), 0.0, float("-inf"), 1.0, float("-inf")])
    counts, _ = _draw_counts(logits, 50_000)
    assert counts[0] == counts[2] == counts[4] == 0
    _chi_square_ok(counts[[1, 3]], torch.softmax(logits[[1, 3]], -1))
    # A one-hot row always gives its token.
    one_hot = torch.full((7,), float("-inf"))
    one_hot[6] = 0.0
    assert torch.equal(_draw_counts(one_hot, 1000)[0][6], torch.tensor(1000.0, dtype=torch.float64))


def test_rows_are_independent_and_the_seed_reproduces_them():
    logits = torch.randn(8, 30)
    torch.manual_seed(5)
    first, _ = inverse_cdf_sample(logits.clone(), _metadata(8))
    torch.manual_seed(5)
    again, _ = inverse_cdf_sample(logits.clone(), _metadata(8))
    assert torch.equal(first, again)
    # Identical rows still draw independently.
    same = logits[:1].expand(256, -1).clone()
    assert len(set(inverse_cdf_sample(same, _metadata(256))[0].tolist())) > 5


def test_argmax_invariant_processors_are_applied():
    """min-p and the like transform the logits before the draw, as in vLLM's own sample."""

    class Ban:
        def apply(self, logits):
            logits[:, 0] = float("-inf")
            return logits

    logits = torch.zeros(4000, 3)
    logits[:, 0] = 5.0  # by far the likeliest token, banned by the processor
    sampled, _ = inverse_cdf_sample(logits, _metadata(4000, processors=[Ban()]))
    assert int((sampled == 0).sum()) == 0


def test_applies_only_to_all_random_batches_without_own_generators():
    assert inverse_cdf_applies(_metadata(2))
    assert not inverse_cdf_applies(_metadata(2, all_random=False))  # greedy rows in the batch
    assert not inverse_cdf_applies(_metadata(2, all_random=False, all_greedy=True))
    assert not inverse_cdf_applies(_metadata(2, generators={0: torch.Generator()}))  # SamplingParams.seed
    assert not inverse_cdf_applies(_metadata(2, temperature=None))
