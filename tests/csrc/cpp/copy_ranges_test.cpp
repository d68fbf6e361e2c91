// C++ unit tests of copy_ranges_ (csrc/copy_ranges.cpp), run by CTest.
// Many tensors of odd shapes on both sides, every dtype, against a byte-by-byte loop over the
// rows; tensors shared between the two lists; and every refusal, which must write nothing.

#include "copy_ranges.h"
#include "test_util.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace verl_test;

using Row = std::array<int64_t, 5>;  // src_index, src_offset, dst_index, dst_offset, length

at::Tensor ranges_tensor(const std::vector<Row>& rows) { return table_of(rows); }

int64_t pick(std::mt19937_64& rng, int64_t n) {
  return static_cast<int64_t>(rng() % static_cast<uint64_t>(n));
}

// A shape holding `numel` elements, often not 1-D (copy_ranges_ views tensors flat).
std::vector<int64_t> odd_shape(int64_t numel, std::mt19937_64& rng) {
  if (numel == 1 && rng() % 2) return {};
  if (numel > 0 && numel % 3 == 0) return {3, numel / 3};
  if (numel > 0 && numel % 2 == 0) return {numel / 2, 1, 2};
  return {numel};
}

struct Problem {
  std::vector<at::Tensor> dsts;
  std::vector<at::Tensor> srcs;
  std::vector<Row> rows;
};

// Random valid rows: disjoint pieces of each destination in shuffled order, with gaps that
// must stay untouched; any source offsets; many of length 0 and 1, row 0 of `max_len`.
Problem random_problem(std::mt19937_64& rng, at::ScalarType dtype, int64_t n_srcs, int64_t n_dsts,
                       int64_t count, int64_t max_len, int64_t max_src_numel) {
  Problem p;
  std::vector<int64_t> src_numels;
  for (int64_t k = 0; k < n_srcs; ++k) {
    src_numels.push_back(max_src_numel / 2 + pick(rng, max_src_numel - max_src_numel / 2 + 1));
    p.srcs.push_back(random_tensor(dtype, odd_shape(src_numels.back(), rng), rng));
  }
  std::vector<int64_t> order(count), cursors(n_dsts, 0);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  p.rows.assign(count, Row{0, 0, 0, 0, 0});
  for (const int64_t idx : order) {
    const int64_t i = pick(rng, n_srcs), j = pick(rng, n_dsts);
    const int64_t kind = pick(rng, 5);
    int64_t n = idx == 0 ? max_len : kind == 0 ? 0 : kind == 1 ? 1 : pick(rng, max_len + 1);
    n = std::min(n, src_numels[i]);
    cursors[j] += pick(rng, 3);
    p.rows[idx] = Row{i, pick(rng, src_numels[i] - n + 1), j, cursors[j], n};
    cursors[j] += n;
  }
  for (int64_t j = 0; j < n_dsts; ++j) {
    p.dsts.push_back(random_tensor(dtype, odd_shape(cursors[j] + pick(rng, 4), rng), rng));
  }
  return p;
}

// What copy_ranges_ must produce in each destination: the rows applied one byte at a time
// (sources read before any write: the checks forbid reading written memory anyway).
std::vector<std::vector<unsigned char>> expected_after(const Problem& p) {
  std::vector<std::vector<unsigned char>> out, in;
  for (const at::Tensor& t : p.dsts) out.push_back(bytes_of(t));
  for (const at::Tensor& t : p.srcs) in.push_back(bytes_of(t));
  const int64_t e = p.dsts.empty() ? 1 : static_cast<int64_t>(p.dsts[0].element_size());
  for (const Row& r : p.rows) {
    for (int64_t b = 0; b < r[4] * e; ++b) out[r[2]][r[3] * e + b] = in[r[0]][r[1] * e + b];
  }
  return out;
}

