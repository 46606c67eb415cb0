// The wide path of quant_matmul.cpp, for CPUs with AVX512-VNNI, from 16 rows: a chunk of rows against
// panels unpacked to int16 pairs (vpdpwssd) or, for int8 activations, byte quads (vpdpbusd), 16 features
// a 512-bit vector. Included there once, inside a namespace compiled for AVX-512, after
// packed_wide_tile.h; the includer defines the panel formats, GROUP, PANEL, panel_bytes, is_int8 and
// QuantizedRows.
//
// Why: from a few rows on, the step is bound by the multiply-adds, and vpdpwssd on 512 bits does twice
// the work of the 256-bit tile an instruction. With many rows the panels' bytes are unpacked once per
// chunk of rows into a layout the inner loop reads whole (two panels side by side, each k pair of 16
// features one vector), so that loop is loads and vpdpwssd alone. Below 16 rows packed_wide_tile.h's
// tiles unpack the same vectors in registers instead. Each output lane gets the same float operations in
// the same order as in panel_tile.h (the integer sums are exact), so a row's outputs are bitwise the same
// on every path: a row never depends on how many rows share its step.

// A block of QKB weights: for int16 activations its k pairs, QKB/4 x (low pairs, high pairs) x 64 bytes;
// for int8 ones its k quads, QKB/4 x 64 bytes (signed formats' offset by 128 to bytes); then 16 float
// scales and 16 float mins.
template <int64_t QKB, class X>
constexpr int64_t wide_quants = QKB / 4 * (is_int8<X> ? 64 : 128);
template <int64_t QKB, class X>
constexpr int64_t wide_block = wide_quants<QKB, X> + 2 * 64;
constexpr int WIDE_ROWS = 6;  // rows a tile: 6 x 2 int32 sums and 6 x 2 float sums in registers

// A group's GROUP panels (each nb blocks of F) from q -> the wide layout, nb blocks of wide_block bytes at `to`:
// the vectors packed_wide_tile.h's tiles unpack in registers, and their fields, stored.
template <class F, class X>
inline void unpack_wide(const uint8_t* q, int64_t nb, uint8_t* to) {
  constexpr int64_t QK = F::qk, WIDE_BLOCK = wide_block<QK, X>, WIDE_QUANTS = wide_quants<QK, X>;
  static_assert(GROUP == 2 && PANEL == 8, "a wide vector is one group: two panels of 8 features");
  const uint8_t* q1 = q + panel_bytes<F>(nb);  // the second panel
  typename WideFields<F>::Unit unit{};
  for (int64_t b = 0; b < nb; ++b, to += WIDE_BLOCK) {
    const uint8_t *p0 = F::block(q, b), *p1 = F::block(q1, b);
    for (int64_t j = 0; j < QK / 4; ++j) {
      if constexpr (is_int8<X>) {
        _mm512_storeu_si512(to + j * 64, wide_quads<F>(p0, p1, j));
        continue;
      }
      __m512i lo, hi;
      wide_pairs<F>(p0, p1, j, lo, hi);
      _mm512_storeu_si512(to + j * 128, lo);
      _mm512_storeu_si512(to + j * 128 + 64, hi);
    }
    __m512 dw, mw;
    if (b % F::sub == 0) unit = WideFields<F>::unit(q, q1, b);
    WideFields<F>::block(q, q1, b, unit, dw, mw);
    _mm512_storeu_ps(to + WIDE_QUANTS, dw);
    _mm512_storeu_ps(to + WIDE_QUANTS + 64, mw);
  }
}

