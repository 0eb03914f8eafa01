// AVX-512 (F + BW) kernels, 16 fp32 lanes. Compiled for that target only in
// this file; dispatch.cpp calls it only when the CPU reports the features.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")

#include "optim/vec_scalar.h"

namespace luwu::optim {
namespace {

struct VAvx512 {
  using F = __m512;
  static constexpr int kWidth = 16;
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F load_bf16(const uint16_t* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static F load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store_bf16(uint16_t* p, F x) {
    // Same sequence as torch's cvtfp32_bf16 (round to nearest even, NaN -> 0xFFFF),
    // rather than vcvtneps2bf16, whose NaN encoding differs from torch's.
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    const __mmask16 ordered = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q);
    const __m512i out = _mm512_mask_blend_epi32(ordered, _mm512_set1_epi32(0xFFFF), r);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(out));
  }
  static void store_f16(uint16_t* p, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F bxor(F a, F b) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  }
  static void store_trunc16(uint16_t* p, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16)));
  }
};

}  // namespace
}  // namespace luwu::optim

#include "optim/kernel_body.h"

LUWU_DEFINE_ISA(avx512, VAvx512)
