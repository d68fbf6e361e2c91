// Validation, CPU implementation and device dispatch of copy_shards_ (see copy_shards.h).
//
// The error messages of the per-range checks are mirrored word for word by the pure-PyTorch
// reference in verl/hybrid/copy_shards.py; tests compare the two.

#include "copy_shards.h"

#include <ATen/Parallel.h>
#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <string>

namespace verl {
namespace {

// CPU work item size: large enough that memcpy runs at full speed, small enough that one
// big range still spreads over all threads.
constexpr int64_t kCpuChunkBytes = 64 * 1024;
// Below this much work per task, starting threads costs more than the copy.
constexpr int64_t kCpuMinBytesPerTask = 256 * 1024;

[[noreturn]] void fail(const std::string& message) {
  throw std::invalid_argument("copy_shards_: " + message);
}

std::string shape_of(const at::Tensor& t) {
  std::ostringstream out;
  out << "[";
  for (int64_t d = 0; d < t.dim(); ++d) out << (d ? ", " : "") << t.size(d);
  out << "]";
  return out.str();
}

std::string strides_of(const at::Tensor& t) {
  std::ostringstream out;
  out << "[";
  for (int64_t d = 0; d < t.dim(); ++d) out << (d ? ", " : "") << t.stride(d);
  out << "]";
  return out.str();
}

void check_flat(const at::Tensor& t, const char* name) {
  if (t.layout() != at::kStrided || t.dim() != 1 || !t.is_contiguous()) {
    std::ostringstream out;
    out << name << " must be a flat (1-D contiguous, strided) tensor, got shape " << shape_of(t)
        << " with strides " << strides_of(t)
        << "; view a contiguous buffer as 1-D with .view(-1) (a copy made by .contiguous() "
           "or .reshape() would not receive the writes)";
    fail(out.str());
  }
}

std::string describe(int64_t index, int64_t s, int64_t d, int64_t n) {
  std::ostringstream out;
  out << "range " << index << " (src_offset=" << s << ", dst_offset=" << d << ", length=" << n
      << ")";
  return out.str();
}

}  // namespace

bool built_with_cuda() {
#ifdef VERL_WITH_CUDA
  return true;
#else
  return false;
#endif
}

std::vector<ByteRange> check_copy_shards_args(const at::Tensor& dst, const at::Tensor& src,
                                              const at::Tensor& ranges) {
  if (!dst.defined() || !src.defined() || !ranges.defined()) {
    fail("dst, src and ranges must all be defined tensors");
  }
  if (ranges.scalar_type() != at::kLong || ranges.dim() != 2 || ranges.size(1) != 3) {
    std::ostringstream out;
    out << "ranges must be an int64 tensor of shape [N, 3] holding (src_offset, dst_offset, "
           "length) rows, got dtype "
        << c10::toString(ranges.scalar_type()) << " and shape " << shape_of(ranges);
    fail(out.str());
  }
  if (dst.device() != src.device()) {
    std::ostringstream out;
    out << "dst is on " << dst.device() << " but src is on " << src.device()
        << "; move both to the same device";
    fail(out.str());
  }
  if (dst.scalar_type() != src.scalar_type()) {
    std::ostringstream out;
    out << "dst has dtype " << c10::toString(dst.scalar_type()) << " but src has dtype "
        << c10::toString(src.scalar_type()) << "; copy_shards_ does not convert, cast src first";
    fail(out.str());
  }
  check_flat(dst, "dst");
  check_flat(src, "src");
  const bool cuda = dst.device().is_cuda();
  if (!dst.device().is_cpu() && !(cuda && built_with_cuda())) {
    std::ostringstream out;
    out << "tensors on " << dst.device() << " are not supported by this build of verl._C "
        << (cuda ? "(built without CUDA: reinstall with a CUDA torch and toolkit present)"
                 : "(supported: cpu, and cuda when built with CUDA)");
    fail(out.str());
  }

  const at::Tensor host = ranges.cpu().contiguous();
  const int64_t* rows = host.const_data_ptr<int64_t>();
  const int64_t count = host.size(0);
  const int64_t src_numel = src.numel();
  const int64_t dst_numel = dst.numel();

  // Per-range bounds, in caller order, so the first bad range is the one reported.
  for (int64_t i = 0; i < count; ++i) {
    const int64_t s = rows[3 * i], d = rows[3 * i + 1], n = rows[3 * i + 2];
    if (n < 0) fail(describe(i, s, d, n) + " has a negative length");
    // Written as `offset > numel - n` so that huge values cannot overflow.
    if (s < 0 || s > src_numel - n) {
      std::ostringstream out;
      out << describe(i, s, d, n) << " reads outside src (numel " << src_numel
          << "); need 0 <= src_offset and src_offset + length <= src.numel()";
      fail(out.str());
    }
    if (d < 0 || d > dst_numel - n) {
      std::ostringstream out;
      out << describe(i, s, d, n) << " writes outside dst (numel " << dst_numel
          << "); need 0 <= dst_offset and dst_offset + length <= dst.numel()";
      fail(out.str());
    }
  }

  // Non-empty ranges by dst offset (ties in caller order): disjoint iff neighbours are.
  std::vector<int64_t> order;
  order.reserve(count);
  for (int64_t i = 0; i < count; ++i) {
    if (rows[3 * i + 2] > 0) order.push_back(i);
  }
  std::stable_sort(order.begin(), order.end(),
                   [rows](int64_t a, int64_t b) { return rows[3 * a + 1] < rows[3 * b + 1]; });
  for (size_t k = 0; k + 1 < order.size(); ++k) {
    const int64_t a = order[k], b = order[k + 1];
    const int64_t da = rows[3 * a + 1], na = rows[3 * a + 2];
    const int64_t db = rows[3 * b + 1], nb = rows[3 * b + 2];
    if (da + na > db) {
      std::ostringstream out;
      out << "ranges " << a << " and " << b << " overlap in dst (range " << a << " writes dst["
          << da << ":" << da + na << "], range " << b << " writes dst[" << db << ":" << db + nb
          << "]); dst ranges must be disjoint";
      fail(out.str());
    }
  }

  const int64_t elem = static_cast<int64_t>(dst.element_size());
  // src and dst may view one buffer (an in-place shuffle). Then no range may read memory
  // that any range writes: the copies run in parallel and in no fixed order.
  if (!order.empty()) {
    const auto src_base = reinterpret_cast<uintptr_t>(src.const_data_ptr());
    const auto dst_base = reinterpret_cast<uintptr_t>(dst.const_data_ptr());
    const bool buffers_overlap = src_base < dst_base + static_cast<uintptr_t>(dst_numel * elem) &&
                                 dst_base < src_base + static_cast<uintptr_t>(src_numel * elem);
    if (buffers_overlap) {
      std::vector<uintptr_t> write_end(order.size());  // ascending: dst ranges are disjoint
      for (size_t k = 0; k < order.size(); ++k) {
        const int64_t j = order[k];
        write_end[k] = dst_base + static_cast<uintptr_t>((rows[3 * j + 1] + rows[3 * j + 2]) * elem);
      }
      for (int64_t i = 0; i < count; ++i) {
        const int64_t s = rows[3 * i], n = rows[3 * i + 2];
        if (n == 0) continue;
        const uintptr_t begin = src_base + static_cast<uintptr_t>(s * elem);
        const uintptr_t end = begin + static_cast<uintptr_t>(n * elem);
        // First written range that ends after this read begins: the only candidate overlap.
        const size_t k = std::upper_bound(write_end.begin(), write_end.end(), begin) - write_end.begin();
        if (k == order.size()) continue;
        const int64_t j = order[k];
        const int64_t dj = rows[3 * j + 1], nj = rows[3 * j + 2];
        if (dst_base + static_cast<uintptr_t>(dj * elem) < end) {
          std::ostringstream out;
          out << "range " << i << " reads src[" << s << ":" << s + n
              << "], which shares memory with dst[" << dj << ":" << dj + nj
              << "] written by range " << j
              << "; when src and dst view one buffer, no range may read what another writes "
                 "(copy src to a separate buffer first)";
          fail(out.str());
        }
      }
    }
  }

  std::vector<ByteRange> out;
  out.reserve(order.size());
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = rows[3 * i + 2];
    if (n > 0) out.push_back(ByteRange{rows[3 * i] * elem, rows[3 * i + 1] * elem, n * elem});
  }
  return out;
}

