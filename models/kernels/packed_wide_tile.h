// The few-row path of quant_matmul.cpp on CPUs with AVX512-VNNI: tiles of up to 8 rows that read the
// packed panels (panel_formats.h) and unpack each group's chunks in registers, since unpacking a group
// once into memory (wide_tile.h) costs more than a few rows' tiles save. Such a step streams its weights
// from memory, so the tiles prefetch ahead of their reads, and the one-row tiles spend as few
// instructions a byte as they can. Included once, inside the AVX-512 namespace, before wide_tile.h; each
// output lane gets the same float operations in the same order as on every other path (the integer sums
// are exact).

// The 16 bytes at a and the 16 at b, as one vector.
inline __m256i both(const uint8_t* a, const uint8_t* b) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(load128(a)), load128(b), 1);
}

template <class F>
constexpr bool is_bytes = std::is_base_of_v<Bytes<F::qk, true>, F> || std::is_base_of_v<Bytes<F::qk, false>, F>;

// Chunk j of a group's two panels' blocks p0 and p1 as the wide layout's vectors: k pairs 2j (lo) and
// 2j + 1 (hi) of the 16 features, as unpack_wide writes them. Each format's pairs (panel_formats.h), done
// for both panels at once on 512 bits.
template <class F>
inline void wide_pairs(const uint8_t* p0, const uint8_t* p1, int64_t j, __m512i& lo, __m512i& hi) {
  if constexpr (std::is_base_of_v<Nibbles, F>) {
    const __m512i w = _mm512_cvtepu8_epi16(both(p0 + 16 * j, p1 + 16 * j));
    lo = _mm512_and_si512(w, _mm512_set1_epi16(0x0F));
    hi = _mm512_srli_epi16(w, 4);
  } else if constexpr (std::is_base_of_v<Nibbles6, F>) {
    const __m512i w = _mm512_cvtepu8_epi16(both(p0 + 16 * j, p1 + 16 * j));
    const __m512i n = _mm512_cvtepu8_epi16(both(p0 + 64 + 16 * (j / 2), p1 + 64 + 16 * (j / 2)));
    const __m512i high = j & 1 ? _mm512_srli_epi16(n, 4) : _mm512_and_si512(n, _mm512_set1_epi16(0x0F));
    lo = _mm512_and_si512(w, _mm512_set1_epi16(0x3F));
    hi = _mm512_or_si512(_mm512_srli_epi16(w, 6), _mm512_slli_epi16(high, 2));
  } else if constexpr (std::is_base_of_v<Fp4Codes, F>) {  // MXFP4: codes to their values, then widened
    __m256i a, b;
    F::values(both(p0 + 16 * j, p1 + 16 * j), a, b);
    lo = _mm512_cvtepi8_epi16(a);
    hi = _mm512_cvtepi8_epi16(b);
  } else {
    static_assert(is_bytes<F>, "a panel format wide_pairs knows");
    const __m256i a = both(p0 + 32 * j, p1 + 32 * j), b = both(p0 + 32 * j + 16, p1 + 32 * j + 16);
    if constexpr (F::is_signed) {
      lo = _mm512_cvtepi8_epi16(a);
      hi = _mm512_cvtepi8_epi16(b);
    } else {
      lo = _mm512_cvtepu8_epi16(a);
      hi = _mm512_cvtepu8_epi16(b);
    }
  }
}

// [a, b] as one vector (insertf32x8 would need AVX512DQ).
inline __m512 join(__m256 a, __m256 b) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(a)), _mm256_castps_pd(b), 1));
}

