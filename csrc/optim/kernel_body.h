// The fused kernels, written once over a vector type V (see vec_scalar.h for the
// interface) and instantiated in one translation unit per ISA.
//
// Include this after `#pragma GCC target(...)` and after the V type it is used
// with; everything here has internal linkage (see vec_scalar.h).
#pragma once

#include <type_traits>

#include "optim/kernels.h"
#include "optim/vec_scalar.h"

namespace luwu::optim {
namespace {

template <class V, ElemType G>
inline typename V::F load_grad(const void* grad, int64_t i) {
  if constexpr (G == ElemType::kF32) {
    return V::load(static_cast<const float*>(grad) + i);
  } else if constexpr (G == ElemType::kBF16) {
    return V::load_bf16(static_cast<const uint16_t*>(grad) + i);
  } else {
    return V::load_f16(static_cast<const uint16_t*>(grad) + i);
  }
}

template <class V, ElemType O>
inline void store_out(void* out, int64_t i, typename V::F x) {
  if constexpr (O == ElemType::kF32) {
    V::store(static_cast<float*>(out) + i, x);
  } else if constexpr (O == ElemType::kBF16) {
    V::store_bf16(static_cast<uint16_t*>(out) + i, x);
  } else if constexpr (O == ElemType::kF16) {
    V::store_f16(static_cast<uint16_t*>(out) + i, x);
  }
}

// Mirrors torch.optim's single-tensor Adam/AdamW op for op (same roundings):
//   g = grad * grad_scale;  AdamW: p *= 1 - lr*wd;  Adam: g = g + wd*p (fmadd)
//   m = lerp(m, g, 1 - beta1)   (fmadd(w, g - m, m), or fmadd(w - 1, g - m, g) for w >= 0.5)
//   v = v * beta2;  v = fmadd((1 - beta2) * g, g, v)   (torch's addcmul)
//   p = p + (-step_size * m) / (sqrt(v) / sqrt(bc2) + eps)
//
// Stores are ordinary stores: p, m and v are read in the same pass, so their
// lines are already in cache and non-temporal stores save no read-for-ownership
// traffic; _mm512_stream_ps was tried on the 64Mi-parameter benchmark and
// showed no gain over the noise of a shared machine.
template <class V, ElemType G, ElemType O, bool kL2>
void adam_loop(const AdamArgs& a, int64_t begin, int64_t end) {
  using F = typename V::F;
  const F scale = V::set1(a.grad_scale), decay = V::set1(a.decay), wd = V::set1(a.weight_decay);
  const bool small_weight = a.beta1_weight < 0.5f;
  const F lerp_w = V::set1(small_weight ? a.beta1_weight : a.beta1_weight - 1.0f);
  const F beta2 = V::set1(a.beta2), omb2 = V::set1(a.one_minus_beta2);
  const F bc2 = V::set1(a.bc2_sqrt), eps = V::set1(a.eps), nss = V::set1(a.neg_step_size);
  for (int64_t i = begin; i < end; i += V::kWidth) {
    F g = V::mul(load_grad<V, G>(a.grad, i), scale);
    F p = V::load(a.param + i);
    if constexpr (kL2) {
      g = V::fmadd(p, wd, g);
    } else {
      p = V::mul(p, decay);
    }
    F m = V::load(a.exp_avg + i);
    const F diff = V::sub(g, m);
    m = V::fmadd(lerp_w, diff, small_weight ? m : g);
    F v = V::mul(V::load(a.exp_avg_sq + i), beta2);
    v = V::fmadd(V::mul(omb2, g), g, v);
    const F denom = V::add(V::div(V::sqrt(v), bc2), eps);
    p = V::add(p, V::div(V::mul(nss, m), denom));
    V::store(a.param + i, p);
    V::store(a.exp_avg + i, m);
    V::store(a.exp_avg_sq + i, v);
    store_out<V, O>(a.param_out, i, p);
  }
}

// torch.optim.SGD's single-tensor step:
//   g = grad * grad_scale;  g = g + wd*p (fmadd, when wd != 0)
//   first step: buf = g;  else buf = fmadd(g, 1 - dampening, buf * momentum)
//   g = nesterov ? fmadd(buf, momentum, g) : buf;   p = fmadd(g, -lr, p)
template <class V, ElemType G, ElemType O>
void sgd_loop(const SgdArgs& a, int64_t begin, int64_t end) {
  using F = typename V::F;
  const F scale = V::set1(a.grad_scale), wd = V::set1(a.weight_decay);
  const F mom = V::set1(a.momentum), omd = V::set1(a.one_minus_dampening), nlr = V::set1(a.neg_lr);
  const bool use_wd = a.weight_decay != 0.0f, use_buf = a.momentum_buffer != nullptr;
  for (int64_t i = begin; i < end; i += V::kWidth) {
    F g = V::mul(load_grad<V, G>(a.grad, i), scale);
    F p = V::load(a.param + i);
    if (use_wd) g = V::fmadd(p, wd, g);
    if (use_buf) {
      F buf = a.first_step ? g : V::fmadd(g, omd, V::mul(V::load(a.momentum_buffer + i), mom));
      V::store(a.momentum_buffer + i, buf);
      g = a.nesterov ? V::fmadd(buf, mom, g) : buf;
    }
    p = V::fmadd(g, nlr, p);
    V::store(a.param + i, p);
    store_out<V, O>(a.param_out, i, p);
  }
}

template <class V, ElemType G, ElemType O>
void probe_loop(const ProbeArgs& a, int64_t begin, int64_t end) {
  using F = typename V::F;
  for (int64_t i = begin; i < end; i += V::kWidth) {
    const F g = load_grad<V, G>(a.grad, i);
    const F p = V::load(a.param + i), m = V::load(a.exp_avg + i), v = V::load(a.exp_avg_sq + i);
    V::store(a.param + i, V::bxor(p, g));
    V::store(a.exp_avg + i, V::bxor(m, g));
    V::store(a.exp_avg_sq + i, V::bxor(v, g));
    if constexpr (O == ElemType::kF32) {
      V::store(static_cast<float*>(a.param_out) + i, p);
    } else if constexpr (O != ElemType::kNone) {
      V::store_trunc16(static_cast<uint16_t*>(a.param_out) + i, p);
    }
  }
}

// Runs the vector loop over the whole vectors of [begin, end) and the one-lane
// loop over the rest (bit-identical roundings, [Note: bit-exact tails]).
template <class V, class Args, class Fn, class FnTail>
void split_tail(const Args& a, int64_t begin, int64_t end, Fn body, FnTail tail) {
  const int64_t vec_end = begin + (end - begin) / V::kWidth * V::kWidth;
  body(a, begin, vec_end);
  tail(a, vec_end, end);
}

// Turns the run-time element types into template arguments.
template <template <class, ElemType, ElemType> class K, class V, class Args>
void dispatch_types(const Args& a, int64_t begin, int64_t end) {
  auto by_out = [&](auto gtag) {
    constexpr ElemType G = decltype(gtag)::value;
    switch (a.out_type) {
      case ElemType::kBF16: return K<V, G, ElemType::kBF16>::run(a, begin, end);
      case ElemType::kF16: return K<V, G, ElemType::kF16>::run(a, begin, end);
      case ElemType::kF32: return K<V, G, ElemType::kF32>::run(a, begin, end);
      default: return K<V, G, ElemType::kNone>::run(a, begin, end);
    }
  };
  switch (a.grad_type) {
    case ElemType::kBF16: return by_out(std::integral_constant<ElemType, ElemType::kBF16>{});
    case ElemType::kF16: return by_out(std::integral_constant<ElemType, ElemType::kF16>{});
    default: return by_out(std::integral_constant<ElemType, ElemType::kF32>{});
  }
}

template <class V, ElemType G, ElemType O>
struct AdamK {
  static void run(const AdamArgs& a, int64_t b, int64_t e) {
    if (a.l2) {
      split_tail<V>(a, b, e, adam_loop<V, G, O, true>, adam_loop<VScalar, G, O, true>);
    } else {
      split_tail<V>(a, b, e, adam_loop<V, G, O, false>, adam_loop<VScalar, G, O, false>);
    }
  }
};
template <class V, ElemType G, ElemType O>
struct SgdK {
  static void run(const SgdArgs& a, int64_t b, int64_t e) {
    split_tail<V>(a, b, e, sgd_loop<V, G, O>, sgd_loop<VScalar, G, O>);
  }
};
template <class V, ElemType G, ElemType O>
struct ProbeK {
  static void run(const ProbeArgs& a, int64_t b, int64_t e) {
    split_tail<V>(a, b, e, probe_loop<V, G, O>, probe_loop<VScalar, G, O>);
  }
};

}  // namespace
}  // namespace luwu::optim

// Defines the ISA's entry points declared in kernels.h.
#define LUWU_DEFINE_ISA(ns, V)                                                                          \
  namespace luwu::optim::ns {                                                                           \
  void adam(const AdamArgs& a, int64_t b, int64_t e) { dispatch_types<AdamK, V>(a, b, e); }            \
  void sgd(const SgdArgs& a, int64_t b, int64_t e) { dispatch_types<SgdK, V>(a, b, e); }               \
  void probe(const ProbeArgs& a, int64_t b, int64_t e) { dispatch_types<ProbeK, V>(a, b, e); }         \
  }
