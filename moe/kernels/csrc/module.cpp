// The extension module: binds the kernels of kernels.h for Python. Each kernel releases the GIL
// while it runs, as torch's own ops do: under DBO the other ubatch's thread and the communication
// threads keep running Python meanwhile.

#include <torch/extension.h>

#include <string>

#include "kernels.h"
#include "shm_comm.h"
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
  m.def("rotary_embedding", &moe_dbo_cpu::rotary_embedding,
        py::call_guard<py::gil_scoped_release>(),
        "Rotary embedding of query and key rows from a per-dtype factor table: (in_range, q, k)");
  m.def("pack_sent_rows", &moe_dbo_cpu::pack_sent_rows, py::call_guard<py::gil_scoped_release>(),
        "A dispatch's packed rows by destination rank: (packed, send_counts, send_token_idx)");
  m.def("unpack_row_ranges", &moe_dbo_cpu::unpack_row_ranges,
        py::call_guard<py::gil_scoped_release>(),
        "The packed rows of some row ranges as contiguous (topk_ids, topk_weights, hidden bytes)");
  // Same-host collectives (shm_comm.h; distributed/shm_transport.py drives them). Module-local
  // types: one process may load the builds of two ISAs (the tests do), each registering them.
  py::class_<moe_dbo_cpu::ShmWork, std::shared_ptr<moe_dbo_cpu::ShmWork>>(m, "ShmWork",
                                                                        py::module_local())
      .def("wait", &moe_dbo_cpu::ShmWork::wait, py::call_guard<py::gil_scoped_release>(),
           "Block until done or timeout_s; '' when done, else the error")
      .def("is_completed", &moe_dbo_cpu::ShmWork::is_completed)
      .def("published_at_issue", &moe_dbo_cpu::ShmWork::published_at_issue,
           "Whether issue published the first round (idle channel, free slot)");
  py::class_<moe_dbo_cpu::ShmComm, std::shared_ptr<moe_dbo_cpu::ShmComm>>(m, "ShmComm",
                                                                        py::module_local())
      .def(py::init<const std::string&, bool, int64_t, int64_t, int64_t, int64_t,
                    std::vector<int64_t>, std::vector<int64_t>>(),
           py::call_guard<py::gil_scoped_release>())
      .def_static("segment_bytes", &moe_dbo_cpu::ShmComm::segment_bytes)
      .def_static("unlink", &moe_dbo_cpu::ShmComm::unlink)
      .def("issue", &moe_dbo_cpu::ShmComm::issue,
           "Queue one exchange on a channel; its ShmWork")
      .def("close", &moe_dbo_cpu::ShmComm::close, py::call_guard<py::gil_scoped_release>());
}
