// kvserve_native::linear_f32(x [M, K] float32, w [N, K] float32) -> [M, N] float32: the f32 weight
// mode's matmul, batch-invariant. BLAS picks its kernel and its blocking of K by the shape, so one
// row's output changes in its last bits with the rows beside it; here every output is the same chain:
// eight lanes accumulate x[k..k+8) * w[k..k+8) by FMA in K order, the lanes are summed in one fixed
// order, then the K % 8 tail in order. Tiles of 1..3 rows by 4 features only share loads. Features go
// in blocks that stay in L2 while every row group passes over them, so a prefill reads each weight once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "simd.h"

namespace {

constexpr int64_t FEATURES = 4;  // weight rows a tile shares each activation load with
constexpr int64_t MAX_ROWS = 3;  // activation rows a tile shares each weight load with
constexpr int64_t BLOCK_BYTES = 160 * 1024;  // a feature block's weights, to stay in L2

template <int R, int C>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, float* out, int64_t ldo) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + r * ldx + k);
    for (int c = 0; c < C; ++c) {
      const __m256 wv = _mm256_loadu_ps(w + c * ldw + k);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float sum = kvserve_simd::hsum(acc[r][c]);
      for (int64_t t = k; t < K; ++t) sum = std::fma(x[r * ldx + t], w[c * ldw + t], sum);
      out[r * ldo + c] = sum;
    }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t);
constexpr TileFn WIDE[MAX_ROWS] = {tile<1, FEATURES>, tile<2, FEATURES>, tile<3, FEATURES>};
constexpr TileFn NARROW[MAX_ROWS] = {tile<1, 1>, tile<2, 1>, tile<3, 1>};

at::Tensor linear_f32(const at::Tensor& x_in, const at::Tensor& w_in) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && w_in.scalar_type() == at::kFloat, "linear_f32 takes float32");
  TORCH_CHECK(w_in.dim() == 2 && x_in.size(-1) == w_in.size(1), "linear_f32: x [..., K] and w [N, K]");
  const auto x = x_in.reshape({-1, x_in.size(-1)}).contiguous();
  const auto w = w_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto sizes = x_in.sizes().vec();
  sizes.back() = N;
  auto out = at::empty({M, N}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t block = std::max<int64_t>(FEATURES, BLOCK_BYTES / (4 * std::max<int64_t>(K, 1)) / FEATURES * FEATURES);
  at::parallel_for(0, (N + block - 1) / block, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * block, n1 = std::min(N, n0 + block);
      for (int64_t m = 0; m < M; m += MAX_ROWS) {
        const int64_t rows = std::min(MAX_ROWS, M - m);
        int64_t n = n0;
        for (; n + FEATURES <= n1; n += FEATURES) WIDE[rows - 1](xp + m * K, K, wp + n * K, K, K, op + m * N + n, N);
        for (; n < n1; ++n) NARROW[rows - 1](xp + m * K, K, wp + n * K, K, K, op + m * N + n, N);
      }
    }
  });
  return out.reshape(sizes);
}

at::Tensor linear_f32_meta(const at::Tensor& x, const at::Tensor& w) {
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end());
  shape.back() = w.sym_size(0);
  return at::empty_symint(shape, x.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_native, m) { m.def("linear_f32(Tensor x, Tensor w) -> Tensor"); }
TORCH_LIBRARY_IMPL(kvserve_native, CPU, m) { m.impl("linear_f32", &linear_f32); }
TORCH_LIBRARY_IMPL(kvserve_native, Meta, m) { m.impl("linear_f32", &linear_f32_meta); }
