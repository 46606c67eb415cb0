// A GGUF tensor's row blocks repacked into the panels of panel_formats.h at load, in one pass over the
// bytes: bitwise what models/formats/ makes of them in Python (each format's decode, then panels.pack),
// which stays the reference and the fallback.
//
// Op contract (registered as kvserve_native::*):
//   repack_blocks(raw [R, row bytes] uint8, format, out [panel_count(R), units, unit bytes] uint8) -> int
//       format is a GGUF type's name (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4); writes the R
//       rows' panels into out, the rows past R as pack pads them (zero quants and fields), and returns how
//       many fp16 scales are not finite numbers (0: the blocks are intact; else out is left unfinished).
// Why a row's blocks are decoded a span at a time into quants, then packed: the formats differ in how
// they store a weight's bits, the panel kinds in how they lay out 8 features' quants, and each side is
// written once that way (a span is one of the file's blocks: 32 weights, or a K-quant's 256).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>

namespace {

constexpr int64_t PANEL = 8, PANEL_GROUP = 2;

inline uint16_t u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
inline void put16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }
inline void put32f(uint8_t* p, float v) { std::memcpy(p, &v, 4); }
inline bool finite_half(uint16_t h) { return (h & 0x7C00) != 0x7C00; }  // exponent all ones: inf or NaN
inline float half_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// An fp16 field copied to feature f's place (`at` its first feature's); false if it is not finite.
inline bool put_half(uint8_t* at, int f, const uint8_t* src) {
  std::memcpy(at + 2 * f, src, 2);
  return finite_half(u16(src));
}

// The 32 weights of a 16-byte run of nibbles: low nibbles first, as ggml packs them (or only one half).
inline void nibbles(const uint8_t* qs, uint8_t* q) {
  for (int l = 0; l < 16; ++l) q[l] = qs[l] & 15;
  for (int l = 0; l < 16; ++l) q[16 + l] = qs[l] >> 4;
}
inline void nibble_half(const uint8_t* qs, int shift, uint8_t* q) {
  for (int l = 0; l < 32; ++l) q[l] = (qs[l] >> shift) & 15;
}

// ggml's get_scale_min_k4: a K-quant's 12 bytes of 6-bit scales and mins -> sc[8], m[8].
inline void scales_and_mins(const uint8_t* s, uint8_t* sc, uint8_t* m) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    m[j] = s[4 + j] & 63;
    sc[4 + j] = (s[8 + j] & 15) | ((s[j] >> 6) << 4);
    m[4 + j] = (s[8 + j] >> 4) | ((s[4 + j] >> 6) << 4);
  }
}

// The panel kinds' quant layouts (panels.py): from 8 features' quants q[f] of a block (as decode gives
// them) to the block's quant bytes.
enum class Layout { Nibbles, Nibbles6, Bytes };

template <Layout L, int QK>
inline void pack_quants(const uint8_t (*q)[256], int64_t at, uint8_t* out) {
  if constexpr (L == Layout::Bytes) {  // byte 16j + 2f + e = q_f[2j + e]
    for (int j = 0; j < QK / 2; ++j)
      for (int f = 0; f < PANEL; ++f) put16(out + 16 * j + 2 * f, u16(q[f] + at + 2 * j));
  } else if constexpr (L == Layout::Nibbles) {  // byte 16c + 2f + e = q_f[4c + e] | q_f[4c + 2 + e] << 4
    for (int c = 0; c < QK / 4; ++c)
      for (int f = 0; f < PANEL; ++f) {
        const uint8_t* s = q[f] + at + 4 * c;
        put16(out + 16 * c + 2 * f, static_cast<uint16_t>(u16(s) | (u16(s + 2) << 4)));  // nibbles: no carry
      }
  } else {  // held h = q + 32 (0..63): low 6 + 2 bits at 16c, the 4 high bits of pairs 2c + 1 at QK * 4
    for (int f = 0; f < PANEL; ++f) {
      uint8_t h[QK];
      for (int k = 0; k < QK; ++k) h[k] = static_cast<uint8_t>(q[f][at + k] + 32);
      for (int c = 0; c < QK / 4; ++c)  // byte 2f + e: h[4c + e] | h[4c + 2 + e] << 6
        put16(out + 16 * c + 2 * f, static_cast<uint16_t>(u16(h + 4 * c) | (u16(h + 4 * c + 2) & 0x0303) << 6));
      for (int c = 0; c < QK / 8; ++c)  // byte 2f + e: h[8c + 2 + e] >> 2 | (h[8c + 6 + e] >> 2) << 4
        put16(out + QK * 4 + 16 * c + 2 * f,
              static_cast<uint16_t>(((u16(h + 8 * c + 2) >> 2) & 0x0F0F) | ((u16(h + 8 * c + 6) >> 2) & 0x0F0F) << 4));
    }
  }
}