void test_matches_bytewise_loop() {
  std::mt19937_64 rng(4321);
  // (srcs, dsts, rows, max length, max src numel): one element, primes, many tensors,
  // thousands of tiny rows, rows longer than a CPU chunk (64 KiB).
  const std::vector<std::array<int64_t, 5>> shapes = {
      {1, 1, 1, 1, 1},     {3, 4, 7, 13, 97},        {9, 5, 200, 37, 1009},
      {4, 3, 3000, 3, 40}, {3, 2, 4, 70001, 140009}};
  for (const at::ScalarType dtype : all_dtypes()) {
    for (const auto& s : shapes) {
      const Problem p = random_problem(rng, dtype, s[0], s[1], s[2], s[3], s[4]);
      const auto expected = expected_after(p);
      verl::copy_ranges_(p.dsts, p.srcs, ranges_tensor(p.rows));
      bool same = true;
      for (size_t j = 0; j < p.dsts.size(); ++j) same = same && bytes_of(p.dsts[j]) == expected[j];
      expect(same, std::string("bytewise match for dtype ") + c10::toString(dtype) + " with " +
                       std::to_string(s[2]) + " rows between " + std::to_string(s[0]) + " srcs and " +
                       std::to_string(s[1]) + " dsts");
    }
  }
}

void test_in_place_permutation_through_shared_tensors() {
  // The same tensors and overlapping views of one buffer in both lists; no row reads what
  // any row writes, so the moves are legal and equal the same moves made one by one.
  std::mt19937_64 rng(6);
  const at::Tensor buffer = random_tensor(at::kInt, 60, rng);
  const at::Tensor other = random_tensor(at::kInt, 10, rng);
  const at::Tensor left = buffer.narrow(0, 0, 30).view({5, 6}), right = buffer.narrow(0, 30, 30);
  const at::Tensor before = buffer.clone(), other_before = other.clone();
  verl::copy_ranges_({left, right, other}, {right, buffer, other, left},
                     ranges_tensor({{1, 0, 0, 10, 10}, {0, 0, 1, 20, 10}, {3, 0, 1, 10, 10}, {2, 0, 2, 5, 5},
                                    {1, 0, 2, 0, 0}}));
  const at::Tensor expected = before.clone(), expected_other = other_before.clone();
  expected.narrow(0, 10, 10).copy_(before.narrow(0, 0, 10));
  expected.narrow(0, 50, 10).copy_(before.narrow(0, 30, 10));
  expected.narrow(0, 40, 10).copy_(before.narrow(0, 0, 10));
  expected_other.narrow(0, 5, 5).copy_(other_before.narrow(0, 0, 5));
  expect(bytes_of(buffer) == bytes_of(expected) && bytes_of(other) == bytes_of(expected_other),
         "in-place permutation through shared tensors and views");
}

void test_empty_calls() {
  std::mt19937_64 rng(3);
  const at::Tensor dst = random_tensor(at::kFloat, 5, rng);
  const at::Tensor src = random_tensor(at::kFloat, 0, rng);
  const std::vector<unsigned char> before = bytes_of(dst);
  verl::copy_ranges_({}, {}, at::empty({0, 5}, at::kLong));
  verl::copy_ranges_({dst}, {src}, at::empty({0, 5}, at::kLong));
  verl::copy_ranges_({dst}, {src}, ranges_tensor({{0, 0, 0, 5, 0}}));  // length 0 at both ends
  expect(bytes_of(dst) == before, "no rows / zero-length rows leave dsts as they were");
}

