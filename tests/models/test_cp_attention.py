"""Context-parallel attention of the local spec (``verl.models.cp_attention``) against a plain attention.

Each CP rank holds chunks ``i`` and ``2 * cp - 1 - i`` of the sequence (Megatron's load-balanced
layout, compared with Megatron's own ``get_batch_on_this_cp_rank``); its queries attend over the
keys and values all-gathered from the CP group. The reference below is full causal attention over
the whole sequence on one rank, in float64; the CP result, float32, must give each rank's
positions of the reference's output and of its gradients with respect to queries, keys and values
(the keys' and values' gradients come back to their rank through the gather's reduce-scatter).

Tolerance 1e-5 absolute: float32 against float64, values O(1) (measured ~1e-6). A wrong chunk,
a mask from local instead of global positions or a missing gradient reduction is off by O(0.1).
"""

from __future__ import annotations

import pytest
import torch

from verl.testing.distributed import run_distributed

ATOL = 1e-5  # float32 against a float64 reference


def reference_attention(q, k, v, scale, window=None, segments=None):
    """Full causal attention in float64: q [S, b, np, hn], k/v [S, b, ng, hn] -> [S, b, np * hn]."""
    s, b, heads, dim = q.shape
    q, k, v = q.double(), k.double(), v.double()
    k = k.repeat_interleave(heads // k.shape[2], dim=2)
    v = v.repeat_interleave(heads // v.shape[2], dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * scale
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    if segments is None:
        pos = torch.arange(s)
        same = torch.ones(s, s, dtype=torch.bool)
    else:  # position within its segment; attention within the segment only
        starts = torch.cat([torch.tensor([0]), (segments[1:] != segments[:-1]).nonzero().squeeze(-1) + 1])
        pos = torch.arange(s) - starts[torch.searchsorted(starts, torch.arange(s), right=True) - 1]
        same = segments[:, None] == segments[None, :]
        i, j = pos[:, None], pos[None, :]
    allowed = (j <= i) & same
    if window is not None:
        allowed &= j >= i - window[0]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("bhst,tbhd->sbhd", probs, v).reshape(s, b, heads * dim)


def _attention_body(cp, seq, window, thd_lengths):
    from megatron.core.utils import get_batch_on_this_cp_rank

    from verl.models.cp_attention import attention_by_positions, cp_positions, gather_over_cp, thd_cp_index
    from verl.parallel.megatron_state import initialize_model_parallel

    pg = initialize_model_parallel(context_parallel_size=cp)
    group, rank = pg.cp, pg.cp.rank()
    gen = torch.Generator().manual_seed(11)
    b, heads, groups, dim = (1 if thd_lengths else 2), 4, 2, 8
    q = torch.randn(seq, b, heads, dim, generator=gen)
    k = torch.randn(seq, b, groups, dim, generator=gen)
    v = torch.randn(seq, b, groups, dim, generator=gen)
    grad_out = torch.randn(seq, b, heads * dim, generator=gen)
    scale = dim**-0.5
    segments = None
    if thd_lengths:
        segments = torch.repeat_interleave(torch.arange(len(thd_lengths)), torch.tensor(thd_lengths))
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    expected = reference_attention(*leaves, scale, window, segments)
    expected.backward(grad_out.double())

    if thd_lengths:
        cu = torch.tensor([0, *torch.tensor(thd_lengths).cumsum(0).tolist()], dtype=torch.int32)
        mine = thd_cp_index(cu, cp, rank)
        order = torch.cat([thd_cp_index(cu, cp, r) for r in range(cp)])
        offset = torch.cat([torch.arange(n) for n in thd_lengths])
        q_pos, k_pos, q_seg, k_seg = offset[mine], offset, segments[mine], segments
    else:
        mine = cp_positions(seq, cp, rank)
        order = torch.cat([cp_positions(seq, cp, r) for r in range(cp)])
        q_pos, k_pos, q_seg, k_seg = mine, torch.arange(seq), None, None
        # the same tokens as Megatron's own split of a batch ([b, S]: sequence on dim 1)
        split = get_batch_on_this_cp_rank({"tokens": torch.arange(seq).expand(2, seq).clone()}, cp_group=group)
        assert torch.equal(split["tokens"][0], mine), (split["tokens"][0], mine)
    local = [x[mine].clone().requires_grad_() for x in (q, k, v)]
    keys = gather_over_cp(local[1], group, order)
    values = gather_over_cp(local[2], group, order)
    assert torch.equal(keys.detach(), k)  # the whole sequence, in global order
    actual = attention_by_positions(
        local[0], keys, values, q_pos, k_pos, softmax_scale=scale, window=window, q_seg=q_seg, k_seg=k_seg
    )
    actual.backward(grad_out[mine])
    diffs = {"out": (actual.double() - expected[mine]).abs().max().item()}
    for name, mine_leaf, ref_leaf in zip("qkv", local, leaves):
        diffs[f"grad_{name}"] = (mine_leaf.grad.double() - ref_leaf.grad[mine]).abs().max().item()
    return diffs


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "cp, seq, window, thd",
    [
        (2, 24, None, None),
        (2, 24, (4, 0), None),
        (2, 28, None, [8, 4, 12, 4]),  # packed: each sequence a multiple of 2 x CP
        (4, 32, None, None),
    ],
    ids=["cp2", "cp2-window", "cp2-thd", "cp4"],
)
def test_cp_attention_and_its_gradients_equal_full_attention(cp, seq, window, thd):
    for rank, diffs in enumerate(run_distributed(_attention_body, cp, cp, seq, window, thd)):
        for name, diff in diffs.items():
            assert diff <= ATOL, f"rank {rank} {name}: max |CP - reference| = {diff:.3g}"


def test_cp_positions_are_the_load_balanced_chunks():
    from verl.models.cp_attention import cp_positions, thd_cp_index

    assert cp_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert cp_positions(12, 3, 1).tolist() == [2, 3, 8, 9]
    cu = torch.tensor([0, 4, 12], dtype=torch.int32)
    assert thd_cp_index(cu, 2, 0).tolist() == [0, 3, 4, 5, 10, 11]
    assert thd_cp_index(cu, 2, 1).tolist() == [1, 2, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="multiple of 2 x CP = 4"):
        cp_positions(10, 2, 0)
