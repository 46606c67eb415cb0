// The panel block formats of quant_matmul.cpp: each of GGUF's block formats, repacked losslessly by
// models/formats/ so that 8 output features sit side by side (models/formats/panels.py has the layout).
// A panel block is qk weights of each of the 8 features:
//   quants, then the features' per-block fields (scales, mins, or what they are computed from).
// pairs(p, a, b) gives, from chunk j of a block, k pairs 2j and 2j + 1 of the 8 features as int16 lanes
// [f][e]; scales(p) and mins(p) the 8 features' scales and mins as float32, such that w = scale*q + min;
// quant(p, f, k) one weight's integer, for the row lookups of an embedding.
// Why these and not one format for all: the bytes a step reads are the lever at one stream, so each
// keeps its file's bits where the pairs can be unpacked in a few instructions (4-bit ones), and widens to
// a byte a weight where they cannot (5- and 6-bit ones).
#pragma once
#include <immintrin.h>
#include <cstdint>

namespace kvserve_panels {

inline __m128i load128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m256 eight_halves(const uint8_t* p) { return _mm256_cvtph_ps(load128(p)); }
inline __m256 eight_u8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 eight_i8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// 4-bit quants, 128 bytes a block: byte 16c + 2f + e = q_f[4c + e] | q_f[4c + 2 + e] << 4.
struct Nibbles {
  static constexpr int64_t qk = 32, quants = 128, chunk = 16;
  static constexpr bool nibbles = true;
  static inline void pairs(const uint8_t* p, __m256i& a, __m256i& b) {
    const __m256i w = _mm256_cvtepu8_epi16(load128(p));  // byte j -> word j
    a = _mm256_and_si256(w, _mm256_set1_epi16(0x0F));
    b = _mm256_srli_epi16(w, 4);
  }
  static inline int quant(const uint8_t* p, int f, int k) { return (p[16 * (k / 4) + 2 * f + (k & 1)] >> (4 * ((k / 2) & 1))) & 15; }
};

// A byte a weight, qk * 8 bytes a block: byte 16j + 2f + e = q_f[2j + e]; signed or not.
template <int64_t QK_, bool SIGNED>
struct Bytes {
  static constexpr int64_t qk = QK_, quants = QK_ * 8, chunk = 32;
  static constexpr bool nibbles = false;
  static inline void pairs(const uint8_t* p, __m256i& a, __m256i& b) {
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

// Q4_1: fp16 d, fp16 m; w = d*q + m.
struct Q4_1 : Nibbles {
  static constexpr int64_t bytes = 160;
  static constexpr bool has_min = true;
  static inline __m256 scales(const uint8_t* p) { return eight_halves(p + quants); }
  static inline __m256 mins(const uint8_t* p) { return eight_halves(p + quants + 16); }
};

// Q4_0: fp16 d; w = d*(q - 8), the -8d a min, exact in float32.
struct Q4_0 : Nibbles {
  static constexpr int64_t bytes = 144;
  static constexpr bool has_min = true;
  static inline __m256 scales(const uint8_t* p) { return eight_halves(p + quants); }
  static inline __m256 mins(const uint8_t* p) { return _mm256_mul_ps(scales(p), _mm256_set1_ps(-8.0f)); }
};

// Q4_K: a 32-weight sub-block's 6-bit scale and min (u8), then its super-block's fp16 d and dmin;
// w = d*sc*q - dmin*m (each product exact in float32).
struct Q4_K : Nibbles {
  static constexpr int64_t bytes = 176;
  static constexpr bool has_min = true;
  static inline __m256 scales(const uint8_t* p) { return _mm256_mul_ps(eight_halves(p + quants + 16), eight_u8(p + quants)); }
  static inline __m256 mins(const uint8_t* p) {
    return _mm256_mul_ps(eight_halves(p + quants + 32), _mm256_mul_ps(eight_u8(p + quants + 8), _mm256_set1_ps(-1.0f)));
  }
};

// Q8_0, and Q5_0 as q - 16: int8, fp16 d; w = d*q.
struct Q8_0 : Bytes<32, true> {
  static constexpr int64_t bytes = 272;
  static constexpr bool has_min = false;
  static inline __m256 scales(const uint8_t* p) { return eight_halves(p + quants); }
  static inline __m256 mins(const uint8_t*) { return _mm256_setzero_ps(); }
};

// Q5_1 and Q5_K, and Q4_1/Q4_0/Q4_K unpacked for a batch: u8, float32 scale and min; w = s*q + m.
struct U8 : Bytes<32, false> {
  static constexpr int64_t bytes = 320;
  static constexpr bool has_min = true;
  static inline __m256 scales(const uint8_t* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p + quants)); }
  static inline __m256 mins(const uint8_t* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p + quants) + 8); }
};

// Q6_K as q - 32: blocks of 16, int8, then the 16's int8 scale and its super-block's fp16 d; w = d*sc*q.
struct Q6_K : Bytes<16, true> {
  static constexpr int64_t bytes = 152;
  static constexpr bool has_min = false;
  static inline __m256 scales(const uint8_t* p) { return _mm256_mul_ps(eight_halves(p + quants + 8), eight_i8(p + quants)); }
  static inline __m256 mins(const uint8_t*) { return _mm256_setzero_ps(); }
};

// The kinds as models/formats/panels.py numbers them.
enum Kind : int64_t { KIND_Q4_1 = 0, KIND_Q8_0 = 1, KIND_Q4_0 = 2, KIND_Q4_K = 3, KIND_U8 = 4, KIND_Q6_K = 5 };

}  // namespace kvserve_panels
