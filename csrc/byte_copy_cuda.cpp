// ATen side of the CUDA path of the byte-range copy core: device guard, the current stream,
// and the upload of the item table; the kernel itself is raw CUDA in byte_copy_kernel.cu.

#include "byte_copy.h"
#include "byte_copy_kernel.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
// c10's stream header, not ATen/cuda/CUDAContext.h: the latter pulls in cuBLAS/cuSPARSE
// headers this file does not need (and that partial toolkits lack).
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

namespace verl {

void copy_items_cuda(const c10::Device& device, const std::vector<CopyItem>& items) {
  const c10::cuda::CUDAGuard guard(device);
  const int64_t count = static_cast<int64_t>(items.size());
  const std::vector<int64_t> starts = chunk_starts(items, cuda::kChunkBytes);

  // One table, one host-to-device copy: pinned, so the copy is asynchronous and ordered
  // on the current stream before the kernel (the host allocator keeps the pinned block
  // alive until the copy has run).
  at::Tensor host = at::empty({4 * count + 1}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* table = host.mutable_data_ptr<int64_t>();
  for (int64_t r = 0; r < count; ++r) {
    table[r] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(items[r].src));
    table[count + r] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(items[r].dst));
    table[2 * count + r] = items[r].nbytes;
  }
  for (int64_t r = 0; r <= count; ++r) table[3 * count + r] = starts[r];
  const at::Tensor device_table = host.to(device, /*non_blocking=*/true);

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  C10_CUDA_CHECK(cuda::launch_copy_byte_ranges(device_table.const_data_ptr<int64_t>(), count,
                                               starts.back(), stream));
}

}  // namespace verl