// Chunk j of two panels' blocks as the int8 wide layout's vector (unpack_wide's): k quads of 16 features.
template <class F>
inline __m512i wide_quads(const uint8_t* p0, const uint8_t* p1, int64_t j) {
  if constexpr (std::is_base_of_v<Nibbles, F>) {  // as quads: (w | w << 4) & 0x0F0F, one ternary op
    const __m512i w = _mm512_cvtepu8_epi16(both(p0 + 16 * j, p1 + 16 * j));
    return _mm512_ternarylogic_epi32(w, _mm512_slli_epi16(w, 4), _mm512_set1_epi16(0x0F0F), 0xA8);
  }
  __m512i lo, hi;
  wide_pairs<F>(p0, p1, j, lo, hi);
  if constexpr (!is_signed_bytes<F>) return _mm512_or_si512(lo, _mm512_slli_epi16(hi, 8));
  const __m512i q = _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi16(0xFF)), _mm512_slli_epi16(hi, 8));
  return _mm512_xor_si512(q, _mm512_set1_epi8(static_cast<char>(0x80)));
}

// A block's 16 scales and mins, the two panels' side by side (F::scales and F::mins, the same floats). A
// K-quant's super-block factors (fp16 d, dmin) are converted once a super-block (a Unit), and its blocks'
// byte scales for both panels in one vector: at one row this per-block float work paced the stream.
template <class F>
struct WideFields {
  struct Unit {};
  static inline Unit unit(const uint8_t*, const uint8_t*, int64_t) { return {}; }
  static inline void block(const uint8_t* q0, const uint8_t* q1, int64_t b, const Unit&, __m512& dw, __m512& mw) {
    dw = join(F::scales(q0, b), F::scales(q1, b));
    mw = join(F::mins(q0, b), F::mins(q1, b));
  }
};

// Bytes 0..7 at a and at b, as 16 int32 lanes.
inline __m512i sixteen_u8(const uint8_t* a, const uint8_t* b) {
  return _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)),
                                                 _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b))));
}
inline __m512i sixteen_i8(const uint8_t* a, const uint8_t* b) {
  return _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)),
                                                 _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b))));
}

template <>
struct WideFields<Q4_K> {
  struct Unit {
    __m512 d, neg_dmin;
  };
  static inline Unit unit(const uint8_t* q0, const uint8_t* q1, int64_t b) {
    const uint8_t *h0 = Q4_K::header(q0, b), *h1 = Q4_K::header(q1, b);
    return {join(eight_halves(h0), eight_halves(h1)),
            _mm512_mul_ps(join(eight_halves(h0 + 16), eight_halves(h1 + 16)), _mm512_set1_ps(-1.0f))};
  }
  static inline void block(const uint8_t* q0, const uint8_t* q1, int64_t b, const Unit& u, __m512& dw, __m512& mw) {
    const uint8_t *p0 = Q4_K::block(q0, b) + Q4_K::quants, *p1 = Q4_K::block(q1, b) + Q4_K::quants;
    dw = _mm512_mul_ps(u.d, _mm512_cvtepi32_ps(sixteen_u8(p0, p1)));
    mw = _mm512_mul_ps(u.neg_dmin, _mm512_cvtepi32_ps(sixteen_u8(p0 + 8, p1 + 8)));
  }
};

template <>
struct WideFields<Q6_K> {
  struct Unit {
    __m512 d;
  };
  static inline Unit unit(const uint8_t* q0, const uint8_t* q1, int64_t b) {
    return {join(eight_halves(Q6_K::header(q0, b)), eight_halves(Q6_K::header(q1, b)))};
  }
  static inline void block(const uint8_t* q0, const uint8_t* q1, int64_t b, const Unit& u, __m512& dw, __m512& mw) {
    dw = _mm512_mul_ps(u.d, _mm512_cvtepi32_ps(sixteen_i8(Q6_K::block(q0, b) + Q6_K::quants, Q6_K::block(q1, b) + Q6_K::quants)));
    mw = _mm512_mul_ps(dw, _mm512_set1_ps(-32.0f));
  }
};

