// CPU path and device dispatch of the byte-range copy core (see byte_copy.h).

#include "byte_copy.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace verl {
namespace {

// CPU work item size: large enough that memcpy runs at full speed, small enough that one
// big range still spreads over all threads.
constexpr int64_t kCpuChunkBytes = 64 * 1024;
// Below this much work per task, starting threads costs more than the copy.
constexpr int64_t kCpuMinBytesPerTask = 256 * 1024;

}  // namespace

bool built_with_cuda() {
#ifdef VERL_WITH_CUDA
  return true;
#else
  return false;
#endif
}

std::vector<int64_t> chunk_starts(const std::vector<CopyItem>& items, int64_t chunk_bytes) {
  std::vector<int64_t> starts(items.size() + 1, 0);
  for (size_t r = 0; r < items.size(); ++r) {
    starts[r + 1] = starts[r] + (items[r].nbytes + chunk_bytes - 1) / chunk_bytes;
  }
  return starts;
}

void copy_items_cpu(const std::vector<CopyItem>& items) {
  if (items.empty()) return;
  const std::vector<int64_t> starts = chunk_starts(items, kCpuChunkBytes);
  const int64_t total_chunks = starts.back();
  int64_t total_bytes = 0;
  for (const CopyItem& item : items) total_bytes += item.nbytes;
  // Many tiny items make tiny chunks: size tasks by bytes, not by chunk count.
  const int64_t bytes_per_chunk = std::max<int64_t>(1, total_bytes / total_chunks);
  const int64_t grain = std::max<int64_t>(1, kCpuMinBytesPerTask / bytes_per_chunk);

  at::parallel_for(0, total_chunks, grain, [&](int64_t begin, int64_t end) {
    // Last item whose first chunk is <= begin (items are non-empty, so it owns that chunk).
    size_t r = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
    for (int64_t c = begin; c < end; ++c) {
      while (starts[r + 1] <= c) ++r;
      const CopyItem& item = items[r];
      const int64_t offset = (c - starts[r]) * kCpuChunkBytes;
      const int64_t n = std::min(kCpuChunkBytes, item.nbytes - offset);
      std::memcpy(item.dst + offset, item.src + offset, static_cast<size_t>(n));
    }
  });
}

void copy_items(const c10::Device& device, const std::vector<CopyItem>& items) {
  if (items.empty()) return;
  if (device.is_cpu()) {
    copy_items_cpu(items);
    return;
  }
#ifdef VERL_WITH_CUDA
  if (device.is_cuda()) {
    copy_items_cuda(device, items);
    return;
  }
#endif
  // The callers' checks refuse every other device before building items.
  throw std::logic_error("verl byte copy: no copy path for this device");
}

}  // namespace verl