// out[r][0..16 C) for R rows by C unpacked groups at w (each nb * WIDE_BLOCK bytes, one after another).
// SIGNED: the weights' bytes are offset by 128, so each int8 row's sum is less 128 t.
template <int64_t QK, int R, int C, bool MIN, class X, bool SIGNED>
void wide_tile(const uint8_t* w, int64_t nb, const X* xq, const float* xd, const float* xs, const int32_t* xt, int64_t K,
               float* out, int64_t ldo, int64_t width) {
  constexpr int64_t WIDE_BLOCK = wide_block<QK, X>, WIDE_QUANTS = wide_quants<QK, X>;
  const int64_t stride = nb * WIDE_BLOCK;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = w + b * WIDE_BLOCK;
    const int32_t* xb[R];  // each row's block as k pairs (int16) or quads (int8)
    for (int r = 0; r < R; ++r) xb[r] = reinterpret_cast<const int32_t*>(xq + r * K + b * QK);
    __m512i sum[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) sum[r][c] = _mm512_setzero_si512();
    if constexpr (is_int8<X>) {
#pragma GCC unroll 8
      for (int64_t j = 0; j < QK / 4; ++j) {
        __m512i q[C];
        for (int c = 0; c < C; ++c) q[c] = _mm512_loadu_si512(wb + c * stride + j * 64);
        for (int r = 0; r < R; ++r) {
          const __m512i x = _mm512_set1_epi32(xb[r][j]);
          for (int c = 0; c < C; ++c) sum[r][c] = _mm512_dpbusd_epi32(sum[r][c], q[c], x);
        }
      }
      if constexpr (SIGNED)
        for (int r = 0; r < R; ++r) {
          const __m512i offset = _mm512_set1_epi32(128 * xt[r * nb + b]);
          for (int c = 0; c < C; ++c) sum[r][c] = _mm512_sub_epi32(sum[r][c], offset);
        }
    } else {
#pragma GCC unroll 8
      for (int64_t j = 0; j < QK / 4; ++j) {
        __m512i lo[C], hi[C];
        for (int c = 0; c < C; ++c) {
          lo[c] = _mm512_loadu_si512(wb + c * stride + j * 128);
          hi[c] = _mm512_loadu_si512(wb + c * stride + j * 128 + 64);
        }
        for (int r = 0; r < R; ++r) {
          const __m512i x0 = _mm512_set1_epi32(xb[r][2 * j]), x1 = _mm512_set1_epi32(xb[r][2 * j + 1]);
          for (int c = 0; c < C; ++c) sum[r][c] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(sum[r][c], lo[c], x0), hi[c], x1);
        }
      }
    }
    __m512 dw[C], mw[C];
    for (int c = 0; c < C; ++c) {
      dw[c] = _mm512_loadu_ps(wb + c * stride + WIDE_QUANTS);
      mw[c] = _mm512_loadu_ps(wb + c * stride + WIDE_QUANTS + 64);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(xd[r * nb + b]), sx = _mm512_set1_ps(xs[r * nb + b]);
      for (int c = 0; c < C; ++c) {
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][c]), _mm512_mul_ps(dw[c], dx), acc[r][c]);
        if (MIN) acc[r][c] = _mm512_fmadd_ps(mw[c], sx, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const int64_t left = width - 16 * c;  // the weight's last, padded features are not written
      if (left >= 16) _mm512_storeu_ps(out + r * ldo + 16 * c, acc[r][c]);
      else if (left > 0) _mm512_mask_storeu_ps(out + r * ldo + 16 * c, (__mmask16)((1u << left) - 1), acc[r][c]);
    }
}

template <class X>
using WideFn = void (*)(const uint8_t*, int64_t, const X*, const float*, const float*, const int32_t*, int64_t, float*,
                        int64_t, int64_t);

template <int64_t QK, int C, bool MIN, class X, bool S>
constexpr WideFn<X> wide_tiles[WIDE_ROWS] = {wide_tile<QK, 1, C, MIN, X, S>, wide_tile<QK, 2, C, MIN, X, S>,
                                             wide_tile<QK, 3, C, MIN, X, S>, wide_tile<QK, 4, C, MIN, X, S>,
                                             wide_tile<QK, 5, C, MIN, X, S>, wide_tile<QK, 6, C, MIN, X, S>};

// out [M, N] = x [M, K] by the N-feature weight held as panels of F, two groups (32 features) a tile.
template <class F, class X>
void wide_linear(const QuantizedRows<X>& x, int64_t M, int64_t K, int64_t N, const uint8_t* panels, float* out,
                 int64_t ldo, int64_t row_chunk) {
  constexpr int64_t WIDE_BLOCK = wide_block<F::qk, X>;
  constexpr bool S = is_int8<X> && is_signed_bytes<F>;
  const int64_t nb = K / F::qk, groups = panel_count(N) / GROUP, group_bytes = GROUP * panel_bytes<F>(nb);
  const int64_t units = (groups + 1) / 2;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint8_t> scratch;
    scratch.resize(2 * nb * WIDE_BLOCK);
    for (int64_t r0 = 0; r0 < M; r0 += row_chunk) {
      const int64_t r1 = std::min(M, r0 + row_chunk);
      for (int64_t u = begin; u < end; ++u) {
        const int64_t g = 2 * u, c = std::min<int64_t>(2, groups - g), col = g * GROUP * PANEL;
        for (int64_t i = 0; i < c; ++i) unpack_wide<F, X>(panels + (g + i) * group_bytes, nb, scratch.data() + i * nb * WIDE_BLOCK);
        const WideFn<X>* tiles = c == 2 ? wide_tiles<F::qk, 2, F::has_min, X, S> : wide_tiles<F::qk, 1, F::has_min, X, S>;
        for (int64_t r = r0; r < r1; r += WIDE_ROWS) {
          const int64_t rows = std::min<int64_t>(WIDE_ROWS, r1 - r);
          tiles[rows - 1](scratch.data(), nb, x.q + r * K, x.d + r * nb, x.s + r * nb, x.t + r * nb, K, out + r * ldo + col, ldo,
                          std::min(c * GROUP * PANEL, N - col));
        }
      }
    }
  });
}
