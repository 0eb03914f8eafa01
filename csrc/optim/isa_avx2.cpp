// AVX2 + FMA + F16C kernels (8 fp32 lanes). Compiled for that target only in
// this file; dispatch.cpp calls it only when the CPU reports the features.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#pragma GCC target("avx2,fma,f16c")

#include "optim/vec_scalar.h"

namespace luwu::optim {
namespace {

struct VAvx2 {
  using F = __m256;
  static constexpr int kWidth = 8;
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F load_bf16(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static F load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store_packed16(uint16_t* p, __m256i w) {
    // packus works per 128-bit lane; the permute puts the 8 halves in order.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(w, w), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static void store_bf16(uint16_t* p, F x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0xFFFF), is_nan);
    store_packed16(p, r);
  }
  static void store_f16(uint16_t* p, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F bxor(F a, F b) { return _mm256_xor_ps(a, b); }
  static void store_trunc16(uint16_t* p, F x) { store_packed16(p, _mm256_srli_epi32(_mm256_castps_si256(x), 16)); }
};

}  // namespace
}  // namespace luwu::optim

#include "optim/kernel_body.h"

LUWU_DEFINE_ISA(avx2, VAvx2)
