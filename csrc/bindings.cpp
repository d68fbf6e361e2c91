// Python module verl._C. Import torch before it (it links against libc10/libtorch).

#include <torch/csrc/utils/pybind.h>

#include "copy_shards.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "verl C++/CUDA kernels (csrc/); call them through verl.hybrid and friends.";
  m.def("copy_shards_", &verl::copy_shards_, py::arg("dst"), py::arg("src"), py::arg("ranges"),
        // The copy touches no Python object: let other threads run meanwhile.
        py::call_guard<py::gil_scoped_release>(),
        "copy_shards_(dst, src, ranges) -> dst\n\n"
        "Copy src[s:s+n] into dst[d:d+n] for every row (s, d, n) of ranges (int64 [N, 3],\n"
        "element units) between flat tensors of one dtype and device. Validates every range\n"
        "first; raises ValueError (nothing written) on out-of-bounds or overlapping ranges.");
  m.attr("with_cuda") = verl::built_with_cuda();
}
