"""Loss aggregation: hand-worked modes and micro-batch / data-parallel invariance.

The invariance tests run the same mini-batch as one batch and as micro-batches whose losses
are back-propagated one at a time (gradient accumulation), and as "DP ranks" whose gradients
are averaged, and require the same loss and gradients. Tolerance 1e-6: the pieces sum the same
float32 numbers in a different order.
"""

from __future__ import annotations

import pytest
import torch

from verl.algos import GlobalBatchInfo, agg_loss, compute_policy_loss, list_loss_agg_modes

TOL = dict(rtol=0, atol=1e-6)
MODES = list_loss_agg_modes()


def test_modes():
    assert MODES == ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 2 + 4) / 3),
        ("token-sum", 1.0 + 2 + 4),
        ("seq-mean-token-sum", ((1 + 2) + 4) / 2),
        ("seq-mean-token-mean", ((1 + 2) / 2 + 4 / 1) / 2),
        ("seq-mean-token-sum-norm", ((1 + 2) + 4) / 2 / 3),  # constant normaliser T = 3
    ],
)
def test_hand_worked(mode, expected):
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, float("nan")]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the fully masked row is not a sequence
    torch.testing.assert_close(agg_loss(loss_mat, mask, mode), torch.tensor(expected), **TOL)


def test_explicit_loss_scale_factor():
    loss_mat = torch.tensor([[1.0, 2.0, 3.0]])
    mask = torch.ones(1, 3)
    torch.testing.assert_close(
        agg_loss(loss_mat, mask, "seq-mean-token-sum-norm", loss_scale_factor=6), torch.tensor(1.0), **TOL
    )


@pytest.mark.parametrize("mode", MODES)
def test_all_masked_batch_is_zero_not_nan(mode):
    loss_mat = torch.randn(3, 4, requires_grad=True)
    loss = agg_loss(loss_mat, torch.zeros(3, 4), mode)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(loss_mat.grad, torch.zeros(3, 4))


def _batch(seed: int, B: int = 8, T: int = 6):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) < 0.7).float()
    mask[2] = 0  # a fully masked sequence
    mask[5, :] = 1
    loss_mat = torch.randn(B, T, generator=g)
    return loss_mat, mask


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("micro", [1, 2, 8])
def test_gradient_accumulation_equals_one_batch(mode, micro):
    """micro-batch `micro` x (8 / micro) accumulation steps == one batch of 8 (loss and gradient)."""
    loss_mat, mask = _batch(0)
    full_leaf = loss_mat.clone().requires_grad_()
    expected = agg_loss(full_leaf, mask, mode)
    expected.backward()

    acc_leaf = loss_mat.clone().requires_grad_()
    info = GlobalBatchInfo.from_masks(list(mask.split(micro)))
    actual = torch.zeros(())
    for rows, mb_mask in zip(torch.arange(8).split(micro), mask.split(micro)):
        part = agg_loss(acc_leaf[rows], mb_mask, mode, global_batch_info=info)
        part.backward()  # one backward per micro-batch, gradients accumulate in .grad
        actual = actual + part.detach()
    torch.testing.assert_close(actual, expected.detach(), **TOL)
    torch.testing.assert_close(acc_leaf.grad, full_leaf.grad, **TOL)


@pytest.mark.parametrize("mode", MODES)
def test_data_parallel_average_equals_one_batch(mode):
    """2 DP ranks x 2 micro-batches: averaging the ranks' accumulated gradients == one batch of 8."""
    loss_mat, mask = _batch(1)
    full_leaf = loss_mat.clone().requires_grad_()
    agg_loss(full_leaf, mask, mode).backward()

    rank_rows = [torch.arange(0, 4), torch.arange(4, 8)]
    counts = GlobalBatchInfo.from_masks([mask])  # what all_reduce over the DP group would give
    info = GlobalBatchInfo(
        batch_num_tokens=counts.batch_num_tokens, global_batch_size=counts.global_batch_size, dp_size=2
    )
    grads = []
    for rows in rank_rows:
        leaf = loss_mat.clone().requires_grad_()
        for mb in rows.split(2):
            agg_loss(leaf[mb], mask[mb], mode, global_batch_info=info).backward()
        grads.append(leaf.grad)
    torch.testing.assert_close((grads[0] + grads[1]) / 2, full_leaf.grad, **TOL)  # DDP averages


