#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace luwu {
void bind_optim(py::module_& m) { (void)m; }
}  // namespace luwu
