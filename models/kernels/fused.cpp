// Fused elementwise kernels for the decoder: one op where eager torch runs five to ten, because at
// batch 1 a step is ~40 small ops per layer and their dispatch overhead rivals the matmuls.
//
// Op contracts (kvserve_native::*, float32, last dimension contiguous):
//   rms_norm(x [..., C], w [C], eps) -> [..., C]                  w * x / sqrt(mean(x^2) + eps)
//   rope_qkv(qkv [1, n, (Hq + 2 Hkv) * D], cos [n, D], sin [n, D], Hq, Hkv)
//       -> q [1, Hq, n, D], k [1, Hkv, n, D], v [1, Hkv, n, D]    rotate-half RoPE on q and k
//   silu_mul(x [..., 2F]) -> [..., F]                              silu(x[..., :F]) * x[..., F:]
//   swiglu(x [..., 2F], limit, alpha) -> [..., F]                 limit 0: silu_mul's; > 0: gpt-oss's
//       (u + 1) * g / (1 + exp(-alpha g)), g = min(x[..., :F], limit), u = x[..., F:] clamped to +-limit
//   Each row in one order, eight lanes then the rest: a row's bits depend on F alone, never on the rows
//   beside it or the threads (ATen's elementwise ops give a thread's last elements a scalar exp, so
//   their bits move with the split).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include "simd.h"
#include <algorithm>
#include <cmath>
#include <tuple>

namespace {

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  // no aten::to or empty_like: each is a dispatcher call, and this runs twice a layer
  const at::Tensor x = x_in.contiguous(), w = (w_in.scalar_type() == at::kFloat ? w_in : w_in.to(at::kFloat)).contiguous();
  TORCH_CHECK(x.scalar_type() == at::kFloat, "rms_norm works in float32");
  const int64_t C = x.size(-1), rows = x.numel() / C;
  at::Tensor out = at::empty(x.sizes(), x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * C;
      float* o = op + r * C;
      __m256 acc = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 8 <= C; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(xr + i), _mm256_loadu_ps(xr + i), acc);
      float buf[8], ss = 0.0f;
      _mm256_storeu_ps(buf, acc);
      for (float b : buf) ss += b;
      for (; i < C; ++i) ss += xr[i] * xr[i];
      const float inv = 1.0f / std::sqrt(ss / C + (float)eps);
      for (int64_t j = 0; j < C; ++j) o[j] = wp[j] * (xr[j] * inv);
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_qkv(const at::Tensor& qkv_in, const at::Tensor& cos_in,
                                                        const at::Tensor& sin_in, int64_t Hq, int64_t Hkv) {
  const at::Tensor qkv = qkv_in.contiguous(), cos = cos_in.contiguous(), sin = sin_in.contiguous();
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat, "rope_qkv works in float32");
  const int64_t n = qkv.size(1), D = cos.size(1), half = D / 2, width = (Hq + 2 * Hkv) * D;
  TORCH_CHECK(qkv.size(2) == width && cos.size(0) == n, "qkv must be [1, n, (Hq + 2 Hkv) * D] with cos [n, D]");
  at::Tensor q = at::empty({1, Hq, n, D}, qkv.options()), k = at::empty({1, Hkv, n, D}, qkv.options()),
             v = at::empty({1, Hkv, n, D}, qkv.options());
  const float *src = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  at::parallel_for(0, n * (Hq + 2 * Hkv), 64, [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) {
      const int64_t t = job / (Hq + 2 * Hkv), h = job % (Hq + 2 * Hkv);
      const float* x = src + t * width + h * D;
      if (h >= Hq + Hkv) {  // v: a plain transpose
        std::memcpy(vp + ((h - Hq - Hkv) * n + t) * D, x, D * sizeof(float));
        continue;
      }
      float* o = h < Hq ? qp + (h * n + t) * D : kp + ((h - Hq) * n + t) * D;
      const float *c = cp + t * D, *s = sp + t * D;
      for (int64_t i = 0; i < half; ++i) {
        o[i] = x[i] * c[i] - x[i + half] * s[i];
        o[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
      }
    }
  });
  return {q, k, v};
}