// One int8 row: a 128-bit lane holds one chunk of one panel (panel_formats.h), four chunks a vector. A
// 4- or 6-bit chunk is a lane of its block as stored, a byte format's the two halves of a chunk gathered
// into a lane; its bytes, split into their low and high parts (k 4j + e and 4j + 2 + e) and interleaved
// (vpunpck), are the k quads of its features 0-3 and 4-7. Each lane is multiplied by its own chunk's
// activations, and the lanes summed once a block: for one row this takes fewer instructions than
// unpacking each chunk of both panels into one vector, which bound its stream.
template <class F, class X, int R>
constexpr bool LANE_QUADS = is_int8<X> && R == 1;

// The 16 features' sums, in order, from a panel's features 0-3 (a) and 4-7 (b), each a lane's chunk.
inline __m512i lane_sums(__m512i a0, __m512i b0, __m512i a1, __m512i b1) {
  const __m512i s0 = _mm512_add_epi32(_mm512_shuffle_i32x4(a0, b0, 0x44), _mm512_shuffle_i32x4(a0, b0, 0xEE));
  const __m512i s1 = _mm512_add_epi32(_mm512_shuffle_i32x4(a1, b1, 0x44), _mm512_shuffle_i32x4(a1, b1, 0xEE));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(s0, s1, 0x88), _mm512_shuffle_i32x4(s0, s1, 0xDD));
}

// Activation quads j..j + 3 at x, quad j + i broadcast over lane i.
inline __m512i lane_activations(const int8_t* x) {
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                  _mm512_castsi128_si512(load128(reinterpret_cast<const uint8_t*>(x))));
}

// One int8 row's sums over a block of the group's two panels (p0, p1): the 16 features' int32 lanes.
template <class F>
inline __m512i one_row_sums(const uint8_t* p0, const uint8_t* p1, const int8_t* x) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
  for (int64_t h = 0; h < F::qk / 16; ++h) {  // four chunks a pass
    const __m512i xs = lane_activations(x + 16 * h);
    for (int c = 0; c < 2; ++c) {
      const uint8_t* p = (c ? p1 : p0) + (is_bytes<F> ? 128 : 64) * h;
      const __m512i v = _mm512_loadu_si512(p);
      __m512i lo, hi;
      if constexpr (is_bytes<F>) {  // chunks 0-3's halves, from two vectors of two chunks each
        const __m512i v1 = _mm512_loadu_si512(p + 64);
        lo = _mm512_permutex2var_epi64(v, _mm512_setr_epi64(0, 1, 4, 5, 8, 9, 12, 13), v1);
        hi = _mm512_permutex2var_epi64(v, _mm512_setr_epi64(2, 3, 6, 7, 10, 11, 14, 15), v1);
        if constexpr (is_signed_bytes<F>) {  // offset to bytes by 128, taken back out by the caller
          lo = _mm512_xor_si512(lo, _mm512_set1_epi8(static_cast<char>(0x80)));
          hi = _mm512_xor_si512(hi, _mm512_set1_epi8(static_cast<char>(0x80)));
        }
      } else if constexpr (std::is_base_of_v<Nibbles, F>) {  // a byte's low nibble, k 4j + e; high, k 4j + 2 + e
        lo = _mm512_and_si512(v, low4);
        hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      } else if constexpr (std::is_base_of_v<Fp4Codes, F>) {  // the codes' values offset to bytes by 128, as above
        const __m512i t = _mm512_broadcast_i32x4(_mm_xor_si128(F::table(), _mm_set1_epi8(static_cast<char>(0x80))));
        lo = _mm512_shuffle_epi8(t, _mm512_and_si512(v, low4));
        hi = _mm512_shuffle_epi8(t, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
      } else {  // 6 bits, k 4j + e; the 2 bits above them and, from the chunk pair's nibbles, 4 more: k 4j + 2 + e
        // the nibbles of chunks 0 and 1 (lanes 0 and 1), then of 2 and 3; each lane's nibble to bits 2-5
        const __m512i pair = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64)));
        const __m512i n = _mm512_shuffle_i64x2(pair, pair, 0x50);
        const __m512i high = _mm512_rolv_epi32(n, _mm512_setr_epi32(2, 2, 2, 2, 30, 30, 30, 30, 2, 2, 2, 2, 30, 30, 30, 30));
        const __m512i two = _mm512_and_si512(_mm512_srli_epi16(v, 6), _mm512_set1_epi8(0x03));
        lo = _mm512_and_si512(v, _mm512_set1_epi8(0x3F));
        hi = _mm512_ternarylogic_epi32(high, two, _mm512_set1_epi8(0x3C), 0xEC);  // (high & 0x3C) | two
      }
      acc[2 * c] = _mm512_dpbusd_epi32(acc[2 * c], _mm512_unpacklo_epi8(lo, hi), xs);
      acc[2 * c + 1] = _mm512_dpbusd_epi32(acc[2 * c + 1], _mm512_unpackhi_epi8(lo, hi), xs);
    }
  }
  return lane_sums(acc[0], acc[1], acc[2], acc[3]);
}

