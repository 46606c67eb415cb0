// Activation rows quantized for the block-format products of quant_matmul.cpp: the includer provides
// hmax and hsum (simd.h) and wraps this in its namespace.
#pragma once

// Activation rows quantized per block of qk (32, or 16 for Q6_K) to int16 (scale d = amax/32767) or int8
// (d = amax/127, each k quad in the order of panel_formats.h's quads); s = d * sum(q), which a format's
// min term needs, and t = sum(q), with which an int8 product on signed weights offset to bytes by 128
// takes the offset's share back out exactly (the tiles of int16 rows never read it).
template <class X>
constexpr bool is_int8 = std::is_same_v<X, int8_t>;  // X, the activations' type: int8_t or int16_t
template <class X>
struct QuantizedRows {
  const X* q;          // [M, K]
  const float *d, *s;  // [M, K/qk] each
  const int32_t* t;    // [M, K/qk]
};

template <int64_t QKB, class X>
inline void quantize_block(const float* x, X* q, float* d, float* s, int32_t* t) {
  constexpr int V = QKB / 8;
  constexpr float LIMIT = is_int8<X> ? 127.0f : 32767.0f;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[V];
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < V; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  const float scale = hmax(amax) / LIMIT;
  const __m256 inv = _mm256_set1_ps(scale != 0.0f ? 1.0f / scale : 0.0f);
  __m256i n[V], total = _mm256_setzero_si256();
  for (int i = 0; i < V; ++i) {
    n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // round to nearest
    total = _mm256_add_epi32(total, n[i]);
  }
  if constexpr (is_int8<X>) {
    for (int i = 0; i < V; i += 4) {
      __m256i a[4];  // each quad k0 k2 k1 k3; zero past the block's end
      for (int h = 0; h < 4; ++h) a[h] = i + h < V ? _mm256_shuffle_epi32(n[i + h], 0xD8) : _mm256_setzero_si256();
      // two packs leave 32-bit units in the order a0 b0 c0 d0 | a1 b1 c1 d1; the permute restores a0 a1 b0 b1 ...
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a[0], a[1]), _mm256_packs_epi32(a[2], a[3]));
      const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      if (QKB - 8 * i >= 32) _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 8 * i), ordered);
      else _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 8 * i), _mm256_castsi256_si128(ordered));
    }
  } else {
    for (int i = 0; i < V; i += 2) {
      // packs interleaves 128-bit lanes (a0 b0 a1 b1); the permute restores a0 a1 b0 b1
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(n[i], n[i + 1]), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 8 * i), packed);
    }
  }
  const int32_t sum = static_cast<int32_t>(hsum(_mm256_cvtepi32_ps(total)));
  *d = scale;
  *s = scale * static_cast<float>(sum);
  *t = sum;
}

// x [M, K] quantized into q [M, K] and d, s, t [M, K/QKB], its blocks spread over the threads.
template <int64_t QKB, class X>
void quantize_rows_into(const at::Tensor& x, X* qp, float* dp, float* sp, int32_t* tp) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / QKB;
  const float* xp = x.data_ptr<float>();
  // rows are contiguous and K is a whole number of blocks, so block i of the flat array is block i % nb of row i / nb
  at::parallel_for(0, M * nb, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) quantize_block<QKB>(xp + i * QKB, qp + i * QKB, dp + i, sp + i, tp + i);
  });
}

// Into the calling thread's scratch, one per block size (valid until its next call): at batch 1, three
// at::empty calls for these cost about as much as quantizing the row.
template <int64_t QKB, class X>
QuantizedRows<X> quantize_rows(const at::Tensor& x) {
  thread_local std::vector<X> q;
  thread_local std::vector<float> d, s;
  thread_local std::vector<int32_t> t;
  const int64_t M = x.size(0), K = x.size(1), nb = K / QKB;
  q.resize(M * K), d.resize(M * nb), s.resize(M * nb), t.resize(M * nb);
  quantize_rows_into<QKB>(x, q.data(), d.data(), s.data(), t.data());
  return {q.data(), d.data(), s.data(), t.data()};
}
