// C++ unit tests of copy_shards_ (csrc/copy_ranges.cpp), run by CTest.
// Each check compares against a byte-by-byte loop over the ranges, for many dtypes and odd
// shapes, and checks that invalid calls throw std::invalid_argument and write nothing.

#include "copy_ranges.h"
#include "test_util.h"

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

using Row = std::array<int64_t, 3>;  // src_offset, dst_offset, length

at::Tensor ranges_tensor(const std::vector<Row>& rows) { return table_of(rows); }

// What copy_shards_ must produce: the ranges applied one element-byte at a time.
std::vector<unsigned char> expected_after(const at::Tensor& dst, const at::Tensor& src,
                                          const std::vector<Row>& rows) {
  std::vector<unsigned char> out = bytes_of(dst);
  const std::vector<unsigned char> in = bytes_of(src);
  const int64_t e = static_cast<int64_t>(dst.element_size());
  for (const Row& r : rows) {
    for (int64_t b = 0; b < r[2] * e; ++b) out[r[1] * e + b] = in[r[0] * e + b];
  }
  return out;
}

// Random valid ranges: disjoint dst pieces in shuffled order, any src offsets; includes
// zero-length and length-1 ranges. Returns the dst numel they need.
int64_t random_ranges(std::mt19937_64& rng, int64_t count, int64_t max_len, int64_t src_numel,
                      std::vector<Row>& rows) {
  rows.assign(count, Row{0, 0, 0});
  std::vector<int64_t> order(count);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  int64_t cursor = 0;
  for (int64_t k = 0; k < count; ++k) {
    Row& r = rows[order[k]];
    const int64_t pick = static_cast<int64_t>(rng() % 5);
    r[2] = pick == 0 ? 0 : pick == 1 ? 1 : static_cast<int64_t>(rng() % (max_len + 1));
    r[2] = std::min(r[2], src_numel);
    cursor += static_cast<int64_t>(rng() % 3);  // gaps stay untouched
    r[1] = cursor;
    cursor += r[2];
    r[0] = static_cast<int64_t>(rng() % (src_numel - r[2] + 1));
  }
  return cursor + static_cast<int64_t>(rng() % 4);
}

void test_matches_bytewise_loop() {
  std::mt19937_64 rng(1234);
  for (const at::ScalarType dtype : all_dtypes()) {
    // (ranges, max length, src numel): primes, one range, and ranges bigger than a CPU chunk.
    const std::vector<std::array<int64_t, 3>> shapes = {
        {1, 1, 1}, {7, 13, 97}, {61, 37, 1009}, {3, 70001, 140009}};
    for (const auto& shape : shapes) {
      std::vector<Row> rows;
      const at::Tensor src = random_tensor(dtype, shape[2], rng);
      const int64_t dst_numel = random_ranges(rng, shape[0], shape[1], shape[2], rows);
      const at::Tensor dst = random_tensor(dtype, dst_numel, rng);
      const std::vector<unsigned char> expected = expected_after(dst, src, rows);
      verl::copy_shards_(dst, src, ranges_tensor(rows));
      expect(bytes_of(dst) == expected, std::string("bytewise match for dtype ") +
                                            c10::toString(dtype) + " with " +
                                            std::to_string(shape[0]) + " ranges over src numel " +
                                            std::to_string(shape[2]));
    }
  }
}

void test_in_place_shuffle_of_one_buffer() {
  // src and dst views of one buffer: allowed when no read overlaps a write.
  std::mt19937_64 rng(7);
  const at::Tensor buffer = random_tensor(at::kInt, 101, rng);
  const std::vector<Row> rows = {{0, 60, 20}, {20, 80, 21}, {41, 41, 0}};
  const std::vector<unsigned char> expected = expected_after(buffer, buffer, rows);
  verl::copy_shards_(buffer, buffer, ranges_tensor(rows));
  expect(bytes_of(buffer) == expected, "disjoint in-place shuffle within one buffer");
}