// How far ahead of a streaming tile's reads it prefetches, in each of its two panels.
constexpr int64_t PREFETCH_BYTES = 2048;

// Prefetch block b's share of each of the group's two panels at q (`panel` bytes each), PREFETCH_BYTES
// ahead: past a panel's end, in the same panel of the next group. The prefetches follow the two streams
// the tile reads, where prefetching the next groups whole made two streams more for the memory to serve.
// Past the weight's end a prefetch is only wasted, never a fault.
template <class F>
inline void prefetch_streams(const uint8_t* q, int64_t panel, int64_t b) {
  for (int64_t at = (b * F::bytes / F::sub) & ~int64_t{63}; at < (b + 1) * F::bytes / F::sub; at += 64) {
    const int64_t to = at + PREFETCH_BYTES + (at + PREFETCH_BYTES >= panel ? panel : 0);
    _mm_prefetch(reinterpret_cast<const char*>(q + to), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(q + panel + to), _MM_HINT_T0);
  }
}

// out[r][0..16) for R rows by one group (16 features) of packed panels of F at q, its pairs unpacked in
// registers: for a few rows, unpacking each group once into memory cost more than the tiles that read it.
// `stream`: this tile is the first over this group, which a few rows' step reads from memory, so it
// prefetches ahead of its reads.
template <class F, class X, int R>
void packed_wide_tile(const uint8_t* q, int64_t nb, const X* xq, const float* xd, const float* xs, const int32_t* xt,
                      int64_t K, float* out, int64_t ldo, int64_t width, bool stream) {
  const int64_t panel = panel_bytes<F>(nb);
  const uint8_t* q1 = q + panel;  // the second panel
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  typename WideFields<F>::Unit unit{};
  for (int64_t b = 0; b < nb; ++b) {
    if (stream) prefetch_streams<F>(q, panel, b);
    const uint8_t *p0 = F::block(q, b), *p1 = F::block(q1, b);
    const int32_t* xb[R];  // each row's block as k pairs (int16) or quads (int8)
    for (int r = 0; r < R; ++r) xb[r] = reinterpret_cast<const int32_t*>(xq + r * K + b * F::qk);
    // With one row a block's sum would be one chain of dependent multiply-adds, paced by their latency
    // below the read bandwidth: there they go to four sums (exact, as integer sums do not depend on how
    // they are split), as in panel_tile.h.
    constexpr int CHAINS = R == 1 ? 4 : 1;
    __m512i sum[R], part[CHAINS];
    for (int r = 0; r < R; ++r) sum[r] = _mm512_setzero_si512();
    for (int h = 0; h < CHAINS; ++h) part[h] = _mm512_setzero_si512();
    if constexpr (LANE_QUADS<F, X, R>) sum[0] = one_row_sums<F>(p0, p1, xq + b * F::qk);
#pragma GCC unroll 8
    for (int64_t j = 0; j < (LANE_QUADS<F, X, R> ? 0 : F::qk / 4); ++j) {
      if constexpr (is_int8<X>) {
        const __m512i w = wide_quads<F>(p0, p1, j);
        if constexpr (CHAINS == 4) part[j % 4] = _mm512_dpbusd_epi32(part[j % 4], w, _mm512_set1_epi32(xb[0][j]));
        else
          for (int r = 0; r < R; ++r) sum[r] = _mm512_dpbusd_epi32(sum[r], w, _mm512_set1_epi32(xb[r][j]));
        continue;
      }
      __m512i lo, hi;
      wide_pairs<F>(p0, p1, j, lo, hi);
      if constexpr (CHAINS == 4) {
        part[2 * (j & 1)] = _mm512_dpwssd_epi32(part[2 * (j & 1)], lo, _mm512_set1_epi32(xb[0][2 * j]));
        part[2 * (j & 1) + 1] = _mm512_dpwssd_epi32(part[2 * (j & 1) + 1], hi, _mm512_set1_epi32(xb[0][2 * j + 1]));
      } else {
        for (int r = 0; r < R; ++r)
          sum[r] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(sum[r], lo, _mm512_set1_epi32(xb[r][2 * j])), hi,
                                       _mm512_set1_epi32(xb[r][2 * j + 1]));
      }
    }
    if constexpr (CHAINS == 4 && !LANE_QUADS<F, X, R>)
      sum[0] = _mm512_add_epi32(_mm512_add_epi32(part[0], part[1]), _mm512_add_epi32(part[2], part[3]));
    if constexpr (is_int8<X> && is_signed_bytes<F>)  // the weights' offset of 128, taken back out
      for (int r = 0; r < R; ++r) sum[r] = _mm512_sub_epi32(sum[r], _mm512_set1_epi32(128 * xt[r * nb + b]));
    __m512 dw, mw;
    if (b % F::sub == 0) unit = WideFields<F>::unit(q, q1, b);
    WideFields<F>::block(q, q1, b, unit, dw, mw);
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r]), _mm512_mul_ps(dw, _mm512_set1_ps(xd[r * nb + b])), acc[r]);
      if (F::has_min) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[r * nb + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    if (width >= 16) _mm512_storeu_ps(out + r * ldo, acc[r]);
    else _mm512_mask_storeu_ps(out + r * ldo, (__mmask16)((1u << width) - 1), acc[r]);
  }
}