def test_seq_mean_token_sum_norm_needs_one_factor_across_differently_padded_micro_batches():
    loss_mat, mask = _batch(2)
    expected = agg_loss(loss_mat, mask, "seq-mean-token-sum-norm")  # factor T = 6
    info = GlobalBatchInfo.from_masks([mask[:4], mask[4:]])
    # micro-batch 2 trimmed to its longest response (padding removed) has T = 5 or less
    last = int(torch.nonzero(mask[4:].sum(0)).max()) + 1
    parts = [
        agg_loss(loss_mat[:4], mask[:4], "seq-mean-token-sum-norm", global_batch_info=info, loss_scale_factor=6),
        agg_loss(
            loss_mat[4:, :last], mask[4:, :last], "seq-mean-token-sum-norm", global_batch_info=info,
            loss_scale_factor=6,
        ),
    ]
    torch.testing.assert_close(parts[0] + parts[1], expected, **TOL)


@pytest.mark.parametrize("loss_mode", ["vanilla", "cispo", "gpg", "gspo"])
@pytest.mark.parametrize("agg_mode", MODES)
def test_policy_losses_accumulate_like_one_batch(loss_mode, agg_mode):
    g = torch.Generator().manual_seed(3)
    _, mask = _batch(3)
    old = -torch.rand(8, 6, generator=g) * 2
    log_prob = old + 0.3 * torch.randn(8, 6, generator=g)
    adv = torch.randn(8, 6, generator=g)
    kwargs = dict(loss_agg_mode=agg_mode, clip_ratio=0.2) if loss_mode != "gpg" else dict(loss_agg_mode=agg_mode)

    full = log_prob.clone().requires_grad_()
    expected, _ = compute_policy_loss(
        loss_mode, old_log_prob=old, log_prob=full, advantages=adv, response_mask=mask, **kwargs
    )
    expected.backward()

    acc = log_prob.clone().requires_grad_()
    info = GlobalBatchInfo.from_masks(list(mask.split(1)))
    total = torch.zeros(())
    for i in range(8):
        part, _ = compute_policy_loss(
            loss_mode, old_log_prob=old[i : i + 1], log_prob=acc[i : i + 1], advantages=adv[i : i + 1],
            response_mask=mask[i : i + 1], global_batch_info=info, **kwargs,
        )
        part.backward()
        total = total + part.detach()
    torch.testing.assert_close(total, expected.detach(), **TOL)
    torch.testing.assert_close(acc.grad, full.grad, **TOL)


def test_bad_aggregation_inputs():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'sum'"):
        agg_loss(x, torch.ones(2, 3), "sum")
    with pytest.raises(ValueError, match="response_mask has shape \\(2, 2\\)"):
        agg_loss(x, torch.ones(2, 2), "token-mean")
    with pytest.raises(ValueError, match="needs the global batch_num_tokens"):
        agg_loss(x, torch.ones(2, 3), "token-mean", dp_size=2)
    with pytest.raises(ValueError, match="not both"):
        agg_loss(x, torch.ones(2, 3), "token-mean", dp_size=2,
                 global_batch_info=GlobalBatchInfo(batch_num_tokens=6, global_batch_size=2))
    with pytest.raises(ValueError, match="dp_size must be an int >= 1"):
        GlobalBatchInfo(batch_num_tokens=6, global_batch_size=2, dp_size=0)
    with pytest.raises(ValueError, match="loss_scale_factor must be finite and > 0"):
        agg_loss(x, torch.ones(2, 3), "seq-mean-token-sum-norm", loss_scale_factor=0)
    with pytest.raises(ValueError, match="empty batch"):
        agg_loss(torch.zeros(0, 3), torch.zeros(0, 3), "token-mean")
