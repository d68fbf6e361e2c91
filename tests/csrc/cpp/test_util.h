// What the C++ unit tests of csrc/ share: a check counter, random tensors, byte views, the
// dtypes they cover, range tables, and the check that an invalid call throws
// std::invalid_argument with the expected message and writes nothing.
#pragma once

#include <ATen/ops/empty.h>
#include <c10/core/ScalarType.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace verl_test {

inline int g_failures = 0;
inline int g_checks = 0;

inline void expect(bool ok, const std::string& what) {
  ++g_checks;
  if (!ok) {
    ++g_failures;
    std::fprintf(stderr, "FAILED: %s\n", what.c_str());
  }
}

// Prints the tally as "<name>: N checks, M failed" (test_build.py reads it); the exit code.
inline int report(const char* name) {
  std::printf("%s: %d checks, %d failed\n", name, g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}

// Every dtype the kernels are tested on: they copy bytes, so each element size and the
// types with unusual bit patterns (bool, float8) count.
inline const std::vector<at::ScalarType>& all_dtypes() {
  static const std::vector<at::ScalarType> dtypes = {
      at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kChar, at::kShort, at::kInt,
      at::kLong, at::kByte, at::kBool, at::kComplexFloat, at::kComplexDouble,
      at::kFloat8_e4m3fn, at::kFloat8_e5m2};
  return dtypes;
}

// An int64 [N, W] table from rows of W values.
template <size_t W>
at::Tensor table_of(const std::vector<std::array<int64_t, W>>& rows) {
  at::Tensor t = at::empty({static_cast<int64_t>(rows.size()), static_cast<int64_t>(W)}, at::kLong);
  int64_t* p = t.mutable_data_ptr<int64_t>();
  for (size_t i = 0; i < rows.size(); ++i) std::copy(rows[i].begin(), rows[i].end(), p + W * i);
  return t;
}

// A contiguous tensor of random bytes (0/1 for bool, so every value is a valid bool).
inline at::Tensor random_tensor(at::ScalarType dtype, at::IntArrayRef shape, std::mt19937_64& rng) {
  at::Tensor t = at::empty(shape, dtype);
  auto* bytes = static_cast<unsigned char*>(t.data_ptr());
  const size_t n = static_cast<size_t>(t.nbytes());
  for (size_t i = 0; i < n; ++i) {
    bytes[i] = dtype == at::kBool ? static_cast<unsigned char>(rng() & 1) : static_cast<unsigned char>(rng());
  }
  return t;
}

inline at::Tensor random_tensor(at::ScalarType dtype, int64_t numel, std::mt19937_64& rng) {
  return random_tensor(dtype, at::IntArrayRef{numel}, rng);
}

inline std::vector<unsigned char> bytes_of(const at::Tensor& t) {
  const auto* p = static_cast<const unsigned char*>(t.const_data_ptr());
  return std::vector<unsigned char>(p, p + t.nbytes());
}

// Runs `call`, which must throw std::invalid_argument whose message holds `needle`, and
// must leave every tensor of `untouched` byte-for-byte as it was.
inline void expect_rejected(const std::string& name, const std::vector<at::Tensor>& untouched,
                            const std::string& needle, const std::function<void()>& call) {
  std::vector<std::vector<unsigned char>> before;
  for (const at::Tensor& t : untouched) before.push_back(bytes_of(t));
  std::string message;
  bool thrown = false;
  try {
    call();
  } catch (const std::invalid_argument& err) {
    thrown = true;
    message = err.what();
  }
  expect(thrown, name + ": std::invalid_argument expected");
  expect(message.find(needle) != std::string::npos,
         name + ": message '" + message + "' should contain '" + needle + "'");
  for (size_t k = 0; k < untouched.size(); ++k) {
    expect(bytes_of(untouched[k]) == before[k],
           name + ": tensor " + std::to_string(k) + " must be untouched");
  }
}

}  // namespace verl_test
