#include <pybind11/pybind11.h>

#include "store/crc32c.h"

namespace py = pybind11;

namespace luwu {

void bind_store(py::module_& m) {
  m.def(
      "crc32c",
      [](py::buffer data, uint32_t value) {
        py::buffer_info info = data.request();
        py::ssize_t expect = info.itemsize;
        for (py::ssize_t i = info.ndim - 1; i >= 0; --i) {
          if (info.shape[i] > 1 && info.strides[i] != expect)
            throw py::value_error("crc32c: data must be C-contiguous; pass a contiguous copy");
          expect *= info.shape[i];
        }
        const size_t nbytes = static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize);
        py::gil_scoped_release release;
        return crc32c(info.ptr, nbytes, value);
      },
      py::arg("data"), py::arg("value") = 0,
      "CRC-32C of a contiguous buffer, continuing from `value` (0 to start). Releases the GIL.");
}

}  // namespace luwu
