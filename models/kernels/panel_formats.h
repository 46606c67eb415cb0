// The panel block formats of quant_matmul.cpp: each of GGUF's block formats, repacked losslessly by
// models/formats/ so that 8 output features sit side by side (models/formats/panels.py has the layout).
// A panel is the 8 features' blocks of qk weights in units of `sub` blocks: each block's quants, then its
// per-block fields (scales, mins, or what they are computed from); after a unit's blocks, the fields its
// blocks share (a K-quant super-block's d and dmin), once. `bytes` is a unit's size.
// pairs(block, j, a, b) gives, from chunk j of a block, k pairs 2j and 2j + 1 of the 8 features as
// int16 lanes [f][e]; scales(panel, b) and mins(panel, b) block b's 8 scales and mins as float32, such
// that w = scale*q + min; quant(block, f, k) one weight's integer, for the row lookups of an embedding.
// Batch is the format a batch unpacks a panel into: a byte a weight, the same integers, scales and mins,
// so that a row's float operations are the same whichever path its step takes.
// Why these and not one format for all: the bytes a step reads are the lever at one stream, so each
// keeps its file's bits where the pairs can be unpacked in a few instructions (the 4- and 6-bit ones),
// and widens to a byte a weight where they cannot (the 5-bit ones).
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <type_traits>

