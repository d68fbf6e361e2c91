// Raw-pointer interface of the byte-range copy kernel (byte_copy_kernel.cu). It uses only
// the CUDA runtime API, so the kernel file compiles standalone with `nvcc -c`; the ATen side
// (stream, device guard, table upload) lives in byte_copy_cuda.cpp.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace verl {
namespace cuda {

// Bytes one block copies per work item; a multiple of 16 so every chunk after an item's
// first keeps that item's alignment.
constexpr int64_t kChunkBytes = 16 * 1024;

// Copies `count` byte ranges in ONE kernel launch on `stream`. Each item has its own source
// and destination address, so one launch serves one buffer to one buffer (copy_shards_) and
// many tensors to many tensors (copy_ranges_) alike.
// `table` is device memory holding 4 * count + 1 int64 values, in this order:
//   src_address[count], dst_address[count]  (device addresses, as integers),
//   nbytes[count]                           (every nbytes > 0),
//   chunk_start[count + 1]  (item r owns chunks [chunk_start[r], chunk_start[r + 1]) of
//                            kChunkBytes; chunk_start[count] is the total).
// Returns the launch status (cudaSuccess when there is nothing to copy).
cudaError_t launch_copy_byte_ranges(const int64_t* table, int64_t count, int64_t total_chunks,
                                    cudaStream_t stream);

}  // namespace cuda
}  // namespace verl