// Each format: its span (weights, bytes: one of the file's blocks), its panel kind's block (QK weights,
// BLOCK bytes, of which the quants' are QUANTS, SUB to a unit of UNIT bytes), and decode: feature f's
// span at src -> its quants q and its fields, written into the span's output (the unit at `out`, and
// those after it where a span is several units); returns the fp16 scales that are not finite.
struct Q4_0 {
  static constexpr int64_t weights = 32, bytes = 18, QK = 32, BLOCK = 144, SUB = 1, UNIT = 144;
  static constexpr Layout layout = Layout::Nibbles;
  static int decode(const uint8_t* src, uint8_t* q, uint8_t* out, int f) {
    nibbles(src + 2, q);
    return !put_half(out + 128, f, src);
  }
};

struct Q4_1 {
  static constexpr int64_t weights = 32, bytes = 20, QK = 32, BLOCK = 160, SUB = 1, UNIT = 160;
  static constexpr Layout layout = Layout::Nibbles;
  static int decode(const uint8_t* src, uint8_t* q, uint8_t* out, int f) {
    nibbles(src + 4, q);
    return !put_half(out + 128, f, src) + !put_half(out + 144, f, src + 2);
  }
};

// the fifth bits of a 32-weight block, bit l of the little-endian word for weight l
inline uint32_t fifth_bits(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

struct Q5_0 {  // kind q8: the int8 q - 16
  static constexpr int64_t weights = 32, bytes = 22, QK = 32, BLOCK = 272, SUB = 1, UNIT = 272;
  static constexpr Layout layout = Layout::Bytes;
  static int decode(const uint8_t* src, uint8_t* q, uint8_t* out, int f) {
    const uint32_t qh = fifth_bits(src + 2);
    nibbles(src + 6, q);
    for (int l = 0; l < 32; ++l) q[l] = static_cast<uint8_t>((q[l] | ((qh >> l) & 1) << 4) - 16);
    return !put_half(out + 256, f, src);
  }
};

struct Q5_1 {  // kind u8: float32 scale and min
  static constexpr int64_t weights = 32, bytes = 24, QK = 32, BLOCK = 320, SUB = 1, UNIT = 320;
  static constexpr Layout layout = Layout::Bytes;
  static int decode(const uint8_t* src, uint8_t* q, uint8_t* out, int f) {
    const uint32_t qh = fifth_bits(src + 4);
    nibbles(src + 8, q);
    for (int l = 0; l < 32; ++l) q[l] = static_cast<uint8_t>(q[l] | ((qh >> l) & 1) << 4);
    put32f(out + 256 + 4 * f, half_float(u16(src)));
    put32f(out + 288 + 4 * f, half_float(u16(src + 2)));
    return !finite_half(u16(src)) + !finite_half(u16(src + 2));
  }
};

struct Q8_0 {
  static constexpr int64_t weights = 32, bytes = 34, QK = 32, BLOCK = 272, SUB = 1, UNIT = 272;
  static constexpr Layout layout = Layout::Bytes;
  static int decode(const uint8_t* src, uint8_t* q, uint8_t* out, int f) {
    std::memcpy(q, src + 2, 32);
    return !put_half(out + 256, f, src);
  }
};

// Q4_K: a super-block is one unit of 8 blocks, each with its 6-bit scale and min as bytes; d and dmin
// once a unit.
struct Q4_K {
  static constexpr int64_t weights = 256, bytes = 144, QK = 32, BLOCK = 144, SUB = 8, UNIT = 8 * 144 + 32;
  static constexpr Layout layout = Layout::Nibbles;
  static int decode(const uint8_t* src, uint8_t* q, uint8_t* out, int f) {
    uint8_t sc[8], m[8];
    scales_and_mins(src + 4, sc, m);
    for (int t = 0; t < 8; ++t) {  // block t: the low (t even) or high nibbles of the qs' 32-byte run t / 2
      nibble_half(src + 16 + 32 * (t / 2), 4 * (t % 2), q + 32 * t);
      out[t * BLOCK + 128 + f] = sc[t];
      out[t * BLOCK + 136 + f] = m[t];
    }
    return !put_half(out + 8 * BLOCK, f, src) + !put_half(out + 8 * BLOCK + 16, f, src + 2);
  }
};

// Q5_K: a super-block is 8 units of kind u8, scale d*sc and min -dmin*m in float32 (exact products).
struct Q5_K {
  static constexpr int64_t weights = 256, bytes = 176, QK = 32, BLOCK = 320, SUB = 1, UNIT = 320;
  static constexpr Layout layout = Layout::Bytes;
  static int decode(const uint8_t* src, uint8_t* q, uint8_t* out, int f) {
    uint8_t sc[8], m[8];
    scales_and_mins(src + 4, sc, m);
    const float d = half_float(u16(src)), dmin = half_float(u16(src + 2));
    const uint8_t* qh = src + 16;
    for (int t = 0; t < 8; ++t) {
      uint8_t* qt = q + 32 * t;
      nibble_half(src + 48 + 32 * (t / 2), 4 * (t % 2), qt);
      for (int l = 0; l < 32; ++l) qt[l] = static_cast<uint8_t>(qt[l] | ((qh[l] >> t) & 1) << 4);
      put32f(out + t * UNIT + 256 + 4 * f, d * static_cast<float>(sc[t]));
      put32f(out + t * UNIT + 288 + 4 * f, dmin * static_cast<float>(m[t]) * -1.0f);
    }
    return !finite_half(u16(src)) + !finite_half(u16(src + 2));
  }
};

// Q6_K: a super-block is one unit of 16 blocks of 16, each with its int8 scale; d once a unit. Weight
// 128 h + 32 g + l: the low (g < 2) or high nibble of ql[64 h + 32 (g % 2) + l], and bits 2g of qh[32 h + l].
struct Q6_K {
  static constexpr int64_t weights = 256, bytes = 210, QK = 16, BLOCK = 104, SUB = 16, UNIT = 16 * 104 + 16;
  static constexpr Layout layout = Layout::Nibbles6;
  static int decode(const uint8_t* src, uint8_t* q, uint8_t* out, int f) {
    for (int h = 0; h < 2; ++h)
      for (int g = 0; g < 4; ++g) {
        const uint8_t* ql = src + 64 * h + 32 * (g % 2);
        const uint8_t* qh = src + 128 + 32 * h;
        uint8_t* qg = q + 128 * h + 32 * g;
        for (int l = 0; l < 32; ++l)
          qg[l] = static_cast<uint8_t>((((ql[l] >> (4 * (g / 2))) & 15) | ((qh[l] >> (2 * g)) & 3) << 4) - 32);
      }
    for (int b = 0; b < 16; ++b) out[b * BLOCK + 96 + f] = src[192 + b];
    return !put_half(out + 16 * BLOCK, f, src + 208);
  }
};

// MXFP4: the codes as stored and the exponent byte (e = 255 is ggml's 2^127, not a damaged block).
struct MXFP4 {
  static constexpr int64_t weights = 32, bytes = 17, QK = 32, BLOCK = 136, SUB = 1, UNIT = 136;
  static constexpr Layout layout = Layout::Nibbles;
  static int decode(const uint8_t* src, uint8_t* q, uint8_t* out, int f) {
    nibbles(src + 1, q);
    out[128 + f] = src[0];
    return 0;
  }
};

template <class F>
int64_t repack(const at::Tensor& raw, const at::Tensor& out) {
  static_assert(F::weights % (F::QK * F::SUB) == 0 && F::weights <= 256, "a span is whole units");
  constexpr int64_t units_per_span = F::weights / (F::QK * F::SUB), blocks_per_span = F::weights / F::QK;
  const int64_t R = raw.size(0), row_bytes = raw.size(1), spans = row_bytes / F::bytes;
  const int64_t P = (R + PANEL * PANEL_GROUP - 1) / (PANEL * PANEL_GROUP) * PANEL_GROUP;
  TORCH_CHECK(row_bytes % F::bytes == 0, "a row of ", row_bytes, " bytes is not whole blocks of ", F::bytes);
  TORCH_CHECK(out.dim() == 3 && out.size(0) == P && out.size(1) == spans * units_per_span && out.size(2) == F::UNIT,
              "out must be panels [", P, ", ", spans * units_per_span, ", ", F::UNIT, "], got ", out.sizes());
  const uint8_t* rp = raw.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  std::atomic<int64_t> damaged{0};
  const int64_t panel_bytes = spans * units_per_span * F::UNIT;
  at::parallel_for(0, P, 4, [&](int64_t p0, int64_t p1) {
    int64_t bad = 0;
    alignas(64) uint8_t q[PANEL][256];
    for (int64_t p = p0; p < p1; ++p) {
      uint8_t* panel = op + p * panel_bytes;
      const int64_t rows = std::min<int64_t>(PANEL, std::max<int64_t>(0, R - p * PANEL));
      if (rows < PANEL) std::memset(panel, 0, panel_bytes);  // padding rows: zero quants and fields
      for (int64_t s = 0; s < spans; ++s) {
        uint8_t* span = panel + s * units_per_span * F::UNIT;
        for (int f = 0; f < PANEL; ++f) {
          if (f < rows)
            bad += F::decode(rp + (p * PANEL + f) * row_bytes + s * F::bytes, q[f], span, f);
          else
            std::memset(q[f], 0, F::weights);
        }
        for (int64_t b = 0; b < blocks_per_span; ++b)
          pack_quants<F::layout, F::QK>(q, b * F::QK, span + (b / F::SUB) * F::UNIT + (b % F::SUB) * F::BLOCK);
      }
    }
    damaged += bad;
  });
  return damaged.load();
}

int64_t repack_blocks(const at::Tensor& raw_in, c10::string_view format, at::Tensor out) {
  TORCH_CHECK(raw_in.dim() == 2 && raw_in.scalar_type() == at::kByte, "raw must be rows [R, row bytes] uint8");
  TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous(), "out must be contiguous uint8 panels");
  const at::Tensor raw = raw_in.contiguous();
  const std::string name(format);
  if (name == "Q4_0") return repack<Q4_0>(raw, out);
  if (name == "Q4_1") return repack<Q4_1>(raw, out);
  if (name == "Q5_0") return repack<Q5_0>(raw, out);
  if (name == "Q5_1") return repack<Q5_1>(raw, out);
  if (name == "Q8_0") return repack<Q8_0>(raw, out);
  if (name == "Q4_K") return repack<Q4_K>(raw, out);
  if (name == "Q5_K") return repack<Q5_K>(raw, out);
  if (name == "Q6_K") return repack<Q6_K>(raw, out);
  if (name == "MXFP4") return repack<MXFP4>(raw, out);
  TORCH_CHECK(false, "no panels for the format ", name);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_native, m) {
  m.def("repack_blocks(Tensor raw, str format, Tensor(a!) out) -> int");
}

TORCH_LIBRARY_IMPL(kvserve_native, CPU, m) {
  m.impl("repack_blocks", &repack_blocks);
}
