// The extension module: binds the kernels of kernels.h for Python. Each kernel releases the GIL
// while it runs, as torch's own ops do: under DBO the other ubatch's thread and the communication
// threads keep running Python meanwhile.

#include <torch/extension.h>

#include <string>

#include "kernels.h"
#include "vec_common.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def(
      "isa", [] { return std::string(moe_dbo_cpu::isa_name()); },
      "The ISA the build was compiled for: 'avx512_bf16', 'avx512', 'avx2' or 'default'");
  m.def("paged_attention", &moe_dbo_cpu::paged_attention,
        py::call_guard<py::gil_scoped_release>(),
        "Paged attention over the cache in place (CPU): writes out rows of req_ids' requests");
  m.def("fused_moe", &moe_dbo_cpu::fused_moe, py::call_guard<py::gil_scoped_release>(),
        "SwiGLU experts over routed rows, weighted and summed per token (CPU, packed weights)");
  m.def("fused_moe_batched", &moe_dbo_cpu::fused_moe_batched,
        py::call_guard<py::gil_scoped_release>(),
        "SwiGLU experts over the [E, M, H] batched layout, unweighted (CPU, packed weights)");
}
