// ATen side of the CUDA path of copy_shards_: device guard, the current stream, and the
// upload of the range table; the kernel itself is raw CUDA in copy_shards_kernel.cu.

#include "copy_shards.h"
#include "copy_shards_kernel.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
// c10's stream header, not ATen/cuda/CUDAContext.h: the latter pulls in cuBLAS/cuSPARSE
// headers this file does not need (and that partial toolkits lack).
#include <c10/cuda/CUDAStream.h>

namespace verl {

void copy_byte_ranges_cuda(const at::Tensor& dst, const at::Tensor& src,
                           const std::vector<ByteRange>& ranges) {
  const c10::cuda::CUDAGuard guard(dst.device());
  const int64_t count = static_cast<int64_t>(ranges.size());
  const std::vector<int64_t> starts = chunk_starts(ranges, cuda::kChunkBytes);

  // One table, one host-to-device copy: pinned, so the copy is asynchronous and ordered
  // on the current stream before the kernel (the host allocator keeps the pinned block
  // alive until the copy has run).
  at::Tensor host = at::empty({4 * count + 1}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* table = host.mutable_data_ptr<int64_t>();
  for (int64_t r = 0; r < count; ++r) {
    table[r] = ranges[r].src_offset;
    table[count + r] = ranges[r].dst_offset;
    table[2 * count + r] = ranges[r].nbytes;
  }
  for (int64_t r = 0; r <= count; ++r) table[3 * count + r] = starts[r];
  const at::Tensor meta = host.to(dst.device(), /*non_blocking=*/true);

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dst.device().index()).stream();
  C10_CUDA_CHECK(cuda::launch_copy_byte_ranges(static_cast<char*>(dst.data_ptr()),
                                               static_cast<const char*>(src.const_data_ptr()),
                                               meta.const_data_ptr<int64_t>(), count,
                                               starts.back(), stream));
}

}  // namespace verl
