// Attention for many short spans in one call: each span appends its k/v to its session's cache
// and attends over that session's history, with no per-span Python.
//
// Op contract, kvcache_native::attend_spans (appends to the caches):
//   q   [1, H_q, S, D] f32, k [1, H_kv, S, D] f32, v [1, H_kv, S, Dv] f32 (any strides; S is the flat token axis)
//   k_caches[i] [L, H_kv, alloc_i, D] contiguous, v_caches[i] [L, H_kv, alloc_i, Dv]: every cache
//       float32, or every cache float16 (half the bytes to read per step; the math stays float32)
//   offsets[i], sizes[i]: span i owns tokens offsets[i] .. offsets[i] + sizes[i] of the step
//   lengths[i]: tokens already in cache i (the span's k/v land at lengths[i] .. lengths[i] + sizes[i])
//   returns [1, H_q, S, Dv] f32: rows of the listed spans are filled, other rows are left for the caller
// Token j of a span sees history 0 .. lengths[i] + j (causal, aligned to the end of the history).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include "simd.h"
#include <cmath>
#include <vector>

namespace {

using kvserve_simd::exp8;
using kvserve_simd::hsum;
using Half = c10::Half;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// One query over `visible` keys/values (of element type T) of one head; NV = head_dim / 8, q and the
// output stay in registers.
template <int NV, class T>
void attend_one(const float* q, const T* keys, const T* values, int64_t visible, float scale, float* out,
                std::vector<float>& scores) {
  constexpr int D = NV * 8;
  __m256 qv[NV];
  for (int i = 0; i < NV; ++i) qv[i] = _mm256_mul_ps(_mm256_loadu_ps(q + 8 * i), _mm256_set1_ps(scale));
  scores.resize((visible + 7) / 8 * 8);
  // Scores 8 keys at a time: 8 partial vectors reduce to one vector of 8 sums by a hadd tree, which
  // costs ~1 op a key where a horizontal sum per key costs ~6.
  __m256 top8 = _mm256_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 8 <= visible; t += 8) {
    __m256 part[8];
    for (int j = 0; j < 8; ++j) {
      const T* kt = keys + (t + j) * D;
      part[j] = _mm256_mul_ps(qv[0], load8(kt));
      for (int i = 1; i < NV; ++i) part[j] = _mm256_fmadd_ps(qv[i], load8(kt + 8 * i), part[j]);
    }
    const __m256 g0 = _mm256_hadd_ps(_mm256_hadd_ps(part[0], part[1]), _mm256_hadd_ps(part[2], part[3]));
    const __m256 g1 = _mm256_hadd_ps(_mm256_hadd_ps(part[4], part[5]), _mm256_hadd_ps(part[6], part[7]));
    const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20), _mm256_permute2f128_ps(g0, g1, 0x31));
    _mm256_storeu_ps(&scores[t], sums);
    top8 = _mm256_max_ps(top8, sums);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, top8);
  float top = -INFINITY;
  for (float l : lanes) top = std::max(top, l);
  for (; t < visible; ++t) {
    const T* kt = keys + t * D;
    __m256 a = _mm256_mul_ps(qv[0], load8(kt));
    for (int i = 1; i < NV; ++i) a = _mm256_fmadd_ps(qv[i], load8(kt + 8 * i), a);
    top = std::max(top, scores[t] = hsum(a));
  }
  for (int64_t t = visible; t < (int64_t)scores.size(); ++t) scores[t] = -INFINITY;
  __m256 total = _mm256_setzero_ps();
  for (int64_t t = 0; t < (int64_t)scores.size(); t += 8) {
    const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(&scores[t]), _mm256_set1_ps(top)));
    _mm256_storeu_ps(&scores[t], p);
    total = _mm256_add_ps(total, p);
  }
  __m256 acc[NV];
  for (int i = 0; i < NV; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t t = 0; t < visible; ++t) {
    const __m256 p = _mm256_set1_ps(scores[t]);
    const T* vt = values + t * D;
    for (int i = 0; i < NV; ++i) acc[i] = _mm256_fmadd_ps(p, load8(vt + 8 * i), acc[i]);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / hsum(total));
  for (int i = 0; i < NV; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(acc[i], inv));
}

// Any head dims: the same math, scalar.
template <class T>
void attend_one_any(const float* q, const T* keys, const T* values, int64_t visible, float scale, int64_t D,
                    int64_t Dv, float* out, std::vector<float>& scores) {
  scores.resize(visible);
  float top = -INFINITY;
  for (int64_t t = 0; t < visible; ++t) {
    float s = 0.0f;
    for (int64_t i = 0; i < D; ++i) s += q[i] * static_cast<float>(keys[t * D + i]);
    top = std::max(top, scores[t] = s * scale);
  }
  float total = 0.0f;
  for (int64_t t = 0; t < visible; ++t) total += scores[t] = std::exp(scores[t] - top);
  std::fill(out, out + Dv, 0.0f);
  for (int64_t t = 0; t < visible; ++t)
    for (int64_t i = 0; i < Dv; ++i) out[i] += scores[t] / total * static_cast<float>(values[t * Dv + i]);
}

// Rows [n, D] of float32 -> the cache's element type.
inline void store_rows(Half* dst, const float* src, int64_t count) {
  for (int64_t i = 0; i < count; ++i) dst[i] = Half(src[i]);
}
inline void store_rows(float* dst, const float* src, int64_t count) { std::memcpy(dst, src, count * sizeof(float)); }

