// MXFP4 (gpt-oss's expert weights) as a panel format of panel_formats.h, which includes this inside its
// namespace. A block holds its 32 4-bit E2M1 codes as stored, in Nibbles' layout (byte 16c + 2f + e =
// q_f[4c + e] | q_f[4c + 2 + e] << 4), then the 8 features' E8M0 exponent bytes e; a code stands for its
// entry of ggml's kvalues_mxfp4, the FP4 value doubled (-12..12), and w = 2^(e - 128) * value.
// Why codes and a table rather than bytes: 4 bits a weight is what a step streams, and a byte shuffle
// (vpshufb) maps 16 or 32 codes to their values in one instruction.

// The codes' layout and their values. Values are int8 and signed: for int8 activations the quads are
// multiplied as the signed byte formats' are (panel_formats.h's is_signed_bytes).
struct Fp4Codes {
  static constexpr int64_t qk = 32, quants = 128, unpack_from = 16;
  static inline __m128i table() { return _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12); }
  // The values of the low and the high codes of the bytes in v, as int8 (each 128-bit lane looks up its own).
  static inline void values(__m128i v, __m128i& lo, __m128i& hi) {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    lo = _mm_shuffle_epi8(table(), _mm_and_si128(v, low4));
    hi = _mm_shuffle_epi8(table(), _mm_and_si128(_mm_srli_epi16(v, 4), low4));
  }
  static inline void values(__m256i v, __m256i& lo, __m256i& hi) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), t = _mm256_broadcastsi128_si256(table());
    lo = _mm256_shuffle_epi8(t, _mm256_and_si256(v, low4));
    hi = _mm256_shuffle_epi8(t, _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
  }
  // k pairs 2j (a) and 2j + 1 (b) of the 8 features as int16 lanes [f][e], as Nibbles::pairs gives codes.
  static inline void pairs(const uint8_t* block, int64_t j, __m256i& a, __m256i& b) {
    __m128i lo, hi;
    values(load128(block + 16 * j), lo, hi);
    a = _mm256_cvtepi8_epi16(lo);
    b = _mm256_cvtepi8_epi16(hi);
  }
  // Chunk j as quads<F> gives it: lane 2f + e's word the values of k 4j + e (low byte) and 4j + 2 + e.
  static inline __m256i quads(const uint8_t* block, int64_t j) {
    __m128i lo, hi;
    values(load128(block + 16 * j), lo, hi);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi8(lo, hi)), _mm_unpackhi_epi8(lo, hi), 1);
  }
  static inline int quant(const uint8_t* p, int f, int k) {
    static constexpr int8_t value[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    return value[(p[16 * (k / 4) + 2 * f + (k & 1)] >> (4 * ((k / 2) & 1))) & 15];
  }
};

// The block's scale 2^(e - 128), as ggml_e8m0_to_fp32_half makes it: exact in float32, e < 2 the denormals
// 2^-128 and 2^-127 (0x00200000 << e), e = 255 2^127 (ggml reads no NaN). No min. A batch unpacks the values
// to signed bytes with the same float scales, so a row's float operations are the same on either path.
struct MXFP4 : Fp4Codes, Units<136> {
  static constexpr bool has_min = false;
  using Batch = Unpacked<32, true, false>;
  static inline __m256 scales(const uint8_t* p, int64_t b) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block(p, b) + quants)));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
  }
  static inline __m256 mins(const uint8_t*, int64_t) { return _mm256_setzero_ps(); }
};
