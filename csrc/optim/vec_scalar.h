// One-lane "vector" used by the scalar ISA and for the tails of the SIMD ones.
//
// [Note: bit-exact tails] Sources are built with -ffp-contract=off and every
// fused multiply-add is an explicit fma(), so a tail element computed here is
// rounded exactly like a lane of the AVX2/AVX-512 loop and like torch's
// vectorised ops (lerp, addcmul and add-with-alpha are fmadd there, addcdiv is
// a multiply, a divide and an add).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace luwu::optim {
// Internal linkage: every ISA translation unit gets its own copy compiled for
// its own target, so the linker can never pick an AVX-512 body for the scalar path.
namespace {

inline float bits_to_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline uint32_t f32_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// torch's vectorised fp32 -> bf16: round to nearest even, every NaN -> 0xFFFF.
inline uint16_t f32_to_bf16(float f) {
  if (std::isnan(f)) return 0xFFFF;
  const uint32_t u = f32_to_bits(f);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// IEEE half conversions (the algorithm of FP16's fp16_ieee_{to,from}_fp32_value,
// which torch uses); round to nearest even, NaN stays NaN with its sign.
inline float f16_to_f32(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float exp_scale = bits_to_f32(0x7800000u);  // 2^-112
  const float normalized = bits_to_f32((two_w >> 4) + (0xE0u << 23)) * exp_scale;
  const float denormalized = bits_to_f32((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t result = sign | (two_w < (1u << 27) ? f32_to_bits(denormalized) : f32_to_bits(normalized));
  return bits_to_f32(result);
}

inline uint16_t f32_to_f16(float f) {
  const float scale_to_inf = bits_to_f32(0x77800000u);   // 2^112
  const float scale_to_zero = bits_to_f32(0x08800000u);  // 2^-110
  float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
  const uint32_t w = f32_to_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = bits_to_f32((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f32_to_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

struct VScalar {
  using F = float;
  static constexpr int kWidth = 1;
  static F set1(float x) { return x; }
  static F load(const float* p) { return *p; }
  static void store(float* p, F x) { *p = x; }
  static F load_bf16(const uint16_t* p) { return bits_to_f32(static_cast<uint32_t>(*p) << 16); }
  static F load_f16(const uint16_t* p) { return f16_to_f32(*p); }
  static void store_bf16(uint16_t* p, F x) { *p = f32_to_bf16(x); }
  static void store_f16(uint16_t* p, F x) { *p = f32_to_f16(x); }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F sqrt(F a) { return std::sqrt(a); }
  static F fmadd(F a, F b, F c) { return std::fma(a, b, c); }  // a * b + c, one rounding
  // Probe helpers: move bits without arithmetic.
  static F bxor(F a, F b) { return bits_to_f32(f32_to_bits(a) ^ f32_to_bits(b)); }
  static void store_trunc16(uint16_t* p, F x) { *p = static_cast<uint16_t>(f32_to_bits(x) >> 16); }
};

}  // namespace
}  // namespace luwu::optim