constexpr int PACKED_ROWS = 8;  // rows a packed tile: 8 int32 sums and 8 float sums in registers
template <class X>
using PackedFn = void (*)(const uint8_t*, int64_t, const X*, const float*, const float*, const int32_t*, int64_t, float*,
                          int64_t, int64_t, bool);
template <class F, class X>
constexpr PackedFn<X> packed_tiles[PACKED_ROWS] = {
    packed_wide_tile<F, X, 1>, packed_wide_tile<F, X, 2>, packed_wide_tile<F, X, 3>, packed_wide_tile<F, X, 4>,
    packed_wide_tile<F, X, 5>, packed_wide_tile<F, X, 6>, packed_wide_tile<F, X, 7>, packed_wide_tile<F, X, 8>};

// out [M, N] = x [M, K] by the N-feature weight held as panels of F, a group (16 features) at a time,
// unpacked in registers by every tile of rows.
template <class F, class X>
void packed_wide_linear(const QuantizedRows<X>& x, int64_t M, int64_t K, int64_t N, const uint8_t* panels, float* out,
                        int64_t ldo) {
  const int64_t nb = K / F::qk, groups = panel_count(N) / GROUP, group_bytes = GROUP * panel_bytes<F>(nb);
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t col = g * GROUP * PANEL, width = std::min<int64_t>(GROUP * PANEL, N - col);
      for (int64_t r = 0; r < M; r += PACKED_ROWS) {
        const int64_t rows = std::min<int64_t>(PACKED_ROWS, M - r);
        packed_tiles<F, X>[rows - 1](panels + g * group_bytes, nb, x.q + r * K, x.d + r * nb, x.s + r * nb, x.t + r * nb,
                                     K, out + r * ldo + col, ldo, width, r == 0);
      }
    }
  });
}