template <class T>
void append_and_attend(const float* qp, const float* kp, const float* vp, float* op, int64_t layer, float scale,
                       at::TensorList k_caches, at::TensorList v_caches, at::IntArrayRef offsets,
                       at::IntArrayRef lengths, at::IntArrayRef sizes, int64_t Hq, int64_t Hkv, int64_t S, int64_t D,
                       int64_t Dv) {
  const int64_t n_spans = offsets.size(), group = Hq / Hkv;
  std::vector<T*> kc(n_spans), vc(n_spans);
  std::vector<int64_t> alloc(n_spans);
  for (int64_t i = 0; i < n_spans; ++i) {
    alloc[i] = k_caches[i].size(2);
    kc[i] = k_caches[i].data_ptr<T>() + layer * Hkv * alloc[i] * D;
    vc[i] = v_caches[i].data_ptr<T>() + layer * Hkv * alloc[i] * Dv;
  }
  // Append first, so every query below can read its own token's k/v from the cache.
  for (int64_t i = 0; i < n_spans; ++i)
    for (int64_t h = 0; h < Hkv; ++h) {
      const int64_t rows = sizes[i], at_token = offsets[i], at_slot = lengths[i];
      store_rows(kc[i] + (h * alloc[i] + at_slot) * D, kp + (h * S + at_token) * D, rows * D);
      store_rows(vc[i] + (h * alloc[i] + at_slot) * Dv, vp + (h * S + at_token) * Dv, rows * Dv);
    }
  at::parallel_for(0, n_spans * Hq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t i = job / Hq, h = job % Hq, hk = h / group;
      const T* keys = kc[i] + hk * alloc[i] * D;
      const T* values = vc[i] + hk * alloc[i] * Dv;
      for (int64_t j = 0; j < sizes[i]; ++j) {
        const int64_t token = offsets[i] + j, visible = lengths[i] + j + 1;
        const float* qv = qp + (h * S + token) * D;
        float* o = op + (h * S + token) * Dv;
        if (D == 64 && Dv == 64)
          attend_one<8>(qv, keys, values, visible, scale, o, scores);
        else if (D == 128 && Dv == 128)
          attend_one<16>(qv, keys, values, visible, scale, o, scores);
        else
          attend_one_any(qv, keys, values, visible, scale, D, Dv, o, scores);
      }
    }
  });
}

at::Tensor attend_spans(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, int64_t layer,
                        double scale, at::TensorList k_caches, at::TensorList v_caches, at::IntArrayRef offsets,
                        at::IntArrayRef lengths, at::IntArrayRef sizes) {
  const int64_t n_spans = offsets.size();
  TORCH_CHECK(n_spans > 0 && k_caches.size() == n_spans && v_caches.size() == n_spans && lengths.size() == n_spans &&
                  sizes.size() == n_spans, "one cache pair, offset, length and size per span, at least one span");
  TORCH_CHECK(q_in.dim() == 4 && q_in.size(0) == 1 && k_in.dim() == 4 && v_in.dim() == 4, "q, k, v must be [1, H, S, D]");
  const at::Tensor q = q_in[0].contiguous(), k = k_in[0].contiguous(), v = v_in[0].contiguous();
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "attend_spans works in float32");
  const int64_t Hq = q.size(0), S = q.size(1), D = q.size(2), Hkv = k.size(0), Dv = v.size(2);
  const at::ScalarType cache_type = k_caches[0].scalar_type();
  TORCH_CHECK(cache_type == at::kFloat || cache_type == at::kHalf, "caches must be float32 or float16");
  for (int64_t i = 0; i < n_spans; ++i) {
    const at::Tensor &kt = k_caches[i], &vt = v_caches[i];
    TORCH_CHECK(kt.scalar_type() == cache_type && vt.scalar_type() == cache_type && kt.is_contiguous() &&
                    vt.is_contiguous() && kt.size(1) == Hkv && kt.size(3) == D && vt.size(3) == Dv && layer < kt.size(0),
                "cache ", i, " does not match the step's dtype, heads, dims or layers");
    TORCH_CHECK(offsets[i] >= 0 && sizes[i] > 0 && offsets[i] + sizes[i] <= S && lengths[i] >= 0 &&
                    lengths[i] + sizes[i] <= kt.size(2), "span ", i, " does not fit its cache or the step");
  }
  at::Tensor out = at::empty({1, Hq, S, Dv}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (cache_type == at::kHalf)
    append_and_attend<Half>(qp, kp, vp, op, layer, (float)scale, k_caches, v_caches, offsets, lengths, sizes, Hq, Hkv, S, D, Dv);
  else
    append_and_attend<float>(qp, kp, vp, op, layer, (float)scale, k_caches, v_caches, offsets, lengths, sizes, Hq, Hkv, S, D, Dv);
  return out;
}

}  // namespace

TORCH_LIBRARY(kvcache_native, m) {
  m.def("attend_spans(Tensor q, Tensor k, Tensor v, int layer, float scale, Tensor(a!)[] k_caches, "
        "Tensor(b!)[] v_caches, int[] offsets, int[] lengths, int[] sizes) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvcache_native, CPU, m) { m.impl("attend_spans", &attend_spans); }
