// Python bindings of the fused optimizer kernels: argument conversion and GIL
// release only. Tensors arrive as data pointers; luwu_rt/kernels/_cpp.py checks
// shapes, dtypes, devices and contiguity before calling in.
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "optim/kernels.h"
#include "optim/thread_pool.h"

namespace py = pybind11;

namespace luwu {
namespace {

using optim::ElemType;
using optim::Isa;

enum class AdamDecay : int { kDecoupled = 0, kL2 = 1 };

template <class T>
T* as_ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

void check_common(int64_t numel, int num_threads, Isa isa, std::initializer_list<uintptr_t> required) {
  if (numel < 0) throw std::invalid_argument("numel must be >= 0, got " + std::to_string(numel));
  if (num_threads < 1) throw std::invalid_argument("num_threads must be >= 1, got " + std::to_string(num_threads));
  if (!optim::isa_supported(isa)) {
    throw std::invalid_argument(std::string("isa ") + optim::isa_name(isa) + " is not supported by this CPU");
  }
  if (numel > 0) {
    for (uintptr_t p : required) {
      if (p == 0) throw std::invalid_argument("a required tensor pointer is null");
    }
  }
}

void check_out(ElemType out_type, uintptr_t param_out, int64_t numel) {
  if (out_type != ElemType::kNone && numel > 0 && param_out == 0) {
    throw std::invalid_argument("param_out is null but out_type is not NONE");
  }
}

void adam_step(uintptr_t param, uintptr_t grad, uintptr_t exp_avg, uintptr_t exp_avg_sq, uintptr_t param_out,
               int64_t numel, ElemType grad_type, ElemType out_type, AdamDecay decay, int64_t step, double lr,
               double beta1, double beta2, double eps, double weight_decay, double grad_scale, int num_threads,
               Isa isa) {
  check_common(numel, num_threads, isa, {param, grad, exp_avg, exp_avg_sq});
  check_out(out_type, param_out, numel);
  if (grad_type == ElemType::kNone) throw std::invalid_argument("grad_type must be F32, BF16 or F16");
  if (step < 1) throw std::invalid_argument("step must be >= 1, got " + std::to_string(step));
  optim::AdamArgs a;
  a.param = as_ptr<float>(param);
  a.grad = as_ptr<const void>(grad);
  a.exp_avg = as_ptr<float>(exp_avg);
  a.exp_avg_sq = as_ptr<float>(exp_avg_sq);
  a.param_out = as_ptr<void>(param_out);
  a.grad_type = grad_type;
  a.out_type = out_type;
  a.l2 = decay == AdamDecay::kL2 && weight_decay != 0.0;  // torch skips the add when wd == 0
  // The scalars are formed in double exactly as torch.optim forms them in Python.
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  a.grad_scale = static_cast<float>(grad_scale);
  a.decay = decay == AdamDecay::kDecoupled ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  a.weight_decay = static_cast<float>(weight_decay);
  a.beta1_weight = static_cast<float>(1.0 - beta1);
  a.beta2 = static_cast<float>(beta2);
  a.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  a.bc2_sqrt = static_cast<float>(std::pow(bias_correction2, 0.5));
  a.eps = static_cast<float>(eps);
  a.neg_step_size = static_cast<float>(-(lr / bias_correction1));
  optim::run_adam(a, numel, isa, num_threads);
}

void sgd_step(uintptr_t param, uintptr_t grad, uintptr_t momentum_buffer, uintptr_t param_out, int64_t numel,
              ElemType grad_type, ElemType out_type, bool first_step, bool nesterov, double lr, double momentum,
              double dampening, double weight_decay, double grad_scale, int num_threads, Isa isa) {
  check_common(numel, num_threads, isa, {param, grad});
  check_out(out_type, param_out, numel);
  if (grad_type == ElemType::kNone) throw std::invalid_argument("grad_type must be F32, BF16 or F16");
  if (momentum != 0.0 && numel > 0 && momentum_buffer == 0) {
    throw std::invalid_argument("momentum_buffer is null but momentum != 0");
  }
  optim::SgdArgs a;
  a.param = as_ptr<float>(param);
  a.grad = as_ptr<const void>(grad);
  a.momentum_buffer = momentum != 0.0 ? as_ptr<float>(momentum_buffer) : nullptr;
  a.param_out = as_ptr<void>(param_out);
  a.grad_type = grad_type;
  a.out_type = out_type;
  a.first_step = first_step;
  a.nesterov = nesterov;
  a.grad_scale = static_cast<float>(grad_scale);
  a.weight_decay = static_cast<float>(weight_decay);
  a.momentum = static_cast<float>(momentum);
  a.one_minus_dampening = static_cast<float>(1.0 - dampening);
  a.neg_lr = static_cast<float>(-lr);
  optim::run_sgd(a, numel, isa, num_threads);
}

void traffic_probe(uintptr_t param, uintptr_t grad, uintptr_t exp_avg, uintptr_t exp_avg_sq, uintptr_t param_out,
                   int64_t numel, ElemType grad_type, ElemType out_type, int num_threads, Isa isa) {
  check_common(numel, num_threads, isa, {param, grad, exp_avg, exp_avg_sq});
  check_out(out_type, param_out, numel);
  optim::ProbeArgs a{as_ptr<float>(param), as_ptr<const void>(grad), as_ptr<float>(exp_avg),
                     as_ptr<float>(exp_avg_sq), as_ptr<void>(param_out), grad_type, out_type};
  optim::run_probe(a, numel, isa, num_threads);
}

}  // namespace

void bind_optim(py::module_& m) {
  py::enum_<ElemType>(m, "OptimDType", "element type of a kernel operand")
      .value("NONE", ElemType::kNone)
      .value("F32", ElemType::kF32)
      .value("BF16", ElemType::kBF16)
      .value("F16", ElemType::kF16);
  py::enum_<Isa>(m, "OptimIsa", "SIMD instruction set of the optimizer kernels")
      .value("SCALAR", Isa::kScalar)
      .value("AVX2", Isa::kAvx2)
      .value("AVX512", Isa::kAvx512);
  py::enum_<AdamDecay>(m, "AdamDecay", "weight decay of adam_step: decoupled (AdamW) or L2 (Adam)")
      .value("DECOUPLED", AdamDecay::kDecoupled)
      .value("L2", AdamDecay::kL2);

  m.def("optim_best_isa", &optim::best_isa, "the fastest ISA this CPU supports");
  m.def("optim_isa_supported", &optim::isa_supported, py::arg("isa"));
  m.def(
      "optim_set_spin_micros",
      [](int64_t micros) {
        if (micros < 0) throw std::invalid_argument("micros must be >= 0, got " + std::to_string(micros));
        optim::ThreadPool::instance().set_spin_micros(micros);
      },
      py::arg("micros"), "how long the kernels' threads poll for work before sleeping (tuning)");
  using namespace pybind11::literals;
  m.def("optim_adam_step", &adam_step, py::call_guard<py::gil_scoped_release>(), py::kw_only(), "param"_a,
        "grad"_a, "exp_avg"_a, "exp_avg_sq"_a, "param_out"_a, "numel"_a, "grad_type"_a, "out_type"_a, "decay"_a,
        "step"_a, "lr"_a, "beta1"_a, "beta2"_a, "eps"_a, "weight_decay"_a, "grad_scale"_a, "num_threads"_a,
        "isa"_a, "Fused Adam/AdamW step over fp32 param/exp_avg/exp_avg_sq at the given addresses, in place.");
  m.def("optim_sgd_step", &sgd_step, py::call_guard<py::gil_scoped_release>(), py::kw_only(), "param"_a, "grad"_a,
        "momentum_buffer"_a, "param_out"_a, "numel"_a, "grad_type"_a, "out_type"_a, "first_step"_a, "nesterov"_a,
        "lr"_a, "momentum"_a, "dampening"_a, "weight_decay"_a, "grad_scale"_a, "num_threads"_a, "isa"_a,
        "Fused SGD (momentum, dampening, Nesterov, weight decay) step, in place.");
  m.def("optim_traffic_probe", &traffic_probe, py::call_guard<py::gil_scoped_release>(), py::kw_only(), "param"_a,
        "grad"_a, "exp_avg"_a, "exp_avg_sq"_a, "param_out"_a, "numel"_a, "grad_type"_a, "out_type"_a,
        "num_threads"_a, "isa"_a,
        "Moves the bytes of an Adam step with no arithmetic (XORs the gradient into p, m, v): the memory ceiling.");
}

}  // namespace luwu
