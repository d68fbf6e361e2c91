"""Vocabulary-parallel logprobs/entropy against full-vocabulary torch math, values and gradients."""

from __future__ import annotations

import pytest
import torch

from verl.models.forward import pack_left, position_ids_from_mask, unpack
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
