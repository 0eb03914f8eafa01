// Fused optimizer kernels: shared argument structs and the per-ISA entry points.
//
// Every kernel makes one pass over memory per element: gradient unscale
// (grad_scale), weight decay, the moment updates, the parameter update and the
// optional low-precision copy-out all happen while the element is in a register.
#pragma once

#include <cstdint>

namespace luwu::optim {

enum class ElemType : int { kNone = 0, kF32 = 1, kBF16 = 2, kF16 = 3 };
enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// Scalars are precomputed in double by the caller and rounded to float once,
// the way torch turns Python scalars into float operands of fp32 tensor ops.
struct AdamArgs {
  float* param = nullptr;
  const void* grad = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  void* param_out = nullptr;
  ElemType grad_type = ElemType::kF32;
  ElemType out_type = ElemType::kNone;
  bool l2 = false;               // Adam's L2 decay (grad += wd * p) instead of AdamW's decoupled decay
  float grad_scale = 1.0f;
  float decay = 1.0f;            // AdamW: 1 - lr * wd
  float weight_decay = 0.0f;     // Adam (L2): wd
  float beta1_weight = 0.1f;     // lerp weight 1 - beta1
  float beta2 = 0.999f;
  float one_minus_beta2 = 0.001f;
  float bc2_sqrt = 1.0f;         // sqrt(1 - beta2^step)
  float eps = 1e-8f;
  float neg_step_size = 0.0f;    // -lr / (1 - beta1^step)
};

struct SgdArgs {
  float* param = nullptr;
  const void* grad = nullptr;
  float* momentum_buffer = nullptr;  // null when momentum == 0
  void* param_out = nullptr;
  ElemType grad_type = ElemType::kF32;
  ElemType out_type = ElemType::kNone;
  bool first_step = false;  // torch initialises the buffer to the gradient on the first step
  bool nesterov = false;
  float grad_scale = 1.0f;
  float weight_decay = 0.0f;
  float momentum = 0.0f;
  float one_minus_dampening = 1.0f;
  float neg_lr = 0.0f;
};

// Moves the bytes of an Adam step (reads p, g, m, v; writes p, m, v and the
// copy-out) with no arithmetic: the memory-traffic ceiling for the kernels.
struct ProbeArgs {
  float* param = nullptr;
  const void* grad = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  void* param_out = nullptr;
  ElemType grad_type = ElemType::kF32;
  ElemType out_type = ElemType::kNone;
};

// Each function processes elements [begin, end); begin is a multiple of 16.
#define LUWU_DECLARE_ISA(ns)                                              \
  namespace ns {                                                          \
  void adam(const AdamArgs& a, int64_t begin, int64_t end);               \
  void sgd(const SgdArgs& a, int64_t begin, int64_t end);                 \
  void probe(const ProbeArgs& a, int64_t begin, int64_t end);             \
  }
LUWU_DECLARE_ISA(scalar)
LUWU_DECLARE_ISA(avx2)
LUWU_DECLARE_ISA(avx512)
#undef LUWU_DECLARE_ISA

// Dispatch (dispatch.cpp): best ISA of this CPU, and the multithreaded drivers.
Isa best_isa();
bool isa_supported(Isa isa);
const char* isa_name(Isa isa);
void run_adam(const AdamArgs& a, int64_t numel, Isa isa, int num_threads);
void run_sgd(const SgdArgs& a, int64_t numel, Isa isa, int num_threads);
void run_probe(const ProbeArgs& a, int64_t numel, Isa isa, int num_threads);

}  // namespace luwu::optim
