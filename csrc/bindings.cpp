// pybind11 module luwu_rt._C. Each component registers its own functions;
// bindings only convert arguments and release the GIL (DESIGN.md, style 8).
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace luwu {
void bind_io(py::module_& m);
void bind_optim(py::module_& m);
void bind_store(py::module_& m);
}  // namespace luwu

PYBIND11_MODULE(_C, m) {
  m.doc() = "luwu_rt native core: async file IO engine, fused optimizer kernels, checksums";
  luwu::bind_io(m);
  luwu::bind_optim(m);
  luwu::bind_store(m);
}
