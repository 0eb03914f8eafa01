// Bindings of the IO engine: argument conversion and GIL release only.
// Validation of user input (buffers, offsets, sizes) lives in luwu_rt/io/.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>

#include <system_error>

#include "io/aligned_buffer.h"
#include "io/engine.h"

namespace py = pybind11;

namespace luwu {
namespace {

using io::AlignedBuffer;
using io::Engine;

[[noreturn]] void raise_os_error(int err, const std::string& msg) {
  PyErr_SetObject(PyExc_OSError, py::make_tuple(err, msg).ptr());
  throw py::error_already_set();
}

std::unique_ptr<Engine> make_engine(const std::string& backend, unsigned queue_depth, uint64_t block_bytes,
                                    unsigned num_threads, size_t num_cached_files) {
  io::Backend b;
  if (backend == "io_uring") {
    b = io::Backend::kIoUring;
  } else if (backend == "threads") {
    b = io::Backend::kThreads;
  } else {
    throw py::value_error("backend must be 'io_uring' or 'threads', got '" + backend + "'");
  }
  try {
    py::gil_scoped_release release;
    return std::make_unique<Engine>(b, queue_depth, block_bytes, num_threads, num_cached_files);
  } catch (const std::system_error& e) {
    raise_os_error(e.code().value(), std::string("io_uring setup failed: ") + e.code().message());
  }
}

uint64_t submit(Engine& e, io::Op op, const std::string& path, int fd, uintptr_t buf, uint64_t offset,
                uint64_t nbytes, bool durable) {
  io::WaitResult err;
  uint64_t ticket;
  {
    py::gil_scoped_release release;
    ticket = e.submit(op, path, fd, buf, offset, nbytes, durable, &err);
  }
  if (ticket == 0) raise_os_error(err.err, err.msg);
  return ticket;
}

}  // namespace

void bind_io(py::module_& m) {
  py::enum_<io::Op>(m, "IOOp").value("READ", io::Op::kRead).value("WRITE", io::Op::kWrite);

  py::class_<Engine>(m, "IOEngine")
      .def(py::init(&make_engine), py::kw_only(), py::arg("backend"), py::arg("queue_depth"),
           py::arg("block_bytes"), py::arg("num_threads"), py::arg("num_cached_files"))
      .def_property_readonly("backend",
                             [](const Engine& e) {
                               return e.backend() == io::Backend::kIoUring ? "io_uring" : "threads";
                             })
      .def("submit", &submit, py::kw_only(), py::arg("op"), py::arg("path"), py::arg("fd"), py::arg("buf"),
           py::arg("offset"), py::arg("nbytes"), py::arg("durable"))
      .def(
          "wait",
          [](Engine& e, uint64_t ticket) {
            io::WaitResult r;
            {
              py::gil_scoped_release release;
              r = e.wait(ticket);
            }
            return py::make_tuple(r.err, r.msg, r.done_s);
          },
          py::arg("ticket"))
      .def("done", &Engine::done, py::arg("ticket"))
      .def("num_pending", &Engine::num_pending)
      .def("forget", &Engine::forget, py::arg("path"))
      .def("close", &Engine::close, py::call_guard<py::gil_scoped_release>());

  py::class_<AlignedBuffer>(m, "AlignedBuffer", py::buffer_protocol())
      .def(py::init<size_t, bool, bool>(), py::arg("nbytes"), py::kw_only(), py::arg("lock"), py::arg("huge_pages"))
      .def_property_readonly("address", [](const AlignedBuffer& b) { return reinterpret_cast<uintptr_t>(b.data()); })
      .def_property_readonly("nbytes", &AlignedBuffer::nbytes)
      .def_property_readonly("locked", &AlignedBuffer::locked)
      .def("set_release_hook", &AlignedBuffer::set_release_hook, py::arg("hook"))
      .def_buffer([](AlignedBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.nbytes())}, {1});
      });
}

}  // namespace luwu
