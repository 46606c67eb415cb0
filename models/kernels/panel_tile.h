// The panel tile of quant_matmul.cpp, for CPUs without AVX-512 (those with it run wide_tile.h and
// packed_wide_tile.h, bitwise the same: the integer sums are exact). The includer defines the formats,
// GROUP, PANEL, TileFn, is_int8, panel_bytes and prefetch_share, and wraps this in a namespace of its own.

// sum + lo . x0 + hi . x1, in int32 lanes (vpmaddwd: 16 multiply-adds, pairwise summed); dot1 one of them.
inline __m256i dot2(__m256i sum, __m256i lo, __m256i x0, __m256i hi, __m256i x1) {
  return _mm256_add_epi32(sum, _mm256_add_epi32(_mm256_madd_epi16(lo, x0), _mm256_madd_epi16(hi, x1)));
}
inline __m256i dot1(__m256i sum, __m256i lo, __m256i x0) { return _mm256_add_epi32(sum, _mm256_madd_epi16(lo, x0)); }

// sum + the 32 products of a chunk's k quads w (bytes) and a row's quad x (int8) (vpmaddubsw: pairwise int16
// sums, which never saturate for these quants, then vpmaddwd by ones); signed quads move their signs onto x.
template <bool SIGNED>
inline __m256i dot4(__m256i sum, __m256i w, __m256i x) {
  const __m256i pairs = SIGNED ? _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)) : _mm256_maddubs_epi16(w, x);
  return _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// out[r][0..8 * GROUP) for R activation rows (int16 or int8, X) by the GROUP panels from q (each nb blocks):
// per block, R x GROUP int32 sums over its k pairs (or quads), then acc += float(sum) * (d_w * d_x)
// (+ m_w * s_x). `ahead`, if not null, is prefetched over the blocks: the weight this thread reads next,
// when the tile is its one pass over these panels.
template <class F, class X, int R>
inline void tile(const uint8_t* q, int64_t nb, const X* xq, const float* xd, const float* xs, const int32_t*, int64_t K,
                 float* out, int64_t ldo, int64_t width, const uint8_t* ahead) {
  constexpr int C = GROUP;
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const int64_t next = panel_bytes<F>(nb);  // from one panel to the next
  for (int64_t b = 0; b < nb; ++b) {
    if (ahead != nullptr) prefetch_share<F>(ahead, b);
    // With one row, each sum would be a chain of dependent multiply-adds, which their latency paces below
    // the read bandwidth: there they go to four sums, added at the end (exact: integer sums do not depend
    // on how they are split).
    constexpr int CHAINS = R == 1 ? 4 : 1;
    __m256i sum[R][C], part[CHAINS][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) sum[r][c] = _mm256_setzero_si256();
    for (int h = 0; h < CHAINS; ++h)
      for (int c = 0; c < C; ++c) part[h][c] = _mm256_setzero_si256();
    const uint8_t* qb = F::block(q, b);  // block b of the first panel; the others' lie `next` apart
    const int32_t* xb[R];  // each row's block as k pairs (int16) or quads (int8)
    for (int r = 0; r < R; ++r) xb[r] = reinterpret_cast<const int32_t*>(xq + r * K + b * F::qk);
    static_assert(F::qk / 4 % 2 == 0, "chunks come in pairs");
    if constexpr (is_int8<X>) {
      constexpr bool SIGNED = is_signed_bytes<F>;
#pragma GCC unroll 8
      for (int64_t j = 0; j < F::qk / 4; ++j) {
        __m256i w[C];
        for (int c = 0; c < C; ++c) w[c] = quads<F>(qb + c * next, j);
        for (int r = 0; r < R; ++r) {
          const __m256i x = _mm256_set1_epi32(xb[r][j]);
          for (int c = 0; c < C; ++c) {
            if constexpr (CHAINS == 4) part[j % 4][c] = dot4<SIGNED>(part[j % 4][c], w[c], x);
            else sum[r][c] = dot4<SIGNED>(sum[r][c], w[c], x);
          }
        }
      }
    } else {
      for (int64_t j0 = 0; j0 < F::qk / 4; j0 += 2) {
#pragma GCC unroll 2
        for (int64_t odd = 0; odd < 2; ++odd) {
          const int64_t j = j0 + odd;
          __m256i lo[C], hi[C];
          for (int c = 0; c < C; ++c) F::pairs(qb + c * next, j, lo[c], hi[c]);
          for (int r = 0; r < R; ++r) {
            const __m256i x0 = _mm256_set1_epi32(xb[r][2 * j]), x1 = _mm256_set1_epi32(xb[r][2 * j + 1]);
            for (int c = 0; c < C; ++c) {
              if constexpr (CHAINS == 4) {
                part[2 * odd][c] = dot1(part[2 * odd][c], lo[c], x0);
                part[2 * odd + 1][c] = dot1(part[2 * odd + 1][c], hi[c], x1);
              } else {
                sum[r][c] = dot2(sum[r][c], lo[c], x0, hi[c], x1);
              }
            }
          }
        }
      }
    }
    if constexpr (CHAINS == 4)
      for (int c = 0; c < C; ++c)
        sum[0][c] = _mm256_add_epi32(_mm256_add_epi32(part[0][c], part[1][c]), _mm256_add_epi32(part[2][c], part[3][c]));
    __m256 dw[C], mw[C];
    for (int c = 0; c < C; ++c) {
      dw[c] = F::scales(q + c * next, b);
      mw[c] = F::mins(q + c * next, b);
    }
    for (int r = 0; r < R; ++r) {
      const __m256 dx = _mm256_set1_ps(xd[r * nb + b]), sx = _mm256_set1_ps(xs[r * nb + b]);
      for (int c = 0; c < C; ++c) {
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][c]), _mm256_mul_ps(dw[c], dx), acc[r][c]);
        if (F::has_min) acc[r][c] = _mm256_fmadd_ps(mw[c], sx, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float row[C * PANEL];
    float* to = width == C * PANEL ? out + r * ldo : row;  // the weight's last, padded features go through row
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(to + c * PANEL, acc[r][c]);
    if (to == row) std::memcpy(out + r * ldo, row, width * sizeof(float));
  }
}

template <class F, class X>
constexpr TileFn<X> tiles[ROWS] = {tile<F, X, 1>, tile<F, X, 2>, tile<F, X, 3>};
