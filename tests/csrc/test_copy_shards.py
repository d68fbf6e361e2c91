"""verl._C.copy_shards_ against its pure-PyTorch reference, on odd shapes and every dtype.

Comparisons are bitwise (tests/csrc/tensors.py).
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.csrc.tensors import DEVICES, DTYPES, NEEDS_CUDA, as_bytes, assert_rejected, random_flat
from verl.hybrid.copy_shards import as_ranges, copy_shards_, copy_shards_reference_


def valid_ranges(rng: random.Random, count: int, max_len: int, src_numel: int) -> tuple[list, int]:
    """`count` valid ranges (disjoint dst pieces in shuffled order, any src offsets, some of
    length 0 and 1, range 0 of length `max_len`) and the dst numel they need."""
    order = list(range(count))
    rng.shuffle(order)
    rows = [None] * count
    cursor = 0
    for idx in order:
        length = max_len if idx == 0 else rng.choice([0, 1, rng.randint(0, max_len)])
        length = min(length, src_numel)
        cursor += rng.randint(0, 2)  # gaps must stay untouched
        rows[idx] = (rng.randint(0, src_numel - length), cursor, length)
        cursor += length
    return rows, cursor + rng.randint(0, 3)


def run_both(dst: torch.Tensor, src: torch.Tensor, ranges) -> tuple[torch.Tensor, torch.Tensor]:
    """(expected, actual): the reference and the extension applied to copies of dst."""
    expected = copy_shards_reference_(dst.clone(), src, ranges)
    actual = copy_shards_(dst.clone(), src, ranges)
    return expected, actual


# (ranges, max length, src numel): empty, single element, primes, many ranges, and ranges
# longer than one CPU work chunk (64 KiB) so one range spreads over threads.
SHAPES = [(0, 1, 5), (1, 1, 1), (7, 13, 97), (311, 29, 1009), (3, 40009, 100003)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference_on_odd_shapes(dtype, device):
    rng = random.Random(17)
    gen = torch.Generator().manual_seed(17)
    for count, max_len, src_numel in SHAPES:
        rows, dst_numel = valid_ranges(rng, count, max_len, src_numel)
        src = random_flat(dtype, src_numel, gen, device)
        dst = random_flat(dtype, dst_numel, gen, device)
        expected, actual = run_both(dst, src, torch.tensor(rows, dtype=torch.int64).reshape(-1, 3))
        assert torch.equal(as_bytes(actual), as_bytes(expected)), (dtype, count, src_numel)


@pytest.mark.parametrize("device", DEVICES)
def test_random_permutation_of_blocks(device):
    """A full permutation of equal blocks (the resharding pattern): every dst byte written."""
    gen = torch.Generator().manual_seed(3)
    blocks, block = 53, 19
    perm = torch.randperm(blocks, generator=gen)
    src = random_flat(torch.bfloat16, blocks * block, gen, device)
    dst = torch.zeros_like(src)
    ranges = torch.stack([perm * block, torch.arange(blocks) * block, torch.full((blocks,), block)], dim=1)
    copy_shards_(dst, src, ranges)
    expected = src.view(blocks, block)[perm].reshape(-1)
    assert torch.equal(as_bytes(dst), as_bytes(expected))


@st.composite
def valid_problem(draw):
    dtype = draw(st.sampled_from(DTYPES))
    src_numel = draw(st.integers(min_value=0, max_value=300))
    count = draw(st.integers(min_value=0, max_value=40))
    lengths = draw(st.lists(st.integers(0, min(src_numel, 40)), min_size=count, max_size=count))
    gaps = draw(st.lists(st.integers(0, 3), min_size=count, max_size=count))
    order = draw(st.permutations(list(range(count))))
    rows = [None] * count
    cursor = 0
    for idx in order:
        cursor += gaps[idx]
        src_offset = draw(st.integers(0, src_numel - lengths[idx]))
        rows[idx] = (src_offset, cursor, lengths[idx])
        cursor += lengths[idx]
    dst_numel = cursor + draw(st.integers(0, 5))
    return dtype, src_numel, dst_numel, rows, draw(st.integers(0, 2**31 - 1))


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=valid_problem())
def test_hypothesis_valid_ranges_match_reference(problem, device):
    dtype, src_numel, dst_numel, rows, seed = problem
    gen = torch.Generator().manual_seed(seed)
    src = random_flat(dtype, src_numel, gen, device)
    dst = random_flat(dtype, dst_numel, gen, device)
    expected, actual = run_both(dst, src, rows)  # rows as a list of tuples
    assert torch.equal(as_bytes(actual), as_bytes(expected))


# In bounds for src numel 11 / dst numel 12, so that overlaps (not bounds) decide most cases.
_IN_BOUNDS_ROW = st.integers(0, 5).flatmap(
    lambda n: st.tuples(st.integers(0, 11 - n), st.integers(0, 12 - n), st.just(n))
)
_ANY_ROW = st.tuples(st.integers(-2, 14), st.integers(-2, 14), st.integers(-2, 8))


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.one_of(_IN_BOUNDS_ROW, _IN_BOUNDS_ROW, _IN_BOUNDS_ROW, _ANY_ROW), max_size=6),
    same_buffer=st.booleans(),
)
def test_hypothesis_arbitrary_ranges_agree_on_result_or_error(rows, same_buffer, device):
    """Valid or not, both implementations do the same: the same bytes, or the same ValueError
    with dst untouched."""
    gen = torch.Generator().manual_seed(len(rows))
    dst = random_flat(torch.int16, 12, gen, device)
    src = dst if same_buffer else random_flat(torch.int16, 11, gen, device)
    outcomes = []
    for fn in (copy_shards_reference_, copy_shards_):
        target = dst.clone()
        source = target if same_buffer else src
        before = target.clone()
        try:
            fn(target, source, rows)
            outcomes.append(("ok", as_bytes(target).tolist()))
        except ValueError as err:
            assert torch.equal(target, before), "a refused call must not write"
            outcomes.append(("error", str(err)))
    expected, actual = outcomes
    kinds = ("negative length", "reads outside", "writes outside", "overlap in dst", "shares memory")
    event(next((k for k in kinds if k in expected[1]), "?") if expected[0] == "error" else "copied")
    assert actual == expected


def _rejected(fn, dst, src, ranges, match):
    assert_rejected(lambda: fn(dst, src, ranges), [dst], match)


BAD_RANGES = [
    ([(0, 0, 4), (1, 6, -1)], r"range 1 \(src_offset=1, dst_offset=6, length=-1\) has a negative length"),
    (
        [(0, 0, 4), (18, 6, 3)],
        r"range 1 \(src_offset=18, dst_offset=6, length=3\) reads outside src \(numel 19\)",
    ),
    ([(0, 0, 4), (-1, 6, 1)], r"range 1 .* reads outside src"),
    (
        [(0, 0, 4), (0, 22, 2)],
        r"range 1 \(src_offset=0, dst_offset=22, length=2\) writes outside dst \(numel 23\)",
    ),
    ([(0, 0, 4), (0, -5, 0)], r"range 1 .* writes outside dst"),
    ([(0, 0, 4), (1, 1, 2**63 - 1)], r"range 1 .* reads outside src"),
    # One past the end (src_offset + length == numel + 1), also for an empty range.
    (
        [(0, 0, 4), (16, 6, 4)],
        r"range 1 \(src_offset=16, dst_offset=6, length=4\) reads outside src \(numel 19\)",
    ),
    ([(0, 0, 4), (20, 6, 0)], r"range 1 \(src_offset=20, dst_offset=6, length=0\) reads outside src"),
    (
        [(0, 0, 4), (0, 20, 4)],
        r"range 1 \(src_offset=0, dst_offset=20, length=4\) writes outside dst \(numel 23\)",
    ),
    ([(0, 0, 4), (0, 24, 0)], r"range 1 \(src_offset=0, dst_offset=24, length=0\) writes outside dst"),
    (
        [(0, 10, 4), (5, 0, 3), (8, 12, 2)],
        r"ranges 0 and 2 overlap in dst \(range 0 writes dst\[10:14\], range 2 writes dst\[12:14\]\)",
    ),
    ([(0, 3, 2), (2, 3, 1)], r"ranges 0 and 1 overlap in dst"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", [copy_shards_, copy_shards_reference_], ids=["extension", "reference"])
@pytest.mark.parametrize(("rows", "match"), BAD_RANGES)
def test_bad_ranges_raise_and_leave_dst_untouched(fn, rows, match, device):
    gen = torch.Generator().manual_seed(5)
    # The first range is valid: nothing may be written before the bad one is found.
    dst = random_flat(torch.float32, 23, gen, device)
    _rejected(fn, dst, random_flat(torch.float32, 19, gen, device), rows, match)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", [copy_shards_, copy_shards_reference_], ids=["extension", "reference"])
def test_ranges_ending_exactly_at_the_end_are_valid(fn, device):
    """The other side of the bounds above: src_offset + length == src.numel() and
    dst_offset + length == dst.numel() are in bounds, and so is an empty range at numel."""
    gen = torch.Generator().manual_seed(6)
    src = random_flat(torch.float32, 19, gen, device)
    dst = random_flat(torch.float32, 23, gen, device)
    expected = dst.clone()
    expected[19:23] = src[15:19]
    expected[0:2] = src[17:19]
    rows = [(15, 19, 4), (17, 0, 2), (19, 23, 0), (19, 5, 0), (0, 23, 0)]
    assert torch.equal(as_bytes(fn(dst.clone(), src, rows)), as_bytes(expected))


@pytest.mark.parametrize("fn", [copy_shards_, copy_shards_reference_], ids=["extension", "reference"])
def test_shared_buffer_reads_must_not_overlap_writes(fn):
    gen = torch.Generator().manual_seed(9)
    buffer = random_flat(torch.int64, 40, gen)
    shared = r"range 0 reads src\[0:10\], which shares memory with dst\[5:15\] written by range 1"
    _rejected(fn, buffer, buffer, [(0, 20, 10), (30, 5, 10)], shared)
    # Through a view with a storage offset: src[2:4] is buffer[12:14].
    through_view = r"range 0 reads src\[2:4\], which shares memory with dst\[12:14\] written by range 0"
    _rejected(fn, buffer, buffer[10:], [(2, 12, 2)], through_view)
    # Disjoint regions of one buffer are fine (an in-place shuffle).
    expected = buffer.clone()
    expected[20:30] = buffer[0:10]
    expected[35:40] = buffer[10:15]
    assert torch.equal(fn(buffer, buffer, [(0, 20, 10), (10, 35, 5), (3, 3, 0)]), expected)


@pytest.mark.parametrize("fn", [copy_shards_, copy_shards_reference_], ids=["extension", "reference"])
def test_tensor_level_rejections(fn):
    gen = torch.Generator().manual_seed(11)
    dst = random_flat(torch.float16, 30, gen)
    src = random_flat(torch.float16, 30, gen)
    grid = random_flat(torch.float16, 60, gen).view(30, 2)
    ok = [(0, 0, 3)]
    dtypes = r"dst has dtype torch\.float16 but src has dtype torch\.float32; copy_shards_ does not convert"
    _rejected(fn, dst, src.float(), ok, dtypes)
    _rejected(fn, dst, grid[:, 0], ok, r"src must be a flat \(1-D contiguous")
    _rejected(fn, grid, src, ok, r"dst must be a flat \(1-D contiguous")
    on_meta = torch.empty(30, dtype=torch.float16, device="meta")
    _rejected(fn, dst, on_meta, ok, "dst is on cpu but src is on meta")
    _rejected(fn, dst, src, torch.tensor([[0.0, 0.0, 3.0]]), "ranges must hold integers")
    _rejected(fn, dst, src, torch.tensor([0, 0, 3]), r"ranges must be an int64 tensor of shape \[N, 3\]")
    not_triple = r"ranges\[0\] = \(0, 0\) is not a \(src_offset, dst_offset, length\) triple"
    _rejected(fn, dst, src, [(0, 0)], not_triple)
    meta_table = torch.tensor([[0, 0, 3]], device="meta")
    _rejected(
        fn, dst, src, meta_table, r"ranges is on meta but the tensors are on cpu; pass ranges on the cpu$"
    )


def test_extension_checks_ranges_itself():
    """The C++ entry point refuses what the wrapper would have converted."""
    from verl import _C

    dst, src = torch.zeros(4), torch.zeros(4)
    with pytest.raises(
        ValueError, match=r"ranges must be an int64 tensor of shape \[N, 3\].*got dtype torch\.int32"
    ):
        _C.copy_shards_(dst, src, torch.tensor([[0, 0, 1]], dtype=torch.int32))


def test_inputs_forms_agree_and_dst_is_returned():
    gen = torch.Generator().manual_seed(2)
    src = random_flat(torch.int32, 17, gen)
    rows = [(3, 0, 5), (0, 9, 2), (16, 5, 1)]
    from_list = torch.zeros(12, dtype=torch.int32)
    from_int32_tensor = torch.zeros(12, dtype=torch.int32)
    assert copy_shards_(from_list, src, rows) is from_list
    copy_shards_(from_int32_tensor, src, torch.tensor(rows, dtype=torch.int32))
    assert torch.equal(from_list, from_int32_tensor)
    assert as_ranges([]).shape == (0, 3)


def test_autograd_guard_and_version_counter():
    src = torch.arange(6.0)
    leaf = torch.zeros(6, requires_grad=True)
    with pytest.raises(ValueError, match="dst requires grad and grad mode is on"):
        copy_shards_(leaf, src, [(0, 0, 2)])
    plain = torch.zeros(6)
    version = plain._version
    copy_shards_(plain, src, [(0, 0, 2)])
    assert plain._version > version, "in-place writes must bump the version counter"
    with torch.no_grad():
        copy_shards_(leaf, src, [(1, 4, 2)])
    assert leaf.detach().tolist() == [0, 0, 0, 0, 1, 2]


@NEEDS_CUDA
def test_cuda_runs_on_the_current_stream_with_ranges_on_either_device():
    gen = torch.Generator().manual_seed(4)
    rows, dst_numel = valid_ranges(random.Random(4), 2000, 300, 5003)
    src = random_flat(torch.float16, 5003, gen, "cuda")
    dst = random_flat(torch.float16, dst_numel, gen, "cuda")
    expected = copy_shards_reference_(dst.clone(), src, rows)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        actual = copy_shards_(dst.clone(), src, torch.tensor(rows, device="cuda"))
    side.synchronize()
    assert torch.equal(as_bytes(actual), as_bytes(expected))