void test_empty_ranges() {
  std::mt19937_64 rng(3);
  const at::Tensor dst = random_tensor(at::kFloat, 5, rng);
  const at::Tensor src = random_tensor(at::kFloat, 0, rng);
  const std::vector<unsigned char> before = bytes_of(dst);
  verl::copy_shards_(dst, src, at::empty({0, 3}, at::kLong));
  verl::copy_shards_(dst, src, ranges_tensor({{0, 5, 0}}));  // length 0 at the very end
  expect(bytes_of(dst) == before, "no ranges / zero-length ranges leave dst as it was");
}

void test_rejections() {
  std::mt19937_64 rng(99);
  const at::Tensor src = random_tensor(at::kHalf, 31, rng);
  const at::Tensor dst = random_tensor(at::kHalf, 29, rng);
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  // A valid first range each time: the error must name the second and nothing be written.
  const std::vector<std::pair<std::string, std::pair<Row, std::string>>> bad = {
      {"negative length", {{0, 10, -1}, "range 1 (src_offset=0, dst_offset=10, length=-1) has a negative length"}},
      {"src end past numel", {{25, 10, 7}, "range 1 (src_offset=25, dst_offset=10, length=7) reads outside src (numel 31)"}},
      {"negative src offset", {{-1, 10, 1}, "reads outside src"}},
      {"dst end past numel", {{0, 25, 5}, "range 1 (src_offset=0, dst_offset=25, length=5) writes outside dst (numel 29)"}},
      {"negative dst offset", {{0, -3, 1}, "writes outside dst"}},
      {"overflowing length", {{1, 1, kMax}, "reads outside src"}},
      {"overflowing offset", {{kMax, 1, 2}, "reads outside src"}},
      {"zero-length past end", {{32, 0, 0}, "reads outside src"}},
      {"dst overlap", {{20, 4, 3}, "ranges 0 and 1 overlap in dst (range 0 writes dst[0:5], range 1 writes dst[4:7])"}},
  };
  for (const auto& [name, row_and_needle] : bad) {
    const std::vector<Row> rows = {{0, 0, 5}, row_and_needle.first};
    expect_rejected(name, {dst}, row_and_needle.second,
                    [&] { verl::copy_shards_(dst, src, ranges_tensor(rows)); });
  }

  const at::Tensor buffer = random_tensor(at::kLong, 40, rng);
  expect_rejected("read overlaps a write in one buffer", {buffer},
                  "range 0 reads src[0:10], which shares memory with dst[5:15] written by range 1",
                  [&] { verl::copy_shards_(buffer, buffer, ranges_tensor({{0, 20, 10}, {30, 5, 10}})); });
  // The same memory reached through a view with a storage offset.
  const at::Tensor tail = buffer.narrow(0, 10, 30);
  expect_rejected("read overlaps a write through a view", {buffer}, "range 0 reads src[2:4], which shares memory with dst[12:14]",
                  [&] { verl::copy_shards_(buffer, tail, ranges_tensor({{2, 12, 2}})); });

  const std::vector<Row> ok = {{0, 0, 3}};
  expect_rejected("dtype mismatch", {dst}, "dst has dtype torch.float16 but src has dtype torch.float32", [&] {
    verl::copy_shards_(dst, random_tensor(at::kFloat, 31, rng), ranges_tensor(ok));
  });
  const at::Tensor grid = random_tensor(at::kHalf, 60, rng).view({30, 2});
  expect_rejected("non-contiguous src", {dst}, "src must be a flat (1-D contiguous",
                  [&] { verl::copy_shards_(dst, grid.select(1, 0), ranges_tensor(ok)); });
  expect_rejected("2-D dst", {grid}, "dst must be a flat (1-D contiguous",
                  [&] { verl::copy_shards_(grid, src, ranges_tensor(ok)); });
  expect_rejected("int32 ranges", {dst}, "ranges must be an int64 tensor of shape [N, 3]",
                  [&] { verl::copy_shards_(dst, src, ranges_tensor(ok).to(at::kInt)); });
  expect_rejected("ranges of shape [3]", {dst}, "got dtype torch.int64 and shape [3]",
                  [&] { verl::copy_shards_(dst, src, ranges_tensor(ok).view({3})); });
}

}  // namespace

int main() {
  test_matches_bytewise_loop();
  test_in_place_shuffle_of_one_buffer();
  test_empty_ranges();
  test_rejections();
  return report("copy_shards_test");
}
