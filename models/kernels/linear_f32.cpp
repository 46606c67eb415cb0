// kvserve_native::linear_f32(x [M, K] float32, w [N, K] float32) -> [M, N] float32: the f32 weight
// mode's matmul, batch-invariant. BLAS picks its kernel and its blocking of K by the shape, so one
// row's output changes in its last bits with the rows beside it; here every output is the same chain:
// eight lanes accumulate x[k..k+8) * w[k..k+8) by FMA in K order, the lanes are summed in one fixed
// order, then the K % 8 tail in order. Tiles of 1..3 rows by 4 features only share loads. Features go
// in blocks that stay in L2 while every row group passes over them, so a prefill reads each weight once.
// kvserve_native::linear_bf16(x [M, K] float32, w [N, K] bfloat16) -> [M, N] float32: the same, on the
// bfloat16 weights of a file that stores them so (each widened to float32 exactly as it is loaded).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "simd.h"

namespace {

constexpr int64_t FEATURES = 4;  // weight rows a tile shares each activation load with
constexpr int64_t MAX_ROWS = 3;  // activation rows a tile shares each weight load with
constexpr int64_t BLOCK_BYTES = 160 * 1024;  // a feature block's weights, to stay in L2

inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const c10::BFloat16* w) {  // a bfloat16 is the high half of its float32
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

template <int R, int C, class W>
inline void tile(const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t K, float* out, int64_t ldo) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + r * ldx + k);
    for (int c = 0; c < C; ++c) {
      const __m256 wv = load8(w + c * ldw + k);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float sum = kvserve_simd::hsum(acc[r][c]);
      for (int64_t t = k; t < K; ++t) sum = std::fma(x[r * ldx + t], static_cast<float>(w[c * ldw + t]), sum);
      out[r * ldo + c] = sum;
    }
}

template <class W>
using TileFn = void (*)(const float*, int64_t, const W*, int64_t, int64_t, float*, int64_t);
template <class W>
constexpr TileFn<W> WIDE[MAX_ROWS] = {tile<1, FEATURES, W>, tile<2, FEATURES, W>, tile<3, FEATURES, W>};
template <class W>
constexpr TileFn<W> NARROW[MAX_ROWS] = {tile<1, 1, W>, tile<2, 1, W>, tile<3, 1, W>};

template <class W>
at::Tensor linear_float(const at::Tensor& x_in, const at::Tensor& w_in) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && w_in.scalar_type() == c10::CppTypeToScalarType<W>::value,
              "linear_f32 / linear_bf16 take float32 activations and float32 / bfloat16 weights");
  TORCH_CHECK(w_in.dim() == 2 && x_in.size(-1) == w_in.size(1), "linear_f32: x [..., K] and w [N, K]");
  const auto x = x_in.reshape({-1, x_in.size(-1)}).contiguous();
  const auto w = w_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto sizes = x_in.sizes().vec();
  sizes.back() = N;
  auto out = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const W* wp = w.data_ptr<W>();
  float* op = out.data_ptr<float>();
  const int64_t block = std::max<int64_t>(FEATURES, BLOCK_BYTES / (sizeof(W) * std::max<int64_t>(K, 1)) / FEATURES * FEATURES);
  at::parallel_for(0, (N + block - 1) / block, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * block, n1 = std::min(N, n0 + block);
      for (int64_t m = 0; m < M; m += MAX_ROWS) {
        const int64_t rows = std::min(MAX_ROWS, M - m);
        int64_t n = n0;
        for (; n + FEATURES <= n1; n += FEATURES) WIDE<W>[rows - 1](xp + m * K, K, wp + n * K, K, K, op + m * N + n, N);
        for (; n < n1; ++n) NARROW<W>[rows - 1](xp + m * K, K, wp + n * K, K, K, op + m * N + n, N);
      }
    }
  });
  return out.reshape(sizes);
}

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w) { return linear_float<float>(x, w); }
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w) { return linear_float<c10::BFloat16>(x, w); }

at::Tensor linear_f32_meta(const at::Tensor& x, const at::Tensor& w) {
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end());
  shape.back() = w.sym_size(0);
  return at::empty_symint(shape, x.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_native, m) {
  m.def("linear_f32(Tensor x, Tensor w) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor w) -> Tensor");
}
TORCH_LIBRARY_IMPL(kvserve_native, CPU, m) {
  m.impl("linear_f32", &linear_f32);
  m.impl("linear_bf16", &linear_bf16);
}
TORCH_LIBRARY_IMPL(kvserve_native, Meta, m) {
  m.impl("linear_f32", &linear_f32_meta);
  m.impl("linear_bf16", &linear_f32_meta);
}
