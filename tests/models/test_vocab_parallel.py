"""Vocabulary-parallel logprobs/entropy against full-vocabulary torch math, values and gradients."""

from __future__ import annotations

import pytest
import torch

from verl.models.forward import last_token_values, pack_left, position_ids_from_mask, unpack
from verl.models.vocab_parallel import vocab_parallel_logprobs_entropy
from verl.testing.distributed import run_distributed

VOCAB, PADDED = 1001, 1024


def _reference(logits, target):
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, target.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, VOCAB, generator=gen, dtype=torch.float64).float() * 3
    target = torch.randint(0, VOCAB, (3, 5), generator=gen)
    weights = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
    return logits, target, weights


def test_single_rank_with_padding_columns_matches_full_vocab():
    logits, target, (w_lp, w_ent) = _inputs()
    expected_logits = logits.clone().requires_grad_()
    exp_lp, exp_ent = _reference(expected_logits, target)
    (exp_lp * w_lp + exp_ent * w_ent).sum().backward()

    # Padding columns hold huge values: they must get probability 0 and no gradient.
    padded = torch.cat([logits, torch.full((3, 5, PADDED - VOCAB), 50.0)], dim=-1).requires_grad_()
    lp, ent = vocab_parallel_logprobs_entropy(padded, target, vocab_start=0, vocab_size=VOCAB, group=None)
    (lp * w_lp + ent * w_ent).sum().backward()
    # float32 softmax over 1001 columns: differences are rounding only (~1e-6 relative).
    torch.testing.assert_close(lp, exp_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, exp_ent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded.grad[..., :VOCAB], expected_logits.grad, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(padded.grad[..., VOCAB:]) == 0


def test_without_entropy_skips_it():
    logits, target, _ = _inputs(1)
    lp, ent = vocab_parallel_logprobs_entropy(logits, target, vocab_start=0, vocab_size=VOCAB, group=None, with_entropy=False)
    torch.testing.assert_close(lp, _reference(logits, target)[0], rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(ent) == 0


def _tp2_body():
    import torch.distributed as dist

    rank = dist.get_rank()
    logits, target, (w_lp, w_ent) = _inputs()
    padded = torch.cat([logits, torch.zeros(3, 5, PADDED - VOCAB)], dim=-1)
    local = padded.chunk(2, dim=-1)[rank].clone().requires_grad_()  # [3, 5, 512]: rank 1 holds the padding
    lp, ent = vocab_parallel_logprobs_entropy(local, target, vocab_start=rank * 512, vocab_size=VOCAB, group=dist.group.WORLD)
    (lp * w_lp + ent * w_ent).sum().backward()
    return lp.detach(), ent.detach(), local.grad


@pytest.mark.distributed
def test_tensor_parallel_2_matches_full_vocab():
    logits, target, (w_lp, w_ent) = _inputs()
    expected_logits = logits.clone().requires_grad_()
    exp_lp, exp_ent = _reference(expected_logits, target)
    (exp_lp * w_lp + exp_ent * w_ent).sum().backward()
    results = run_distributed(_tp2_body, 2)
    expected_grad = torch.cat([expected_logits.grad, torch.zeros(3, 5, PADDED - VOCAB)], dim=-1).chunk(2, dim=-1)
    for rank, (lp, ent, grad) in enumerate(results):
        # Same float32 math split in two: the all-reduced sums round differently (~1e-6).
        torch.testing.assert_close(lp, exp_lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, exp_ent, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, expected_grad[rank], rtol=1e-5, atol=1e-6)


def _extreme_inputs():
    """Rows at the edges of float32's exp range, [8, 2, VOCAB] logits and [8, 2] targets.

    Without the max subtraction exp() overflows (logits ~100 or 1e4) or underflows to 0
    (logits ~-100), giving -inf logprobs and NaN entropy where log_softmax is finite.
    """
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(VOCAB, generator=gen, dtype=torch.float64).float()
    dominant_low, dominant_high = base.clone(), base.clone()
    dominant_low[3] = 1e4  # on TP rank 0: p ~ 1, every other logprob ~ -1e4, entropy ~ 0
    dominant_high[700] = 60.0  # on TP rank 1
    rows = [
        base * 3 + 100.0,  # large positive
        base * 3 - 100.0,  # large negative
        base * 30 + 1e4,  # huge and widely spread
        torch.full((VOCAB,), 7.0),  # all equal: logp = -log V, entropy = log V
        torch.full((VOCAB,), -1e4),  # all equal and hugely negative
        dominant_low,
        dominant_high,
        base * 1e-3,  # nearly uniform
    ]
    logits = torch.stack(rows).unsqueeze(1).expand(-1, 2, -1).contiguous()  # [8, 2, V]
    argmax = logits[:, 0].argmax(-1)
    # A non-maximal column per row, including both sides of the TP=2 split (511 | 512).
    other = torch.tensor([512, 900, 17, 1000, 0, 4, 2, 511])
    target = torch.stack([argmax, other], dim=1)  # [8, 2]
    return logits, target


def _extreme_reference(logits, target):
    """(logprobs, entropy, d(logprobs + entropy)/d logits) from torch.log_softmax in float64."""
    z = logits.double().requires_grad_()
    logp = torch.log_softmax(z, dim=-1)
    lp = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)  # the definition, H = -sum_v p_v log p_v
    (lp + ent).sum().backward()
    return lp.detach(), ent.detach(), z.grad


def _check_extreme(lp, ent, grad, logits, target):
    exp_lp, exp_ent, exp_grad = _extreme_reference(logits, target)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all() and torch.isfinite(grad).all()
    # float32 against float64: z - max is exact to ~ulp(1e4) = 1e-3 for the 1e4 rows (hence
    # rtol 1e-6 on the -1e4 logprobs); the log of a sum of 1001 terms adds ~1e-6 otherwise.
    torch.testing.assert_close(lp.double(), exp_lp, rtol=1e-6, atol=2e-5)
    torch.testing.assert_close(ent.double(), exp_ent, rtol=1e-6, atol=2e-5)
    torch.testing.assert_close(grad.double(), exp_grad, rtol=1e-5, atol=1e-6)
    # Exact values where the math gives them: all-equal rows are uniform.
    log_v = torch.tensor(float(VOCAB)).log().double()
    torch.testing.assert_close(lp[3:5].double(), -log_v.expand(2, 2), rtol=0, atol=2e-6)
    torch.testing.assert_close(ent[3:5].double(), log_v.expand(2, 2), rtol=0, atol=2e-6)
    assert abs(float(lp[5, 0])) < 1e-6 and abs(float(ent[5, 0])) < 1e-6  # one dominant logit: p = 1


def test_extreme_logits_single_rank_match_log_softmax():
    logits, target = _extreme_inputs()
    padded = torch.cat([logits, torch.full((8, 2, PADDED - VOCAB), 1e5)], dim=-1).requires_grad_()
    lp, ent = vocab_parallel_logprobs_entropy(padded, target, vocab_start=0, vocab_size=VOCAB, group=None)
    (lp + ent).sum().backward()
    _check_extreme(lp.detach(), ent.detach(), padded.grad[..., :VOCAB], logits, target)
    assert torch.count_nonzero(padded.grad[..., VOCAB:]) == 0


def _tp2_extreme_body(logits, target):
    import torch.distributed as dist

    rank = dist.get_rank()
    padded = torch.cat([logits, torch.full((8, 2, PADDED - VOCAB), 1e5)], dim=-1)
    local = padded.chunk(2, dim=-1)[rank].clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs_entropy(
        local, target, vocab_start=rank * 512, vocab_size=VOCAB, group=dist.group.WORLD
    )
    (lp + ent).sum().backward()
    return lp.detach(), ent.detach(), local.grad


@pytest.mark.distributed
def test_extreme_logits_tensor_parallel_2_match_log_softmax():
    logits, target = _extreme_inputs()
    results = run_distributed(_tp2_extreme_body, 2, logits, target)
    grad = torch.cat([results[0][2], results[1][2]], dim=-1)
    assert torch.count_nonzero(grad[..., VOCAB:]) == 0
    for lp, ent, _ in results:
        _check_extreme(lp, ent, grad[..., :VOCAB], logits, target)


def test_pack_left_positions_and_unpack():
    ids = torch.tensor([[0, 0, 5, 6, 7, 0], [1, 2, 3, 4, 0, 0], [0, 9, 8, 0, 0, 0]])
    mask = (ids != 0).long()
    packed, order = pack_left(ids, mask, seq_len=8)
    assert packed.tolist() == [[5, 6, 7, 0, 0, 0, 0, 0], [1, 2, 3, 4, 0, 0, 0, 0], [9, 8, 0, 0, 0, 0, 0, 0]]
    # The k-th real token sits at packed position k == transformers' cumsum(mask) - 1.
    positions = position_ids_from_mask(mask)
    for row in range(3):
        real = mask[row].nonzero().squeeze(-1)
        assert positions[row, real].tolist() == list(range(len(real)))
    values = torch.arange(3 * 8, dtype=torch.float32).reshape(3, 8, 1)
    restored = unpack(values, order)
    assert torch.equal(restored.squeeze(-1).gather(1, order), values.squeeze(-1)[:, :6])


@pytest.mark.parametrize("seed", [0, 1])
def test_pack_unpack_round_trip_random_masks(seed):
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(5, 9, generator=gen) > 0.4).long()
    ids = torch.randint(1, 50, (5, 9), generator=gen) * mask
    packed, order = pack_left(ids, mask, seq_len=9)
    assert torch.equal(unpack(packed, order), ids)


def test_positions_of_leading_pads_are_zero_not_negative():
    mask = torch.tensor([[0, 0, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    expected = torch.tensor([[0, 0, 0, 1, 1], [0, 1, 2, 3, 4], [0, 0, 0, 0, 0]])
    assert torch.equal(position_ids_from_mask(mask), expected)


def test_last_token_values_and_rows_without_tokens():
    values = torch.arange(1.0, 16.0).reshape(3, 5)  # [B, T], no zeros: a wrong pick shows
    mask = torch.tensor([[0, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    # Row 0: last real token at 2; row 1: at 4 (the end); row 2: no token, score 0.
    assert torch.equal(last_token_values(values, mask), torch.tensor([3.0, 10.0, 0.0]))