namespace kvserve_panels {

inline __m128i load128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m256 eight_halves(const uint8_t* p) { return _mm256_cvtph_ps(load128(p)); }
inline __m256 eight_u8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 eight_i8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Where a panel's blocks lie: units of SUB blocks of BLOCK bytes, then HEADER bytes the unit's blocks share.
template <int64_t BLOCK, int64_t SUB = 1, int64_t HEADER = 0>
struct Units {
  static constexpr int64_t block_bytes = BLOCK, sub = SUB, bytes = SUB * BLOCK + HEADER;
  static inline const uint8_t* block(const uint8_t* panel, int64_t b) { return panel + (b / SUB) * bytes + (b % SUB) * BLOCK; }
  static inline const uint8_t* header(const uint8_t* panel, int64_t b) { return panel + (b / SUB) * bytes + SUB * BLOCK; }
};

// 4-bit quants, 128 bytes a block: byte 16c + 2f + e = q_f[4c + e] | q_f[4c + 2 + e] << 4.
struct Nibbles {
  static constexpr int64_t qk = 32, quants = 128, unpack_from = 16;
  static inline void pairs(const uint8_t* block, int64_t j, __m256i& a, __m256i& b) {
    const __m256i w = _mm256_cvtepu8_epi16(load128(block + 16 * j));  // byte i -> word i
    a = _mm256_and_si256(w, _mm256_set1_epi16(0x0F));
    b = _mm256_srli_epi16(w, 4);
  }
  static inline int quant(const uint8_t* p, int f, int k) { return (p[16 * (k / 4) + 2 * f + (k & 1)] >> (4 * ((k / 2) & 1))) & 15; }
};

// 6-bit quants (0..63), blocks of 16 (4 chunks of 4 k), 96 bytes: chunk j's 16 bytes at 16j, lane
// l = 2f + e's byte holding pair 2j's 6 bits and pair 2j + 1's low 2 bits above them; then, at 64 + 16c,
// pair 2j + 1's high 4 bits of chunks 2c (low nibble) and 2c + 1 (high nibble).
struct Nibbles6 {
  static constexpr int64_t qk = 16, quants = 96, unpack_from = 8;
  static inline void pairs(const uint8_t* block, int64_t j, __m256i& a, __m256i& b) {
    const __m256i w = _mm256_cvtepu8_epi16(load128(block + 16 * j));
    const __m256i n = _mm256_cvtepu8_epi16(load128(block + 64 + 16 * (j / 2)));
    const __m256i high = j & 1 ? _mm256_srli_epi16(n, 4) : _mm256_and_si256(n, _mm256_set1_epi16(0x0F));
    a = _mm256_and_si256(w, _mm256_set1_epi16(0x3F));
    b = _mm256_or_si256(_mm256_srli_epi16(w, 6), _mm256_slli_epi16(high, 2));
  }
  static inline int quant(const uint8_t* p, int f, int k) {
    const int j = k / 4, l = 2 * f + (k & 1), byte = p[16 * j + l];
    if ((k / 2 & 1) == 0) return byte & 63;
    return byte >> 6 | ((p[64 + 16 * (j / 2) + l] >> (4 * (j & 1))) & 15) << 2;
  }
};

// A byte a weight, qk * 8 bytes a block: byte 16j + 2f + e = q_f[2j + e]; signed or not.
template <int64_t QK_, bool SIGNED>
struct Bytes {
  static constexpr int64_t qk = QK_, quants = QK_ * 8, unpack_from = 0;
  static constexpr bool is_signed = SIGNED;
  static inline void pairs(const uint8_t* block, int64_t j, __m256i& a, __m256i& b) {
    const uint8_t* p = block + 32 * j;
    if constexpr (SIGNED) {
      a = _mm256_cvtepi8_epi16(load128(p));
      b = _mm256_cvtepi8_epi16(load128(p + 16));
    } else {
      a = _mm256_cvtepu8_epi16(load128(p));
      b = _mm256_cvtepu8_epi16(load128(p + 16));
    }
  }
  static inline int quant(const uint8_t* p, int f, int k) {
    const uint8_t v = p[16 * (k / 2) + 2 * f + (k & 1)];
    return SIGNED ? static_cast<int>(static_cast<int8_t>(v)) : static_cast<int>(v);
  }
};

// A byte a weight, float32 scale (and min): Q5_1 and Q5_K, and the 4-/6-bit formats unpacked for a batch.
template <int64_t QK_, bool SIGNED, bool MIN = true>
struct Unpacked : Bytes<QK_, SIGNED>, Units<QK_ * 8 + (MIN ? 64 : 32)> {
  static constexpr bool has_min = MIN;
  using Batch = Unpacked;
  static inline const float* fields(const uint8_t* p, int64_t b) {
    return reinterpret_cast<const float*>(Units<QK_ * 8 + (MIN ? 64 : 32)>::block(p, b) + QK_ * 8);
  }
  static inline __m256 scales(const uint8_t* p, int64_t b) { return _mm256_loadu_ps(fields(p, b)); }
  static inline __m256 mins(const uint8_t* p, int64_t b) { return MIN ? _mm256_loadu_ps(fields(p, b) + 8) : _mm256_setzero_ps(); }
};
using U8 = Unpacked<32, false>;

// Q4_1: fp16 d, fp16 m; w = d*q + m.
struct Q4_1 : Nibbles, Units<160> {
  static constexpr bool has_min = true;
  using Batch = U8;
  static inline __m256 scales(const uint8_t* p, int64_t b) { return eight_halves(block(p, b) + quants); }
  static inline __m256 mins(const uint8_t* p, int64_t b) { return eight_halves(block(p, b) + quants + 16); }
};

// Q4_0: fp16 d; w = d*(q - 8), the -8d a min, exact in float32.
struct Q4_0 : Nibbles, Units<144> {
  static constexpr bool has_min = true;
  using Batch = U8;
  static inline __m256 scales(const uint8_t* p, int64_t b) { return eight_halves(block(p, b) + quants); }
  static inline __m256 mins(const uint8_t* p, int64_t b) { return _mm256_mul_ps(scales(p, b), _mm256_set1_ps(-8.0f)); }
};

// Q4_K: a 32-weight block's 6-bit scale and min (u8), and, once a super-block of 8, fp16 d and dmin;
// w = d*sc*q - dmin*m (each product exact in float32).
struct Q4_K : Nibbles, Units<144, 8, 32> {
  static constexpr bool has_min = true;
  using Batch = U8;
  static inline __m256 scales(const uint8_t* p, int64_t b) { return _mm256_mul_ps(eight_halves(header(p, b)), eight_u8(block(p, b) + quants)); }
  static inline __m256 mins(const uint8_t* p, int64_t b) {
    return _mm256_mul_ps(eight_halves(header(p, b) + 16), _mm256_mul_ps(eight_u8(block(p, b) + quants + 8), _mm256_set1_ps(-1.0f)));
  }
};

// Q8_0, and Q5_0 as q - 16: int8, fp16 d; w = d*q.
struct Q8_0 : Bytes<32, true>, Units<272> {
  static constexpr bool has_min = false;
  using Batch = Q8_0;
  static inline __m256 scales(const uint8_t* p, int64_t b) { return eight_halves(block(p, b) + quants); }
  static inline __m256 mins(const uint8_t*, int64_t) { return _mm256_setzero_ps(); }
};


// Q6_K: blocks of 16, their int8 scale, and once a super-block of 16, fp16 d; w = d*sc*q - 32*d*sc (each
// product exact in float32, and so is their sum). A batch unpacks q as it is and keeps the min: a row's
// float operations must not depend on which path its step took.
struct Q6_K : Nibbles6, Units<104, 16, 16> {
  static constexpr bool has_min = true;
  using Batch = Unpacked<16, false, true>;
  static inline __m256 scales(const uint8_t* p, int64_t b) { return _mm256_mul_ps(eight_halves(header(p, b)), eight_i8(block(p, b) + quants)); }
  static inline __m256 mins(const uint8_t* p, int64_t b) { return _mm256_mul_ps(scales(p, b), _mm256_set1_ps(-32.0f)); }
};

#include "mxfp4.h"

// Chunk j of a block of F as k quads of its 8 features, a byte a weight, for int8 activations: lane f's
// bytes q_f[4j], q_f[4j + 2], q_f[4j + 1], q_f[4j + 3] (each pair's low word beside its high word), the
// order quantize_rows writes a block's int8 activations in. Signed formats' bytes are int8 (MXFP4's values
// too), the others' below 128 (6 bits at most), so that vpmaddubsw's pairwise int16 sums never saturate.
template <class F>
constexpr bool is_signed_bytes = std::is_base_of_v<Bytes<F::qk, true>, F> || std::is_base_of_v<Fp4Codes, F>;
template <class F>
inline __m256i quads(const uint8_t* block, int64_t j) {
  if constexpr (std::is_base_of_v<Fp4Codes, F>) return F::quads(block, j);
  if constexpr (std::is_base_of_v<Nibbles, F>) {  // a byte's two nibbles are a word's two bytes
    const __m256i w = _mm256_cvtepu8_epi16(load128(block + 16 * j));
    return _mm256_and_si256(_mm256_or_si256(w, _mm256_slli_epi16(w, 4)), _mm256_set1_epi16(0x0F0F));
  }
  __m256i lo, hi;
  F::pairs(block, j, lo, hi);
  if constexpr (is_signed_bytes<F>) lo = _mm256_and_si256(lo, _mm256_set1_epi16(0xFF));
  return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 8));
}

// The kinds as models/formats/panels.py numbers them; INT8_ACTIVATIONS or'ed into a kind quantizes the
// activations to int8 (llama.cpp's precision, twice the multiply-adds an instruction) instead of int16.
enum Kind : int64_t { KIND_Q4_1 = 0, KIND_Q8_0 = 1, KIND_Q4_0 = 2, KIND_Q4_K = 3, KIND_U8 = 4, KIND_Q6_K = 5,
                     KIND_MXFP4 = 6 };
constexpr int64_t INT8_ACTIVATIONS = 16;

}  // namespace kvserve_panels
