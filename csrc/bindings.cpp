// Python module verl._C. Import torch before it (it links against libc10/libtorch).

#include <torch/csrc/utils/pybind.h>

#include "byte_copy.h"
#include "copy_ranges.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "verl C++/CUDA kernels (csrc/); call them through verl.hybrid and friends.";
  // The copies touch no Python object: let other threads run meanwhile (the arguments are
  // converted, and the lists of tensors built, before the GIL is released).
  m.def("copy_shards_", &verl::copy_shards_, py::arg("dst"), py::arg("src"), py::arg("ranges"),
        py::call_guard<py::gil_scoped_release>(),
        "copy_shards_(dst, src, ranges) -> dst\n\n"
        "Copy src[s:s+n] into dst[d:d+n] for every row (s, d, n) of ranges (int64 [N, 3],\n"
        "element units) between flat tensors of one dtype and device. Validates every range\n"
        "first; raises ValueError (nothing written) on out-of-bounds or overlapping ranges.");
  m.def("copy_ranges_", &verl::copy_ranges_, py::arg("dsts"), py::arg("srcs"), py::arg("ranges"),
        py::call_guard<py::gil_scoped_release>(),
        "copy_ranges_(dsts, srcs, ranges) -> None\n\n"
        "Copy srcs[i].view(-1)[s:s+n] into dsts[j].view(-1)[d:d+n] for every row (i, s, j, d, n)\n"
        "of ranges (int64 [N, 5], element units) between contiguous tensors of one dtype and\n"
        "device. Validates every range first; raises ValueError (nothing written) on bad\n"
        "indices, out-of-bounds or overlapping ranges, or reads of written memory.");
  m.attr("with_cuda") = verl::built_with_cuda();
}