void swiglu_row(const float* gate, const float* up, float* o, int64_t F, float limit, float alpha) {
  int64_t j = 0;
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  if (limit <= 0) {
    for (; j + 8 <= F; j += 8) {
      const __m256 g = _mm256_loadu_ps(gate + j);
      const __m256 sig = _mm256_div_ps(g, _mm256_add_ps(one, kvserve_simd::exp8(_mm256_sub_ps(zero, g))));
      _mm256_storeu_ps(o + j, _mm256_mul_ps(sig, _mm256_loadu_ps(up + j)));
    }
    for (; j < F; ++j) o[j] = gate[j] / (1.0f + std::exp(-gate[j])) * up[j];
    return;
  }
  const __m256 hi = _mm256_set1_ps(limit), lo = _mm256_set1_ps(-limit), a = _mm256_set1_ps(alpha);
  for (; j + 8 <= F; j += 8) {
    const __m256 g = _mm256_min_ps(_mm256_loadu_ps(gate + j), hi);
    const __m256 u = _mm256_max_ps(_mm256_min_ps(_mm256_loadu_ps(up + j), hi), lo);
    const __m256 glu = _mm256_div_ps(g, _mm256_add_ps(one, kvserve_simd::exp8(_mm256_sub_ps(zero, _mm256_mul_ps(g, a)))));
    _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_add_ps(u, one), glu));
  }
  for (; j < F; ++j) {
    const float g = std::min(gate[j], limit), u = std::max(std::min(up[j], limit), -limit);
    o[j] = (u + 1.0f) * (g / (1.0f + std::exp(-(g * alpha))));
  }
}

at::Tensor swiglu(const at::Tensor& x_in, double limit, double alpha) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.scalar_type() == at::kFloat, "swiglu works in float32");
  const int64_t F = x.size(-1) / 2, rows = F == 0 ? 0 : x.numel() / (2 * F);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = F;
  at::Tensor out = at::empty(shape, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      swiglu_row(xp + r * 2 * F, xp + r * 2 * F + F, op + r * F, F, static_cast<float>(limit), static_cast<float>(alpha));
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& x) { return swiglu(x, 0.0, 0.0); }

// Shapes only, for tracing and export (symbolic token counts).
at::Tensor rms_norm_meta(const at::Tensor& x, const at::Tensor&, double) { return at::empty_like(x); }

std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_qkv_meta(const at::Tensor& qkv, const at::Tensor& cos,
                                                             const at::Tensor&, int64_t Hq, int64_t Hkv) {
  const c10::SymInt n = qkv.sym_size(1), D = cos.sym_size(1);
  return {at::empty_symint({1, Hq, n, D}, qkv.options()), at::empty_symint({1, Hkv, n, D}, qkv.options()),
          at::empty_symint({1, Hkv, n, D}, qkv.options())};
}

at::Tensor silu_mul_meta(const at::Tensor& x) {
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end());
  shape.back() = shape.back() / 2;
  return at::empty_symint(shape, x.options());
}

at::Tensor swiglu_meta(const at::Tensor& x, double, double) { return silu_mul_meta(x); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_native, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("rope_qkv(Tensor qkv, Tensor cos, Tensor sin, int n_heads, int n_kv_heads) -> (Tensor, Tensor, Tensor)");
  m.def("silu_mul(Tensor x) -> Tensor");
  m.def("swiglu(Tensor x, float limit, float alpha) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_native, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_qkv", &rope_qkv);
  m.impl("silu_mul", &silu_mul);
  m.impl("swiglu", &swiglu);
}

TORCH_LIBRARY_IMPL(kvserve_native, Meta, m) {
  m.impl("rms_norm", &rms_norm_meta);
  m.impl("rope_qkv", &rope_qkv_meta);
  m.impl("silu_mul", &silu_mul_meta);
  m.impl("swiglu", &swiglu_meta);
}