void test_rejections() {
  std::mt19937_64 rng(99);
  const std::vector<at::Tensor> srcs = {random_tensor(at::kHalf, 31, rng),
                                        random_tensor(at::kHalf, {3, 4}, rng)};
  const std::vector<at::Tensor> dsts = {random_tensor(at::kHalf, 29, rng),
                                        random_tensor(at::kHalf, {2, 5}, rng)};
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
  // A valid first row each time: the error must name the second and nothing be written.
  struct Bad {
    const char* name;
    Row row;
    const char* needle;
  };
  const std::vector<Bad> bad = {
      {"src index past the list", {2, 0, 0, 10, 1},
       "range 1 (src_index=2, src_offset=0, dst_index=0, dst_offset=10, length=1) has src_index out of "
       "range; need 0 <= src_index < len(srcs) = 2"},
      {"negative src index, checked before the length", {-1, 0, 0, 10, -1},
       "range 1 (src_index=-1, src_offset=0, dst_index=0, dst_offset=10, length=-1) has src_index out "
       "of range"},
      {"dst index past the list", {0, 0, 2, 0, 0},
       "has dst_index out of range; need 0 <= dst_index < len(dsts) = 2"},
      {"negative length", {0, 0, 0, 10, -1},
       "range 1 (src_index=0, src_offset=0, dst_index=0, dst_offset=10, length=-1) has a negative length"},
      {"src end past numel", {0, 25, 0, 10, 7},
       "reads outside srcs[0] (numel 31); need 0 <= src_offset and src_offset + length <= srcs[0].numel()"},
      {"zero length past a 2-D numel", {1, 13, 0, 10, 0}, "reads outside srcs[1] (numel 12)"},
      {"dst end past numel", {0, 0, 0, 25, 5},
       "writes outside dsts[0] (numel 29); need 0 <= dst_offset and dst_offset + length <= dsts[0].numel()"},
      {"dst end past a 2-D numel", {0, 0, 1, 6, 5}, "writes outside dsts[1] (numel 10)"},
      {"most negative dst offset", {0, 0, 1, kMin, 0}, "writes outside dsts[1]"},
      {"overflowing length", {0, 1, 0, 1, kMax}, "reads outside srcs[0]"},
      {"overflowing src offset", {0, kMax, 0, 1, 2}, "reads outside srcs[0]"},
      {"overflowing dst offset", {1, 0, 0, kMax - 1, 5}, "writes outside dsts[0]"},
      {"overlap in one dst", {0, 20, 0, 4, 3},
       "ranges 0 and 1 overlap in dsts[0] (range 0 writes dsts[0][0:5], range 1 writes dsts[0][4:7]); "
       "destination ranges must be disjoint in memory"},
  };
  for (const Bad& b : bad) {
    const std::vector<Row> rows = {{1, 0, 0, 0, 5}, b.row};
    expect_rejected(b.name, dsts, b.needle, [&] { verl::copy_ranges_(dsts, srcs, ranges_tensor(rows)); });
  }

  const at::Tensor buffer = random_tensor(at::kLong, 40, rng);
  const at::Tensor tail = buffer.narrow(0, 10, 30);
  expect_rejected("read overlaps a write through a view", {buffer},
                  "range 1 reads srcs[0][12:16], which shares memory with dsts[0][0:4] written by range 0; "
                  "when sources and destinations share memory",
                  [&] {
                    verl::copy_ranges_({tail}, {buffer}, ranges_tensor({{0, 0, 0, 0, 4}, {0, 12, 0, 20, 4}}));
                  });
  expect_rejected("one tensor in both lists reads what it writes", {buffer},
                  "range 0 reads srcs[0][0:3], which shares memory with dsts[0][2:5] written by range 0",
                  [&] { verl::copy_ranges_({buffer}, {buffer}, ranges_tensor({{0, 0, 0, 2, 3}})); });
  expect_rejected("aliased dsts overlap", {buffer},
                  "ranges 0 and 1 overlap in the memory dsts[0] and dsts[1] share (range 0 writes "
                  "dsts[0][0:2], range 1 writes dsts[1][1:3])",
                  [&] {
                    verl::copy_ranges_({buffer, buffer}, {tail},
                                       ranges_tensor({{0, 0, 0, 0, 2}, {0, 0, 1, 1, 2}}));
                  });
  // Two clashes in two separate tensors: the pair listed first is reported, whichever tensor
  // the allocator put first.
  const at::Tensor x = at::zeros({8}), y = at::zeros({8}), src = at::arange(8.0);
  for (const bool swap : {false, true}) {
    const int64_t ix = swap ? 1 : 0, iy = swap ? 0 : 1;
    const std::vector<at::Tensor> pair = swap ? std::vector<at::Tensor>{y, x} : std::vector<at::Tensor>{x, y};
    expect_rejected("clash report independent of memory order", {x, y},
                    "ranges 0 and 1 overlap in dsts[" + std::to_string(iy) + "]", [&] {
                      verl::copy_ranges_(pair, {src}, ranges_tensor({{0, 0, iy, 2, 3}, {0, 0, iy, 4, 1},
                                                                     {0, 0, ix, 0, 2}, {0, 0, ix, 1, 1}}));
                    });
  }

  const std::vector<Row> ok = {{0, 0, 0, 0, 3}};
  expect_rejected("dtype mismatch", dsts,
                  "dsts[0] has dtype torch.float16 but srcs[1] has dtype torch.float32; copy_ranges_ does "
                  "not convert, cast srcs[1] first",
                  [&] { verl::copy_ranges_(dsts, {srcs[0], srcs[1].to(at::kFloat)}, ranges_tensor(ok)); });
  const at::Tensor on_meta = at::empty({31}, at::TensorOptions().dtype(at::kHalf).device(at::kMeta));
  expect_rejected("device mismatch", dsts,
                  "dsts[0] is on cpu but srcs[0] is on meta; move every tensor to one device",
                  [&] { verl::copy_ranges_(dsts, {on_meta}, ranges_tensor(ok)); });
  expect_rejected("unsupported device", dsts, "tensors on meta are not supported by this build of verl._C",
                  [&] { verl::copy_ranges_({on_meta}, {on_meta}, ranges_tensor(ok)); });
  const at::Tensor grid = random_tensor(at::kHalf, {30, 2}, rng);
  expect_rejected("non-contiguous src", dsts,
                  "srcs[0] must be a contiguous (strided) tensor, got shape [2, 30] with strides [1, 2]",
                  [&] { verl::copy_ranges_(dsts, {grid.t()}, ranges_tensor(ok)); });
  expect_rejected("undefined dst", dsts, "dsts[1] must be a defined tensor",
                  [&] { verl::copy_ranges_({dsts[0], at::Tensor()}, srcs, ranges_tensor(ok)); });
  expect_rejected("int32 ranges", dsts,
                  "ranges must be an int64 tensor of shape [N, 5] holding (src_index, src_offset, dst_index, "
                  "dst_offset, length) rows, got dtype torch.int32 and shape [1, 5]",
                  [&] { verl::copy_ranges_(dsts, srcs, ranges_tensor(ok).to(at::kInt)); });
  expect_rejected("ranges of shape [1, 3]", dsts, "got dtype torch.int64 and shape [1, 3]",
                  [&] { verl::copy_ranges_(dsts, srcs, ranges_tensor(ok).narrow(1, 0, 3)); });
  expect_rejected("ranges on another device", dsts,
                  "ranges is on meta but the tensors are on cpu; pass ranges on the cpu",
                  [&] { verl::copy_ranges_(dsts, srcs, ranges_tensor(ok).to(at::kMeta)); });
  expect_rejected("no destinations", {},
                  "range 0 (src_index=0, src_offset=0, dst_index=0, dst_offset=0, length=0) has dst_index "
                  "out of range; need 0 <= dst_index < len(dsts) = 0",
                  [&] { verl::copy_ranges_({}, srcs, ranges_tensor({{0, 0, 0, 0, 0}})); });

  at::Tensor leaf = at::zeros({2, 3});
  leaf.set_requires_grad(true);
  expect_rejected("dst requires grad", dsts,
                  "dsts[1] requires grad and grad mode is on; the copy bypasses autograd, so call it under "
                  "torch.no_grad() (or pass dsts[1].detach())",
                  [&] { verl::copy_ranges_({at::zeros({6}), leaf}, {at::arange(6.0)}, ranges_tensor(ok)); });
  {
    const c10::AutoGradMode no_grad(false);
    verl::copy_ranges_({leaf}, {at::arange(6.0)}, ranges_tensor({{0, 1, 0, 4, 2}}));
  }
  expect(leaf.detach().reshape({-1}).narrow(0, 4, 2).equal(at::arange(1.0, 3.0)),
         "a dst requiring grad is written with grad mode off");
}

}  // namespace

int main() {
  test_matches_bytewise_loop();
  test_in_place_permutation_through_shared_tensors();
  test_empty_calls();
  test_rejections();
  return report("copy_ranges_test");
}
