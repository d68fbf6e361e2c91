// Raw-pointer interface of the copy_shards_ CUDA kernel (copy_shards_kernel.cu). It uses
// only the CUDA runtime API, so the kernel file compiles standalone with `nvcc -c`; the ATen
// side (stream, device guard, metadata upload) lives in copy_shards_cuda.cpp.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace verl {
namespace cuda {

// Bytes one block copies per work item; a multiple of 16 so every chunk after a range's
// first keeps that range's alignment.
constexpr int64_t kChunkBytes = 16 * 1024;

// Copies `count` byte ranges from src to dst in ONE kernel launch on `stream`.
// `meta` is device memory holding 4 * count + 1 int64 values, in this order:
//   src_offset[count], dst_offset[count], nbytes[count]  (bytes, every nbytes > 0),
//   chunk_start[count + 1]  (range r owns chunks [chunk_start[r], chunk_start[r + 1]) of
//                            kChunkBytes; chunk_start[count] is the total).
// Returns the launch status (cudaSuccess when there is nothing to copy).
cudaError_t launch_copy_byte_ranges(char* dst, const char* src, const int64_t* meta, int64_t count,
                                    int64_t total_chunks, cudaStream_t stream);

}  // namespace cuda
}  // namespace verl
