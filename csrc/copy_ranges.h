// copy_shards_ and copy_ranges_: in-place, bounds-checked copies of many element ranges
// between tensors, the primitives behind resharding weights from the training layout into
// the rollout layout (verl/hybrid/).
//
// copy_ranges_ is the general one: many source and many destination tensors, each range
// naming its tensors. copy_shards_ is its one-source, one-destination case, kept for its
// shorter [N, 3] table and its flat-tensor contract. Both share one validation (this
// file's .cpp) and one byte-range copy core (byte_copy.h).
//
// All ranges are validated before anything is written; an invalid call throws
// std::invalid_argument (a Python ValueError through pybind11) and leaves every destination
// untouched. The pure-PyTorch reference in verl/hybrid/range_checks.py mirrors the checks
// and their messages word for word.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace verl {

// For every row (src_offset, dst_offset, length) of the int64 [N, 3] table `ranges`,
// copies src[src_offset : src_offset + length] into dst[dst_offset : dst_offset + length],
// in element units; returns dst.
//   dst, src: flat (1-D contiguous) tensors, one dtype (any) and one device.
//   ranges:   on the CPU or on that device.
// Refused: out-of-bounds or negative ranges, overlapping dst ranges, any read of memory
// that some range writes (src and dst may view one buffer), dst requiring grad while grad
// mode is on.
at::Tensor copy_shards_(const at::Tensor& dst, const at::Tensor& src, const at::Tensor& ranges);

// For every row (src_index, src_offset, dst_index, dst_offset, length) of the int64 [N, 5]
// table `ranges`, copies srcs[src_index].view(-1)[src_offset : src_offset + length] into
// dsts[dst_index].view(-1)[dst_offset : dst_offset + length], in element units.
//   dsts, srcs: contiguous tensors of any shape (viewed flat), one dtype and one device;
//               a tensor may appear in both lists and several times.
//   ranges:     on the CPU or on that device.
// Refused: tensor indices out of range, out-of-bounds or negative ranges, destination
// ranges that overlap in memory (within one tensor, or across destinations sharing memory),
// any read of memory that some range writes, a destination requiring grad while grad mode
// is on.
void copy_ranges_(const std::vector<at::Tensor>& dsts, const std::vector<at::Tensor>& srcs,
                  const at::Tensor& ranges);

}  // namespace verl
