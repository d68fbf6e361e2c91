"""verl._C.copy_ranges_ (many tensors to many tensors) against its pure-PyTorch reference: every
dtype, odd shapes and sizes around the copy chunks, tensors shared between the lists, random
(often invalid) range tables, and the boundaries of every check.

Comparisons are bitwise (tests/csrc/tensors.py).
"""

from __future__ import annotations

import random
import sys
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.csrc.tensors import DEVICES, DTYPES, NEEDS_CUDA, as_bytes, assert_rejected, random_tensor
from verl.hybrid import copy_ranges_, copy_ranges_reference_
from verl.hybrid.copy_ranges import as_range_table

IMPLEMENTATIONS = pytest.mark.parametrize(
    "fn", [copy_ranges_, copy_ranges_reference_], ids=["extension", "reference"]
)
# Work-item sizes of the two copy paths (csrc/byte_copy.cpp, csrc/byte_copy_kernel.h).
CPU_CHUNK_BYTES = 64 * 1024
CUDA_CHUNK_BYTES = 16 * 1024
INT64_MAX = 2**63 - 1


def odd_shape(numel: int, rng: random.Random) -> tuple[int, ...]:
    """A shape holding ``numel`` elements, often not 1-D (the copy views tensors flat)."""
    if numel == 1 and rng.random() < 0.5:
        return ()
    if numel % 3 == 0 and numel:
        return (3, numel // 3)
    if numel % 2 == 0 and numel:
        return (numel // 2, 1, 2)
    return (numel,)


def valid_problem(rng, gen, dtype, device, *, n_srcs, n_dsts, count, max_len, max_src_numel, lengths=()):
    """Random valid ranges between ``n_srcs`` and ``n_dsts`` tensors of odd shapes: disjoint
    pieces of each destination in shuffled order, with gaps that must stay untouched; any
    source offsets; many of length 0 and 1, range 0 of length ``max_len``, and the rows after
    it of the given ``lengths``. Returns (dsts, srcs, rows)."""
    src_numels = [rng.randint(max_src_numel // 2, max_src_numel) for _ in range(n_srcs)]
    srcs = [random_tensor(dtype, odd_shape(n, rng), gen, device) for n in src_numels]
    cursors = [0] * n_dsts
    rows = [None] * count
    order = list(range(count))
    rng.shuffle(order)
    for idx in order:
        i, j = rng.randrange(n_srcs), rng.randrange(n_dsts)
        if idx == 0:
            length = max_len
        elif idx <= len(lengths):
            length = lengths[idx - 1]
        else:
            length = rng.choice([0, 1, rng.randint(0, max_len)])
        length = min(length, src_numels[i])
        cursors[j] += rng.randint(0, 2)
        rows[idx] = (i, rng.randint(0, src_numels[i] - length), j, cursors[j], length)
        cursors[j] += length
    dsts = [random_tensor(dtype, odd_shape(c + rng.randint(0, 3), rng), gen, device) for c in cursors]
    return dsts, srcs, rows


def run_both(dsts, srcs, rows):
    """(expected, actual): the destinations' bytes after the reference and after the extension,
    each applied to its own copies of the destinations."""
    outcomes = []
    for fn in (copy_ranges_reference_, copy_ranges_):
        targets = [t.clone() for t in dsts]
        fn(targets, srcs, rows)
        outcomes.append([as_bytes(t) for t in targets])
    return outcomes


# (srcs, dsts, ranges, max length, max src numel): no ranges, one element, primes, many
# tensors of different lengths, thousands of tiny ranges, and ranges longer than a CPU chunk.
SHAPES = [
    (1, 1, 0, 1, 5),
    (1, 1, 1, 1, 1),
    (3, 4, 7, 13, 97),
    (17, 9, 311, 29, 1009),
    (64, 64, 500, 100, 300),
    (5, 3, 3000, 3, 50),
    (4, 3, 5, 40009, 100003),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference_on_odd_shapes(dtype, device):
    rng = random.Random(23)
    gen = torch.Generator().manual_seed(23)
    for n_srcs, n_dsts, count, max_len, max_src_numel in SHAPES:
        dsts, srcs, rows = valid_problem(
            rng,
            gen,
            dtype,
            device,
            n_srcs=n_srcs,
            n_dsts=n_dsts,
            count=count,
            max_len=max_len,
            max_src_numel=max_src_numel,
        )
        table = torch.tensor(rows, dtype=torch.int64).reshape(-1, 5)
        expected, actual = run_both(dsts, srcs, table)
        for k, (e, a) in enumerate(zip(expected, actual)):
            assert torch.equal(a, e), (dtype, n_srcs, n_dsts, count, f"dsts[{k}]")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lengths_around_the_chunk_sizes(dtype, device):
    """Ranges one element short of, at, and past each path's chunk size, and spanning several
    chunks, from odd offsets (so CUDA's chunks start unaligned)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    lengths = []
    for chunk_bytes in (CPU_CHUNK_BYTES, CUDA_CHUNK_BYTES):
        chunk = chunk_bytes // itemsize
        lengths += [chunk - 1, chunk, chunk + 1, 2 * chunk + 3]
    rng = random.Random(itemsize)
    gen = torch.Generator().manual_seed(itemsize)
    dsts, srcs, rows = valid_problem(
        rng,
        gen,
        dtype,
        device,
        n_srcs=3,
        n_dsts=4,
        count=len(lengths) + 7,
        max_len=3 * lengths[2] + 1,
        max_src_numel=6 * lengths[2],
        lengths=lengths,
    )
    assert {row[4] for row in rows} >= set(lengths)
    expected, actual = run_both(dsts, srcs, rows)
    for e, a in zip(expected, actual):
        assert torch.equal(a, e)


@pytest.mark.parametrize("device", DEVICES)
def test_pack_then_unpack_round_trip(device):
    """The reshard pattern: ranges of 64 parameters packed into one flat bucket by one call,
    unpacked by one call into differently shaped destinations (every byte written)."""
    gen = torch.Generator().manual_seed(8)
    rng = random.Random(8)
    params = [
        random_tensor(torch.bfloat16, odd_shape(rng.randint(1, 3000), rng), gen, device) for _ in range(64)
    ]
    pieces, cursor = [], 0
    for i, p in enumerate(params):
        start = 0
        while start < p.numel():  # each parameter in several ranges
            n = min(p.numel() - start, rng.randint(1, 700))
            pieces.append((i, start, cursor, n))
            start += n
            cursor += n
    bucket = torch.empty(cursor, dtype=torch.bfloat16, device=device)
    copy_ranges_([bucket], params, [(i, s, 0, c, n) for i, s, c, n in pieces])
    assert torch.equal(as_bytes(bucket), as_bytes(torch.cat([p.reshape(-1) for p in params])))

    received = [torch.empty(p.shape, dtype=p.dtype, device=device) for p in params]
    copy_ranges_(received, [bucket], torch.tensor([(0, c, i, s, n) for i, s, c, n in pieces]))
    for p, r in zip(params, received):
        assert torch.equal(as_bytes(r), as_bytes(p))


@pytest.mark.parametrize("device", DEVICES)
@IMPLEMENTATIONS
def test_in_place_permutation_through_shared_tensors(fn, device):
    """Both lists hold the same tensors and views of one buffer: a legal in-place permutation
    (no range reads what any range writes) runs and equals the same moves done by hand."""
    gen = torch.Generator().manual_seed(6)
    buffer = random_tensor(torch.int32, 60, gen, device)
    left, right = buffer[:30].view(5, 6), buffer[30:]
    other = random_tensor(torch.int32, 10, gen, device)
    dsts = [left, right, other]
    srcs = [right, buffer, other, left]  # the same objects and overlapping views, in both lists
    rows = [
        (1, 0, 0, 10, 10),  # buffer[0:10] -> left[10:20]
        (0, 0, 1, 20, 10),  # right[0:10] -> right[20:30]
        (3, 0, 1, 10, 10),  # left[0:10] -> right[10:20]
        (2, 0, 2, 5, 5),  # other[0:5] -> other[5:10]
        (1, 0, 2, 0, 0),  # zero length: reads/writes nothing
    ]
    expected_buffer, expected_other = buffer.clone(), other.clone()
    original = buffer.clone()
    expected_buffer[10:20] = original[0:10]
    expected_buffer[50:60] = original[30:40]
    expected_buffer[40:50] = original[0:10]
    expected_other[5:10] = other[0:5]
    fn(dsts, srcs, rows)
    assert torch.equal(as_bytes(buffer), as_bytes(expected_buffer))
    assert torch.equal(as_bytes(other), as_bytes(expected_other))


@IMPLEMENTATIONS
def test_shared_memory_reads_must_not_overlap_writes(fn):
    gen = torch.Generator().manual_seed(9)
    buffer = random_tensor(torch.int64, 40, gen)
    tail = buffer[10:]
    shared = (
        r"copy_ranges_: range 1 reads srcs\[0\]\[12:16\], which shares memory with dsts\[0\]\[0:4\] written "
        r"by range 0; when sources and destinations share memory, no range may read what any range writes"
    )
    assert_rejected(lambda: fn([tail], [buffer], [(0, 0, 0, 0, 4), (0, 12, 0, 20, 4)]), [buffer], shared)
    same_tensor = (
        r"range 0 reads srcs\[0\]\[0:3\], which shares memory with dsts\[0\]\[2:5\] written by range 0"
    )
    assert_rejected(lambda: fn([buffer], [buffer], [(0, 0, 0, 2, 3)]), [buffer], same_tensor)
    aliased = (
        r"ranges 0 and 1 overlap in the memory dsts\[0\] and dsts\[1\] share \(range 0 writes "
        r"dsts\[0\]\[0:2\], range 1 writes dsts\[1\]\[1:3\]\); destination ranges must be disjoint in memory"
    )
    other = random_tensor(torch.int64, 5, gen)
    assert_rejected(
        lambda: fn([buffer, buffer], [other], [(0, 0, 0, 0, 2), (0, 0, 1, 1, 2)]), [buffer], aliased
    )
    # Equal offsets in different, separate destinations do not overlap.
    a, b = torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    fn([a, b], [other], [(0, 0, 0, 0, 3), (0, 2, 1, 0, 3)])
    assert a.tolist() == other[:3].tolist() + [0] and b.tolist() == other[2:5].tolist() + [0]


@IMPLEMENTATIONS
def test_overlap_report_does_not_depend_on_memory_order(fn):
    """Two clashes in two separate tensors: the pair listed first is reported, wherever the
    allocator put the tensors."""
    x, y = torch.zeros(8), torch.zeros(8)
    src = torch.arange(8.0)
    for dsts, ix, iy in (([x, y], 0, 1), ([y, x], 1, 0)):
        rows = [(0, 0, iy, 2, 3), (0, 0, iy, 4, 1), (0, 0, ix, 0, 2), (0, 0, ix, 1, 1)]
        message = (
            rf"ranges 0 and 1 overlap in dsts\[{iy}\] \(range 0 writes dsts\[{iy}\]\[2:5\], range 1 writes"
        )
        assert_rejected(lambda dsts=dsts, rows=rows: fn(dsts, [src], rows), [x, y], message)


# (rows after a valid first row, regex): every bound exactly, one past it, int64 overflow of
# offset + length, indices, and the order of the checks within one row.
BAD_ROWS = [
    (
        (0, 8, 0, 0, 12),
        (
            r"range 1 \(src_index=0, src_offset=8, dst_index=0, dst_offset=0, length=12\) reads outside "
            r"srcs\[0\] \(numel 19\); need 0 <= src_offset and src_offset \+ length <= srcs\[0\]\.numel\(\)"
        ),
    ),
    ((1, 13, 0, 0, 0), r"range 1 .* reads outside srcs\[1\] \(numel 12\)"),
    (
        (0, 0, 0, 20, 4),
        (
            r"range 1 .* writes outside dsts\[0\] \(numel 23\); need 0 <= dst_offset and "
            r"dst_offset \+ length <= dsts\[0\]\.numel\(\)"
        ),
    ),
    ((0, 0, 1, 11, 0), r"range 1 .* writes outside dsts\[1\] \(numel 10\)"),
    ((0, INT64_MAX, 0, 0, 2), r"range 1 .* reads outside srcs\[0\]"),
    ((0, 1, 0, 1, INT64_MAX), r"range 1 .* reads outside srcs\[0\]"),
    ((1, 0, 0, INT64_MAX - 1, 5), r"range 1 .* writes outside dsts\[0\]"),
    ((0, -1, 0, 0, 1), r"range 1 .* reads outside srcs\[0\]"),
    ((0, 0, 1, -(2**63), 0), r"range 1 .* writes outside dsts\[1\]"),
    (
        (0, 0, 0, 0, -1),
        r"range 1 \(src_index=0, src_offset=0, dst_index=0, dst_offset=0, length=-1\) has a negative length",
    ),
    ((0, 0, 0, 0, -(2**63)), r"range 1 .* has a negative length"),
    (
        (2, 0, 0, 0, 1),
        r"range 1 \(src_index=2, .*\) has src_index out of range; need 0 <= src_index < len\(srcs\) = 2",
    ),
    ((-1, 0, 0, 0, -1), r"range 1 .* has src_index out of range"),  # the index is checked first
    ((0, 0, 2, 0, 1), r"range 1 .* has dst_index out of range; need 0 <= dst_index < len\(dsts\) = 2"),
    ((0, 0, -1, 0, 0), r"range 1 .* has dst_index out of range"),  # zero length is still checked
    (
        (0, 5, 0, 3, 3),
        (
            r"ranges 0 and 1 overlap in dsts\[0\] \(range 0 writes dsts\[0\]\[0:4\], range 1 writes "
            r"dsts\[0\]\[3:6\]\); destination ranges must be disjoint in memory"
        ),
    ),
]


def _boundary_tensors(device="cpu"):
    gen = torch.Generator().manual_seed(5)
    srcs = [random_tensor(torch.float32, 19, gen, device), random_tensor(torch.float32, (3, 4), gen, device)]
    dsts = [random_tensor(torch.float32, 23, gen, device), random_tensor(torch.float32, (2, 5), gen, device)]
    return dsts, srcs


@pytest.mark.parametrize("device", DEVICES)
@IMPLEMENTATIONS
@pytest.mark.parametrize(("row", "match"), BAD_ROWS, ids=[str(row) for row, _ in BAD_ROWS])
def test_bad_rows_raise_and_write_nothing(fn, row, match, device):
    dsts, srcs = _boundary_tensors(device)
    # The first row is valid: nothing may be written before the bad one is found.
    rows = [(1, 0, 0, 0, 4), row]
    assert_rejected(lambda: fn(dsts, srcs, rows), dsts, "^copy_ranges_: " + match)


@pytest.mark.parametrize("device", DEVICES)
@IMPLEMENTATIONS
def test_ranges_exactly_at_the_ends(fn, device):
    dsts, srcs = _boundary_tensors(device)
    rows = [
        (0, 7, 0, 11, 12),  # srcs[0][7:19] -> dsts[0][11:23]: both ends exactly at numel
        (1, 2, 1, 0, 10),  # srcs[1][2:12] -> dsts[1][0:10]
        (1, 12, 0, 23, 0),  # zero length exactly at the end on both sides
        (0, 0, 0, 0, 11),
    ]
    expected = [t.clone() for t in dsts]
    for i, s, j, d, n in rows:
        expected[j].view(-1)[d : d + n] = srcs[i].reshape(-1)[s : s + n]
    fn(dsts, srcs, rows)
    for e, a in zip(expected, dsts):
        assert torch.equal(as_bytes(a), as_bytes(e))


@IMPLEMENTATIONS
def test_tensor_level_rejections(fn):
    gen = torch.Generator().manual_seed(11)
    dst, src = random_tensor(torch.float16, 30, gen), random_tensor(torch.float16, (5, 6), gen)
    grid = random_tensor(torch.float16, (30, 2), gen)
    ok = [(0, 0, 0, 0, 3)]

    def rejected(dsts, srcs, ranges, match):
        assert_rejected(lambda: fn(dsts, srcs, ranges), [dst, src, grid], "^copy_ranges_: " + match)

    rejected(
        [dst, dst],
        [src, src.float()],
        ok,
        r"dsts\[0\] has dtype torch\.float16 but srcs\[1\] has dtype torch\.float32; copy_ranges_ does "
        r"not convert, cast srcs\[1\] first",
    )
    on_meta = torch.empty(30, dtype=torch.float16, device="meta")
    rejected(
        [dst], [on_meta], ok, r"dsts\[0\] is on cpu but srcs\[0\] is on meta; move every tensor to one device"
    )
    rejected([on_meta], [on_meta], ok, r"tensors on meta are not supported by this build of verl\._C")
    rejected(
        [dst],
        [grid.t()],
        ok,
        r"srcs\[0\] must be a contiguous \(strided\) tensor, got shape \[2, 30\] with strides \[1, 2\]",
    )
    rejected([grid[:, 0], dst], [src], ok, r"dsts\[0\] must be a contiguous \(strided\) tensor")
    sparse = torch.zeros(30, dtype=torch.float16).to_sparse()
    rejected(
        [dst],
        [sparse],
        ok,
        r"srcs\[0\] must be a contiguous \(strided\) tensor, got shape \[30\] with strides \[\]",
    )
    rejected(
        [dst],
        [src],
        torch.tensor([[0.0, 0.0, 0.0, 0.0, 3.0]]),
        r"ranges must hold integers \(int64 \[N, 5\]\)",
    )
    rejected(
        [dst],
        [src],
        torch.tensor([[0, 0, 3]]),
        r"ranges must be an int64 tensor of shape \[N, 5\] holding \(src_index, src_offset, dst_index, "
        r"dst_offset, length\) rows, got shape \[1, 3\]",
    )
    rejected(
        [dst],
        [src],
        [(0, 0, 3)],
        r"ranges\[0\] = \(0, 0, 3\) is not a \(src_index, src_offset, dst_index, dst_offset, length\) "
        r"5-tuple",
    )
    rejected(
        [dst],
        [src],
        [(0, 0.5, 0, 0, 3)],
        r"ranges\[0\] = \(0, 0\.5, 0, 0, 3\) holds a value that is not an integer",
    )
    rejected([dst], [src], [(0, 0, 0, 2**64, 3)], r"ranges\[0\] = .* holds a value outside int64")
    meta_table = torch.tensor([[0, 0, 0, 0, 3]], device="meta")
    rejected(
        [dst], [src], meta_table, r"ranges is on meta but the tensors are on cpu; pass ranges on the cpu$"
    )
    rejected(dst, [src], ok, "dsts must be a sequence of tensors, got one tensor; pass \\[tensor\\]")
    rejected([dst], [src, None], ok, r"srcs\[1\] is not a tensor \(got NoneType\)")
    rejected(
        [],
        [src],
        [(0, 0, 0, 0, 0)],
        r"range 0 .* has dst_index out of range; need 0 <= dst_index < len\(dsts\) = 0",
    )


@IMPLEMENTATIONS
def test_autograd_guard(fn):
    src = torch.arange(6.0, requires_grad=True)  # a source may require grad
    plain, leaf = torch.zeros(6), torch.zeros((2, 3), requires_grad=True)
    match = (
        r"dsts\[1\] requires grad and grad mode is on; the copy bypasses autograd, so call it under "
        r"torch\.no_grad\(\) \(or pass dsts\[1\]\.detach\(\)\)"
    )
    assert_rejected(lambda: fn([plain, leaf], [src], [(0, 0, 0, 0, 2)]), [plain, leaf], match)
    with torch.no_grad():
        fn([plain, leaf], [src], [(0, 0, 1, 4, 2), (0, 2, 0, 0, 1)])
    assert leaf.detach().view(-1).tolist() == [0, 0, 0, 0, 0, 1] and plain.tolist() == [2, 0, 0, 0, 0, 0]


def test_version_counters_and_input_forms():
    gen = torch.Generator().manual_seed(2)
    srcs = [random_tensor(torch.int32, 17, gen), random_tensor(torch.int32, (2, 2), gen)]
    rows = [(0, 3, 0, 0, 5), (1, 0, 1, 9, 2), (0, 16, 0, 5, 1)]
    from_list = [torch.zeros(12, dtype=torch.int32), torch.zeros((3, 4), dtype=torch.int32)]
    versions = [t._version for t in from_list]
    assert copy_ranges_(tuple(from_list), srcs, rows) is None
    assert all(t._version > v for t, v in zip(from_list, versions)), "in-place writes must bump versions"
    from_int32_tensor = [torch.zeros(12, dtype=torch.int32), torch.zeros((3, 4), dtype=torch.int32)]
    copy_ranges_(from_int32_tensor, srcs, torch.tensor(rows, dtype=torch.int32))
    assert all(torch.equal(a, b) for a, b in zip(from_list, from_int32_tensor))
    assert as_range_table([]).shape == (0, 5)
    copy_ranges_([], [], [])  # nothing to do, nothing to check against


def test_extension_checks_the_table_itself():
    """The C++ entry point refuses what the wrapper would have converted."""
    from verl import _C

    with pytest.raises(
        ValueError, match=r"ranges must be an int64 tensor of shape \[N, 5\].*got dtype torch\.int32"
    ):
        _C.copy_ranges_(
            [torch.zeros(4)], [torch.zeros(4)], torch.tensor([[0, 0, 0, 0, 1]], dtype=torch.int32)
        )


def test_the_copy_releases_the_gil():
    """This thread runs Python while another thread is inside the copy (the binding releases
    the GIL). With a long switch interval, a copy holding the GIL could not be interrupted
    from `begin` until it returns, so no tick could fall in the first half of its duration.
    (The other end of the call is no bound: a thread coming back from a long C call yields
    the GIL to a waiting one first.)

    The window's length is the fastest of three timed copies, so a copy holding the GIL can never
    put a tick inside it. On a loaded machine this thread may get no core during one window (a
    suite run at load 16 on 2 cores saw a 15 ms copy with no tick), so up to five tries are made:
    one tick in one window is the proof, and a GIL-holding copy fails all five."""
    src = torch.full((16 * 2**20,), 7, dtype=torch.uint8)
    dst = torch.empty(8 * src.numel(), dtype=torch.uint8)
    table = torch.tensor([[0, 0, 0, k * src.numel(), src.numel()] for k in range(8)])
    from verl import _C  # the binding itself: as little Python as possible inside the window

    threads, interval = torch.get_num_threads(), sys.getswitchinterval()
    torch.set_num_threads(1)  # leave a core for this thread on a small machine
    tries = []
    try:
        _C.copy_ranges_([dst], [src], table)  # first touch of dst's pages
        durations = []
        for _ in range(3):
            start = time.perf_counter()
            _C.copy_ranges_([dst], [src], table)
            durations.append(time.perf_counter() - start)
        duration = min(durations)
        sys.setswitchinterval(0.1)
        for _ in range(5):
            begin = []

            def copy():
                begin.append(time.perf_counter())
                _C.copy_ranges_([dst], [src], table)

            worker = threading.Thread(target=copy)
            ticks = []
            worker.start()
            while worker.is_alive():
                ticks.append(time.perf_counter())
            worker.join()
            tries.append(len([t for t in ticks if begin[0] < t < begin[0] + duration / 2]))
            if tries[-1]:
                break
    finally:
        sys.setswitchinterval(interval)
        torch.set_num_threads(threads)
    assert tries[-1], f"no Python progress in the first half of a {duration * 1e3:.1f} ms copy, in {len(tries)} tries"
    assert bool((dst == 7).all())


# Hypothesis: random problems in many tensors, valid, or (mostly) not.


@st.composite
def valid_problems(draw):
    dtype = draw(st.sampled_from(DTYPES))
    src_numels = draw(st.lists(st.integers(0, 120), min_size=1, max_size=5))
    n_dsts = draw(st.integers(1, 5))
    count = draw(st.integers(0, 40))
    rows, cursors = [], [0] * n_dsts
    for _ in range(count):
        i, j = draw(st.integers(0, len(src_numels) - 1)), draw(st.integers(0, n_dsts - 1))
        n = draw(st.integers(0, min(src_numels[i], 30)))
        cursors[j] += draw(st.integers(0, 3))
        rows.append((i, draw(st.integers(0, src_numels[i] - n)), j, cursors[j], n))
        cursors[j] += n
    draw(st.randoms()).shuffle(rows)
    dst_numels = [c + draw(st.integers(0, 4)) for c in cursors]
    return dtype, src_numels, dst_numels, rows, draw(st.integers(0, 2**31 - 1))


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=valid_problems())
def test_hypothesis_valid_problems_match_reference(problem, device):
    dtype, src_numels, dst_numels, rows, seed = problem
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    srcs = [random_tensor(dtype, odd_shape(n, rng), gen, device) for n in src_numels]
    dsts = [random_tensor(dtype, odd_shape(n, rng), gen, device) for n in dst_numels]
    expected, actual = run_both(dsts, srcs, rows)  # rows as a list of tuples
    assert all(torch.equal(a, e) for a, e in zip(actual, expected))


# A tensor of a problem: its own allocation of n elements, a view [start, start + n) of the
# problem's shared buffer (viewed 2-D when n is even), or (sources only) a destination itself.
# The buffer is small, so views often overlap.
_BUFFER_NUMEL = 24
_OWN = st.tuples(st.just("own"), st.integers(0, 12))
_VIEW = st.integers(0, 12).flatmap(
    lambda n: st.tuples(st.just("view"), st.just(n), st.integers(0, _BUFFER_NUMEL - n))
)
_DST_OF = st.tuples(st.just("dst"), st.integers(0, 2))
# Mostly valid indices (0..2 for lists of up to 3), sometimes one off either end.
_INDEX = st.one_of(st.integers(0, 2), st.integers(0, 2), st.integers(0, 2), st.sampled_from([-1, 3]))


def _numel(spec, dst_specs):
    if spec[0] == "dst":
        return _numel(dst_specs[spec[1]], dst_specs) if spec[1] < len(dst_specs) else 5
    return spec[1]


@st.composite
def arbitrary_problems(draw):
    dst_specs = draw(st.lists(st.one_of(_OWN, _VIEW, _VIEW), min_size=1, max_size=3))
    src_specs = draw(st.lists(st.one_of(_OWN, _VIEW, _DST_OF, _DST_OF), min_size=1, max_size=3))
    dst_numels = [_numel(s, dst_specs) for s in dst_specs]
    src_numels = [_numel(s, dst_specs) for s in src_specs]

    def in_bounds_row():
        i, j = draw(st.integers(0, len(src_numels) - 1)), draw(st.integers(0, len(dst_numels) - 1))
        n = draw(st.integers(0, min(src_numels[i], dst_numels[j], 8)))
        return (i, draw(st.integers(0, src_numels[i] - n)), j, draw(st.integers(0, dst_numels[j] - n)), n)

    any_row = st.tuples(_INDEX, st.integers(-2, 14), _INDEX, st.integers(-2, 14), st.integers(-2, 8))
    # Out of every 8 rows, how many are drawn anywhere: none in a third of the problems, so
    # that the overlap checks (which run after every row is in bounds) decide many cases.
    wild = draw(st.sampled_from([0, 1, 3]))
    rows = []
    for _ in range(draw(st.integers(0, 6))):
        rows.append(draw(any_row) if draw(st.integers(0, 7)) < wild else in_bounds_row())
    return dst_specs, src_specs, rows


def _build(dst_specs, src_specs, device="cpu"):
    """Fresh tensors for a problem (the same bytes each time) on ``device``: (buffer, owned, dsts, srcs)."""
    gen = torch.Generator().manual_seed(1)
    buffer = random_tensor(torch.int16, _BUFFER_NUMEL, gen, device)
    owned = []

    def make(spec):
        if spec[0] == "view":
            n, start = spec[1], spec[2]
            view = buffer[start : start + n]
            return view.view(2, n // 2) if n and n % 2 == 0 else view
        owned.append(random_tensor(torch.int16, spec[1], gen, device))
        return owned[-1]

    dsts = [make(s) for s in dst_specs]
    srcs = [
        dsts[s[1]] if s[0] == "dst" and s[1] < len(dsts) else make(("own", 5) if s[0] == "dst" else s)
        for s in src_specs
    ]
    return buffer, owned, dsts, srcs


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=300, deadline=None)
@given(problem=arbitrary_problems())
def test_hypothesis_arbitrary_problems_agree_on_result_or_error(problem, device):
    """Valid or not, both implementations do the same: the same bytes everywhere, or the same
    ValueError with nothing written."""
    expected, actual = _outcomes(problem, device)
    assert actual == expected


@st.composite
def shared_memory_problems(draw):
    """Views of one buffer in both lists, writes disjoint within each destination, reads
    anywhere in bounds: legal in-place moves, or refusals for memory shared between tensors."""
    dst_specs = draw(st.lists(_VIEW, min_size=1, max_size=3))
    src_specs = draw(st.lists(st.one_of(_VIEW, _DST_OF), min_size=1, max_size=3))
    dst_numels = [_numel(s, dst_specs) for s in dst_specs]
    src_numels = [_numel(s, dst_specs) for s in src_specs]
    rows, cursors = [], [0] * len(dst_specs)
    for _ in range(draw(st.integers(1, 5))):
        i, j = draw(st.integers(0, len(src_specs) - 1)), draw(st.integers(0, len(dst_specs) - 1))
        n = draw(st.integers(0, max(0, min(src_numels[i], dst_numels[j] - cursors[j], 6))))
        cursors[j] += n
        rows.append((i, draw(st.integers(0, src_numels[i] - n)), j, cursors[j] - n, n))
    return dst_specs, src_specs, rows


def _outcomes(problem, device="cpu"):
    """(reference, extension) outcomes of one problem, each on fresh tensors on ``device``: ("ok",
    bytes of everything) or ("error", message), checking that a refusal wrote nothing."""
    dst_specs, src_specs, rows = problem
    outcomes = []
    for fn in (copy_ranges_reference_, copy_ranges_):
        buffer, owned, dsts, srcs = _build(dst_specs, src_specs, device)
        everything = [buffer, *owned]
        before = [as_bytes(t).clone() for t in everything]
        try:
            fn(dsts, srcs, rows)
            outcomes.append(("ok", [as_bytes(t).tolist() for t in everything]))
        except ValueError as err:
            assert all(torch.equal(as_bytes(t), b) for t, b in zip(everything, before)), (
                "a refused call wrote"
            )
            outcomes.append(("error", str(err)))
    kinds = (
        "index out of range",
        "negative length",
        "reads outside",
        "writes outside",
        "overlap in",
        "shares memory",
    )
    kind, detail = outcomes[0]
    event(next((k for k in kinds if k in detail), "?") if kind == "error" else "copied")
    return outcomes


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=200, deadline=None)
@given(problem=shared_memory_problems())
def test_hypothesis_shared_memory_problems_agree_on_result_or_error(problem, device):
    expected, actual = _outcomes(problem, device)
    assert actual == expected


# CUDA only.


@NEEDS_CUDA
def test_cuda_runs_on_the_current_stream_with_ranges_on_either_device():
    gen, rng = torch.Generator().manual_seed(4), random.Random(4)
    dsts, srcs, rows = valid_problem(
        rng, gen, torch.float16, "cuda", n_srcs=7, n_dsts=5, count=2000, max_len=300, max_src_numel=5003
    )
    expected = [t.clone() for t in dsts]
    copy_ranges_reference_(expected, srcs, rows)
    for table in (torch.tensor(rows), torch.tensor(rows, device="cuda")):
        actual = [t.clone() for t in dsts]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            copy_ranges_(actual, srcs, table)
        side.synchronize()
        assert all(torch.equal(as_bytes(a), as_bytes(e)) for a, e in zip(actual, expected))


@NEEDS_CUDA
@IMPLEMENTATIONS
def test_cuda_ranges_must_be_on_the_cpu_or_the_tensors_device(fn):
    dst, src = torch.zeros(4), torch.arange(4.0)
    assert_rejected(
        lambda: fn([dst], [src], torch.tensor([[0, 0, 0, 0, 2]], device="cuda")),
        [dst],
        r"ranges is on cuda:0 but the tensors are on cpu; pass ranges on the cpu$",
    )
