// The byte-range copy core behind copy_shards_ and copy_ranges_ (copy_ranges.h): a list of
// already validated (src, dst, nbytes) work items copied in parallel on the CPU, or in ONE
// kernel launch on the current CUDA stream.
//
// Nothing here checks its input: the callers validate every range (bounds, disjoint writes,
// no read of written memory) before they build the items.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <vector>

namespace verl {

// One non-empty copy between two buffers on one device: nbytes > 0, the spans
// [src, src + nbytes) and [dst, dst + nbytes) valid, and no item's dst span overlapping
// another item's src or dst span (so items may run in any order and in parallel).
struct CopyItem {
  const char* src;
  char* dst;
  int64_t nbytes;
};

// Work split shared by the CPU and CUDA paths: item r owns the chunks
// [start[r], start[r + 1]) of `chunk_bytes` bytes each (its last one shorter).
// Returns items.size() + 1 entries; the last is the total number of chunks.
std::vector<int64_t> chunk_starts(const std::vector<CopyItem>& items, int64_t chunk_bytes);

// Copies the items between host buffers, in parallel over chunks (at::parallel_for).
void copy_items_cpu(const std::vector<CopyItem>& items);

// Copies the items on `device` (cpu, or cuda in a build with VERL_WITH_CUDA): the CPU path
// above, or one kernel launch on the device's current stream (asynchronous, like any
// kernel). Every item's memory must live on that device.
void copy_items(const c10::Device& device, const std::vector<CopyItem>& items);

// True when this build carries the CUDA kernel (compiled with VERL_WITH_CUDA).
bool built_with_cuda();

#ifdef VERL_WITH_CUDA
// ATen launcher in byte_copy_cuda.cpp: one upload of the item table, one kernel launch on
// the current stream of `device`.
void copy_items_cuda(const c10::Device& device, const std::vector<CopyItem>& items);
#endif

}  // namespace verl
