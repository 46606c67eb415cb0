// The vectors attend_chunks.h is written over: 8 float lanes (AVX2) and 16 (AVX-512, compiled for it
// here, so it runs only where the CPU has it). Both give each lane the same operations; only the float
// sums across lanes run in another order.
#pragma once
#include <c10/util/Half.h>
#include <immintrin.h>
#include "simd.h"

namespace attend_vectors {

using Half = c10::Half;

struct Vec8 {
  using R = __m256;
  static constexpr int W = 8, REGS = 16, CHAINS = 1;  // CHAINS: see score_rows
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static R load(const Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void store(float* p, R x) { _mm256_storeu_ps(p, x); }
  static R zero() { return _mm256_setzero_ps(); }
  static R set1(float x) { return _mm256_set1_ps(x); }
  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static R sub(R a, R b) { return _mm256_sub_ps(a, b); }
  static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static R div(R a, R b) { return _mm256_div_ps(a, b); }
  static R max(R a, R b) { return _mm256_max_ps(a, b); }
  static R fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static R exp(R x) { return kvserve_simd::exp8(x); }
  static float hsum(R x) { return kvserve_simd::hsum(x); }
  static float hmax(R x) { return kvserve_simd::hmax(x); }
};

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq")
struct Vec16 {
  using R = __m512;
  static constexpr int W = 16, REGS = 32, CHAINS = 2;
  static R load(const float* p) { return _mm512_loadu_ps(p); }
  static R load(const Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static void store(float* p, R x) { _mm512_storeu_ps(p, x); }
  static R zero() { return _mm512_setzero_ps(); }
  static R set1(float x) { return _mm512_set1_ps(x); }
  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static R sub(R a, R b) { return _mm512_sub_ps(a, b); }
  static R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static R div(R a, R b) { return _mm512_div_ps(a, b); }
  static R max(R a, R b) { return _mm512_max_ps(a, b); }
  static R fma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static R exp(R x) {  // kvserve_simd::exp8's steps on 16 lanes
    x = _mm512_min_ps(_mm512_max_ps(x, set1(-87.3f)), set1(88.3f));
    const R fx = _mm512_roundscale_ps(fma(x, set1(1.44269504088896341f), set1(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, set1(0.693359375f), x);
    x = _mm512_fnmadd_ps(fx, set1(-2.12194440e-4f), x);
    R y = set1(1.9875691500e-4f);
    for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f}) y = fma(y, x, set1(c));
    y = fma(y, mul(x, x), add(x, set1(1.0f)));
    const __m512i pow2 = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return mul(y, _mm512_castsi512_ps(pow2));
  }
  static float hsum(R x) { return _mm512_reduce_add_ps(x); }
  static float hmax(R x) { return _mm512_reduce_max_ps(x); }
};
#pragma GCC pop_options

}  // namespace attend_vectors