std::vector<int64_t> chunk_starts(const std::vector<ByteRange>& ranges, int64_t chunk_bytes) {
  std::vector<int64_t> starts(ranges.size() + 1, 0);
  for (size_t r = 0; r < ranges.size(); ++r) {
    starts[r + 1] = starts[r] + (ranges[r].nbytes + chunk_bytes - 1) / chunk_bytes;
  }
  return starts;
}

void copy_byte_ranges_cpu(char* dst, const char* src, const std::vector<ByteRange>& ranges) {
  if (ranges.empty()) return;
  const std::vector<int64_t> starts = chunk_starts(ranges, kCpuChunkBytes);
  const int64_t total_chunks = starts.back();
  int64_t total_bytes = 0;
  for (const ByteRange& r : ranges) total_bytes += r.nbytes;
  // Many tiny ranges make tiny chunks: size tasks by bytes, not by chunk count.
  const int64_t bytes_per_chunk = std::max<int64_t>(1, total_bytes / total_chunks);
  const int64_t grain = std::max<int64_t>(1, kCpuMinBytesPerTask / bytes_per_chunk);

  at::parallel_for(0, total_chunks, grain, [&](int64_t begin, int64_t end) {
    // Last range whose first chunk is <= begin (skips empty ones by construction).
    size_t r = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
    for (int64_t c = begin; c < end; ++c) {
      while (starts[r + 1] <= c) ++r;
      const ByteRange& range = ranges[r];
      const int64_t offset = (c - starts[r]) * kCpuChunkBytes;
      const int64_t n = std::min(kCpuChunkBytes, range.nbytes - offset);
      std::memcpy(dst + range.dst_offset + offset, src + range.src_offset + offset,
                  static_cast<size_t>(n));
    }
  });
}

at::Tensor copy_shards_(const at::Tensor& dst, const at::Tensor& src, const at::Tensor& ranges) {
  const std::vector<ByteRange> byte_ranges = check_copy_shards_args(dst, src, ranges);
  if (byte_ranges.empty()) return dst;
  if (dst.device().is_cpu()) {
    copy_byte_ranges_cpu(static_cast<char*>(dst.data_ptr()),
                         static_cast<const char*>(src.const_data_ptr()), byte_ranges);
    return dst;
  }
#ifdef VERL_WITH_CUDA
  copy_byte_ranges_cuda(dst, src, byte_ranges);
  return dst;
#else
  // check_copy_shards_args refuses every other device.
  throw std::logic_error("copy_shards_: unreachable device branch");
#endif
}

}  // namespace verl
