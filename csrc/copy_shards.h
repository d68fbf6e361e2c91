// copy_shards_: in-place, bounds-checked copy of many element ranges between two flat
// tensors, the primitive behind resharding weights from the training layout into the
// rollout layout (verl/hybrid/).
//
// Every range (src_offset, dst_offset, length) copies src[src_offset : src_offset + length]
// into dst[dst_offset : dst_offset + length], in element units. All ranges are validated
// before anything is written; an invalid call throws std::invalid_argument (a Python
// ValueError through pybind11) and leaves dst untouched.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace verl {

// One validated range with zero-length ranges dropped, in BYTES (offsets relative to the
// tensors' first element).
struct ByteRange {
  int64_t src_offset;
  int64_t dst_offset;
  int64_t nbytes;
};

// Checks every argument of copy_shards_ and returns the non-empty ranges in bytes, in the
// caller's order. Throws std::invalid_argument naming the offending range and offsets.
//   dst, src: 1-D contiguous, same dtype and device.
//   ranges:   int64 [N, 3] (src_offset, dst_offset, length), on any device.
std::vector<ByteRange> check_copy_shards_args(const at::Tensor& dst, const at::Tensor& src,
                                              const at::Tensor& ranges);

// Validates, then copies every range from src into dst; returns dst.
at::Tensor copy_shards_(const at::Tensor& dst, const at::Tensor& src, const at::Tensor& ranges);

// Work split shared by the CPU and CUDA paths: range r owns the chunks
// [chunk_start[r], chunk_start[r + 1]) of `chunk_bytes` bytes each (its last one shorter).
// Returns N + 1 entries; the last is the total number of chunks.
std::vector<int64_t> chunk_starts(const std::vector<ByteRange>& ranges, int64_t chunk_bytes);

// Copies validated byte ranges between two host buffers, in parallel over chunks
// (at::parallel_for).
void copy_byte_ranges_cpu(char* dst, const char* src, const std::vector<ByteRange>& ranges);

// True when this build carries the CUDA kernel (compiled with VERL_WITH_CUDA).
bool built_with_cuda();

#ifdef VERL_WITH_CUDA
// ATen launcher in copy_shards_cuda.cpp: one kernel launch on the current stream.
void copy_byte_ranges_cuda(const at::Tensor& dst, const at::Tensor& src,
                           const std::vector<ByteRange>& ranges);
#endif

}  // namespace verl
