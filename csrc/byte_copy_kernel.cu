// CUDA kernel of the byte-range copy core: many (src, dst, nbytes) items, one launch (see
// byte_copy_kernel.h).
//
// The items are cut into fixed-size chunks and blocks stride over the chunk list, so one
// huge range and ten thousand tiny ones load the GPU alike. Each block finds its item by
// binary search over the chunk prefix sums, then its threads copy the chunk with the widest
// word that src and dst share an alignment for (16 bytes for any element type whose buffers
// are 16-byte aligned, down to single bytes).

#include "byte_copy_kernel.h"

#include <cuda_runtime.h>

#include <cstdint>

namespace verl {
namespace cuda {
namespace {

constexpr int kThreads = 256;
// Enough resident blocks per SM to hide memory latency; more only adds scheduling.
constexpr int kBlocksPerSm = 8;

// __restrict__ holds: the host checks guarantee that no item reads memory any item writes.
template <typename Word>
__device__ __forceinline__ void copy_words(char* __restrict__ dst, const char* __restrict__ src,
                                           int64_t nbytes) {
  constexpr int64_t kWord = static_cast<int64_t>(sizeof(Word));
  int64_t head = (kWord - static_cast<int64_t>(reinterpret_cast<uintptr_t>(dst) % kWord)) % kWord;
  if (head > nbytes) head = nbytes;
  for (int64_t i = threadIdx.x; i < head; i += blockDim.x) dst[i] = src[i];
  const int64_t words = (nbytes - head) / kWord;
  Word* dst_words = reinterpret_cast<Word*>(dst + head);
  const Word* src_words = reinterpret_cast<const Word*>(src + head);
  for (int64_t i = threadIdx.x; i < words; i += blockDim.x) dst_words[i] = src_words[i];
  for (int64_t i = head + words * kWord + threadIdx.x; i < nbytes; i += blockDim.x) dst[i] = src[i];
}

__device__ __forceinline__ void copy_chunk(char* __restrict__ dst, const char* __restrict__ src,
                                           int64_t nbytes) {
  // Same offset from a word boundary on both sides: after `head` bytes both are aligned.
  const uintptr_t skew = reinterpret_cast<uintptr_t>(dst) ^ reinterpret_cast<uintptr_t>(src);
  if ((skew & 15) == 0) {
    copy_words<uint4>(dst, src, nbytes);
  } else if ((skew & 7) == 0) {
    copy_words<uint2>(dst, src, nbytes);
  } else if ((skew & 3) == 0) {
    copy_words<unsigned int>(dst, src, nbytes);
  } else if ((skew & 1) == 0) {
    copy_words<unsigned short>(dst, src, nbytes);
  } else {
    copy_words<unsigned char>(dst, src, nbytes);
  }
}

__global__ void __launch_bounds__(kThreads)
    copy_byte_ranges_kernel(const int64_t* __restrict__ table, int64_t count, int64_t total_chunks) {
  const int64_t* src_address = table;
  const int64_t* dst_address = table + count;
  const int64_t* nbytes = table + 2 * count;
  const int64_t* chunk_start = table + 3 * count;
  for (int64_t chunk = blockIdx.x; chunk < total_chunks; chunk += gridDim.x) {
    // Last item r with chunk_start[r] <= chunk; empty items were dropped on the host, so
    // that item owns this chunk.
    int64_t lo = 0, hi = count - 1;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo + 1) / 2;
      if (chunk_start[mid] <= chunk) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const int64_t begin = (chunk - chunk_start[lo]) * kChunkBytes;
    const int64_t remaining = nbytes[lo] - begin;
    const int64_t n = remaining < kChunkBytes ? remaining : kChunkBytes;
    char* dst = reinterpret_cast<char*>(static_cast<uintptr_t>(dst_address[lo]));
    const char* src = reinterpret_cast<const char*>(static_cast<uintptr_t>(src_address[lo]));
    copy_chunk(dst + begin, src + begin, n);
  }
}

}  // namespace

cudaError_t launch_copy_byte_ranges(const int64_t* table, int64_t count, int64_t total_chunks,
                                    cudaStream_t stream) {
  if (count == 0 || total_chunks == 0) return cudaSuccess;
  int device = 0;
  int sms = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) return status;
  status = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (status != cudaSuccess) return status;
  const int64_t max_blocks = static_cast<int64_t>(sms) * kBlocksPerSm;
  const unsigned int blocks =
      static_cast<unsigned int>(total_chunks < max_blocks ? total_chunks : max_blocks);
  copy_byte_ranges_kernel<<<blocks, kThreads, 0, stream>>>(table, count, total_chunks);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace verl
