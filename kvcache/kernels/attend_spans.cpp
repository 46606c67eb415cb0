// Attention for many short spans in one call: each span appends its k/v to its session's blocks in
// the shared pool and attends over that session's history, read through its block table (no gather).
//
// Op contract, kvcache_native::attend_spans (appends to the pools):
//   q   [1, H_q, S, D] f32, k [1, H_kv, S, D] f32, v [1, H_kv, S, Dv] f32 (any strides; S is the flat token axis)
//   k_pools[i] [N, L, H_kv, D, B] contiguous (keys transposed within a block), v_pools[i] [N, L, H_kv, B, Dv]:
//       span i's pool (usually one pool repeated); every pool float32, or every pool float16 (the math stays
//       float32). B, the block size, is a power of two of at least 4.
//   tables: int64, every span's block ids in history order, concatenated; span i's start at table_starts[i]
//   offsets[i], sizes[i]: span i owns tokens offsets[i] .. offsets[i] + sizes[i] of the step
//   lengths[i]: tokens already in span i's history (its k/v land at lengths[i] .. lengths[i] + sizes[i])
//   window: 0, or w > 0 for a sliding window of w keys; softcap: 0, or c > 0 to cap each scaled score as c tanh(s / c)
//   sinks: none, or f32 [H_q]: a logit per query head that joins each of its rows' softmax with no value (gpt-oss)
//   returns [1, H_q, S, Dv] f32
// Token j of a span, at position p = lengths[i] + j, sees history 0 .. p (causal, aligned to the end of the
// history), or with a window p - w + 1 .. p (transformers' sliding_window). Keys before the window are never read.
// Why keys are stored transposed: the kernel scores a chunk of keys as vectors over the keys, each lane
// summing over the head dim in order, which a [D, B] block gives as whole vectors.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include "attend_scalar.h"
#include "attend_spans.h"
#include "attend_vectors.h"
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

using Half = c10::Half;
constexpr int CHUNK = 32;              // keys scored, then summed, together (a multiple of 16, the widest vector)
constexpr int64_t PREFETCH_CHUNKS = 1;  // how many chunks ahead the history is fetched
constexpr auto PREFETCH_HINT = _MM_HINT_T1;
constexpr int MAX_ROWS = 48;           // query rows (tokens x the heads of a KV head) a job attends together
constexpr int WIDEN_ROWS = 8;          // from this many rows a job widens each chunk to float32 once for them all

// One (layer, KV head) of a session's history: token t lies in block t / B, at t % B. A value block is
// [B, D] (row t % B); a key block [D, B] (column t % B).
template <class T>
struct Paged {
  const T* const* blocks;  // each block's start for this layer and head, in history order
  int shift;               // log2(B)
  int64_t mask, D;         // B - 1, row width
  const T* row(int64_t t) const { return blocks[t >> shift] + (t & mask) * D; }
  float key(int64_t t, int64_t d) const { return static_cast<float>(blocks[t >> shift][d * (mask + 1) + (t & mask)]); }
};

// A thread's working memory for one job's rows (attend_chunks.h).
struct Scratch {
  std::vector<float> q, acc, s, kt, vb, top, shift, corr, total;
  void size(int rows, int D) {
    const size_t padded = rows + 16;  // per-row figures are also read a whole vector at a time
    q.resize(rows * D), acc.resize(rows * D), s.resize(rows * CHUNK), kt.resize(D * CHUNK), vb.resize(CHUNK * D);
    top.resize(padded), shift.resize(padded), corr.resize(padded), total.resize(padded);
  }
};

inline void to_float(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void to_float(float* dst, const Half* src, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// Keys t0 .. t0 + n - 1 into kt [D][CHUNK] and their values into vb [CHUNK][D], as float32.
template <class T>
void widen(const Paged<T>& keys, const Paged<T>& values, int64_t t0, int n, int64_t D, float* kt, float* vb) {
  const int64_t B = keys.mask + 1;
  for (int64_t t = t0; t < t0 + n;) {
    const int64_t at = t & keys.mask, len = std::min<int64_t>(B - at, t0 + n - t);
    const T* block = keys.blocks[t >> keys.shift] + at;
    for (int64_t d = 0; d < D; ++d) to_float(kt + d * CHUNK + (t - t0), block + d * B, len);
    to_float(vb + (t - t0) * D, values.row(t), len * D);
    t += len;
  }
}

namespace avx2 {
using Vec = attend_vectors::Vec8;
#include "attend_chunks.h"
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq")
namespace avx512 {
using Vec = attend_vectors::Vec16;
#include "attend_chunks.h"
}  // namespace avx512
#pragma GCC pop_options

// A fact of the CPU, read once: which of the two vector paths runs.
bool has_avx512() {
  static const bool wide = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  }();
  return wide;
}

// Float32 -> the cache's element type.
inline void store(Half& dst, float x) { dst = Half(x); }
inline void store(float& dst, float x) { dst = x; }

// One job: the tokens j0 .. j1 - 1 of span i, for the query heads of KV head hk.
struct Job {
  int64_t i, hk, j0, j1, cost;
};

template <class T>
void append_and_attend(const float* qp, const float* kp, const float* vp, float* op, int64_t layer, float scale,
                       int64_t window, float softcap, const float* sinks, at::TensorList k_pools, at::TensorList v_pools,
                       const int64_t* tables, at::IntArrayRef table_starts, at::IntArrayRef offsets, at::IntArrayRef lengths,
                       at::IntArrayRef sizes, int64_t Hq, int64_t Hkv, int64_t S, int64_t D, int64_t Dv) {
  const int64_t n_spans = offsets.size(), group = Hq / Hkv;
  const int64_t L = k_pools[0].size(1), B = k_pools[0].size(4);
  const int shift = __builtin_ctzll(B);
  // Where (block, layer, head) begins in a pool: blocks are [L, H_kv, D, B] (keys) or [L, H_kv, B, Dv] each.
  std::vector<T*> kbase(n_spans), vbase(n_spans);
  for (int64_t i = 0; i < n_spans; ++i) {
    kbase[i] = k_pools[i].data_ptr<T>() + layer * Hkv * B * D;
    vbase[i] = v_pools[i].data_ptr<T>() + layer * Hkv * B * Dv;
  }
  const auto key_block = [&](int64_t i, int64_t block, int64_t h) { return kbase[i] + (block * L * Hkv + h) * B * D; };
  const auto value_block = [&](int64_t i, int64_t block, int64_t h) { return vbase[i] + (block * L * Hkv + h) * B * Dv; };
  // Append first, so every query below can read its own token's k/v from its block.
  for (int64_t i = 0; i < n_spans; ++i)
    for (int64_t j = 0; j < sizes[i]; ++j) {
      const int64_t slot = lengths[i] + j, token = offsets[i] + j;
      const int64_t block = tables[table_starts[i] + (slot >> shift)], at = slot & (B - 1);
      for (int64_t h = 0; h < Hkv; ++h) {
        T* key = key_block(i, block, h) + at;
        const float* k = kp + (h * S + token) * D;
        for (int64_t d = 0; d < D; ++d) store(key[d * B], k[d]);
        T* value = value_block(i, block, h) + at * Dv;
        const float* v = vp + (h * S + token) * Dv;
        for (int64_t d = 0; d < Dv; ++d) store(value[d], v[d]);
      }
    }
  // The first key a token at position p sees.
  const auto first_key = [&](int64_t p) { return window > 0 ? std::max<int64_t>(0, p - window + 1) : int64_t{0}; };
  // Jobs of up to MAX_ROWS query rows that share a history, costliest (most rows times keys) first, cut into
  // one run of about equal cost for each thread: a prefill's later tokens see more keys than its first. Runs
  // keep neighbours together: the KV heads of a block lie side by side, and a thread that reads them in turn
  // streams them.
  const int64_t per_job = std::max<int64_t>(1, MAX_ROWS / group), threads = at::get_num_threads();
  std::vector<Job> jobs;
  jobs.reserve(n_spans * Hkv);
  for (int64_t i = 0; i < n_spans; ++i)
    for (int64_t j0 = 0; j0 < sizes[i]; j0 += per_job) {
      const int64_t j1 = std::min(sizes[i], j0 + per_job);
      const int64_t keys = lengths[i] + j1 - first_key(lengths[i] + j0);  // what the job's rows read, together
      for (int64_t hk = 0; hk < Hkv; ++hk) jobs.push_back({i, hk, j0, j1, (j1 - j0) * keys});
    }
  std::stable_sort(jobs.begin(), jobs.end(), [](const Job& a, const Job& b) { return a.cost > b.cost; });
  int64_t total = 0;
  for (const Job& job : jobs) total += job.cost;
  std::vector<int64_t> cut(threads + 1, (int64_t)jobs.size());
  cut[0] = 0;
  for (int64_t n = 0, t = 1, sum = 0; n < (int64_t)jobs.size() && t < threads; ++n) {
    sum += jobs[n].cost;
    if (sum * threads >= total * t) cut[t++] = n + 1;
  }
  const bool wide = has_avx512();
  const bool fast = (D == 64 && Dv == 64) || (D == 128 && Dv == 128);
  // A call may be handed more than one run (torch runs the whole range on this thread when it will not
  // start a team, and a team may be smaller than the count asked for): every run handed over is done.
  at::parallel_for(0, threads, 1, [&](int64_t first_run, int64_t end_run) {
    thread_local Scratch scratch;
    std::vector<float> scores;
    std::vector<const float*> qs;
    std::vector<float*> os;
    std::vector<int64_t> begin, visible;
    std::vector<const float*> sink;  // each row's, or none
    std::vector<const T*> kblocks, vblocks;
    for (int64_t at = cut[first_run]; at < cut[end_run]; ++at) {
      const Job& job = jobs[at];
      const int64_t i = job.i, n_blocks = (lengths[i] + job.j1 + B - 1) >> shift;
      kblocks.resize(n_blocks);
      vblocks.resize(n_blocks);
      for (int64_t b = 0; b < n_blocks; ++b) {
        const int64_t block = tables[table_starts[i] + b];
        kblocks[b] = key_block(i, block, job.hk);
        vblocks[b] = value_block(i, block, job.hk);
      }
      const Paged<T> keys{kblocks.data(), shift, B - 1, D}, values{vblocks.data(), shift, B - 1, Dv};
      qs.clear(), os.clear(), begin.clear(), visible.clear(), sink.clear();
      for (int64_t j = job.j0; j < job.j1; ++j)  // row order: token, then head; begin and visible nondecreasing
        for (int64_t g = 0; g < group; ++g) {
          const int64_t h = job.hk * group + g, token = offsets[i] + j;
          qs.push_back(qp + (h * S + token) * D);
          os.push_back(op + (h * S + token) * Dv);
          begin.push_back(first_key(lengths[i] + j));
          visible.push_back(lengths[i] + j + 1);
          sink.push_back(sinks != nullptr ? sinks + h : nullptr);
        }
      const int rows = (int)qs.size();
      if (!fast) {
        for (int r = 0; r < rows; ++r)
          attend_scalar::attend_one_any(qs[r], keys, values, begin[r], visible[r], scale, softcap, sink[r], D, Dv, os[r],
                                        scores);
      } else if (D == 64) {
        (wide ? avx512::attend_rows<64, T> : avx2::attend_rows<64, T>)(qs.data(), os.data(), begin.data(), visible.data(), rows,
                                                                     keys, values, scale, softcap, sink.data(), scratch);
      } else {
        (wide ? avx512::attend_rows<128, T> : avx2::attend_rows<128, T>)(qs.data(), os.data(), begin.data(), visible.data(), rows,
                                                                       keys, values, scale, softcap, sink.data(), scratch);
      }
    }
  });
}

}  // namespace

namespace kvcache_kernels {

at::Tensor attend_spans(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, int64_t layer,
                        double scale, at::TensorList k_pools, at::TensorList v_pools, const at::Tensor& tables,
                        at::IntArrayRef table_starts, at::IntArrayRef offsets, at::IntArrayRef lengths,
                        at::IntArrayRef sizes, int64_t window, double softcap,
                        const std::optional<at::Tensor>& sinks_in) {
  const int64_t n_spans = offsets.size();
  TORCH_CHECK(n_spans > 0 && k_pools.size() == n_spans && v_pools.size() == n_spans && lengths.size() == n_spans &&
                  sizes.size() == n_spans && table_starts.size() == n_spans,
              "one pool pair, table start, offset, length and size per span, at least one span");
  TORCH_CHECK(q_in.dim() == 4 && q_in.size(0) == 1 && k_in.dim() == 4 && k_in.size(0) == 1 && v_in.dim() == 4 &&
                  v_in.size(0) == 1, "q, k, v must be [1, H, S, D]");
  // Batch is 1, so a contiguous [1, H, S, D] is laid out as [H, S, D] (no select: a view per call adds up).
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "attend_spans works in float32");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.dim() == 1 && tables.is_contiguous(), "tables must be int64 [n]");
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "window and softcap must be 0 (none) or positive");
  const int64_t Hq = q.size(1), S = q.size(2), D = q.size(3), Hkv = k.size(1), Dv = v.size(3);
  TORCH_CHECK(!sinks_in || (sinks_in->scalar_type() == at::kFloat && sinks_in->dim() == 1 && sinks_in->size(0) == Hq),
              "sinks must be float32 [H_q]");
  const at::Tensor sinks = sinks_in ? sinks_in->contiguous() : at::Tensor();
  const float* sink_p = sinks.defined() ? sinks.data_ptr<float>() : nullptr;
  const at::ScalarType pool_type = k_pools[0].scalar_type();
  TORCH_CHECK(pool_type == at::kFloat || pool_type == at::kHalf, "pools must be float32 or float16");
  const int64_t L = k_pools[0].size(1), B = k_pools[0].size(4), n_table = tables.size(0);
  TORCH_CHECK(B >= 4 && (B & (B - 1)) == 0, "the block size must be a power of two, at least 4");
  const int64_t* table = tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < n_spans; ++i) {
    const at::Tensor &kt = k_pools[i], &vt = v_pools[i];
    TORCH_CHECK(kt.dim() == 5 && vt.dim() == 5 && kt.scalar_type() == pool_type && vt.scalar_type() == pool_type &&
                    kt.is_contiguous() && vt.is_contiguous() && kt.size(1) == L && kt.size(2) == Hkv && kt.size(3) == D &&
                    kt.size(4) == B && vt.size(0) == kt.size(0) && vt.size(1) == L && vt.size(2) == Hkv &&
                    vt.size(3) == B && vt.size(4) == Dv && layer >= 0 && layer < L,
                "pool ", i, " does not match the step's dtype, heads, dims, block size or layers");
    const int64_t n_blocks = (lengths[i] + sizes[i] + B - 1) / B;
    TORCH_CHECK(offsets[i] >= 0 && sizes[i] > 0 && offsets[i] + sizes[i] <= S && lengths[i] >= 0 &&
                    table_starts[i] >= 0 && table_starts[i] + n_blocks <= n_table,
                "span ", i, " does not fit its block table or the step");
    for (int64_t b = 0; b < n_blocks; ++b)
      TORCH_CHECK(table[table_starts[i] + b] >= 0 && table[table_starts[i] + b] < kt.size(0), "span ", i,
                  " names a block outside its pool");
  }
  at::Tensor out = at::empty({1, Hq, S, Dv}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (pool_type == at::kHalf)
    append_and_attend<Half>(qp, kp, vp, op, layer, (float)scale, window, (float)softcap, sink_p, k_pools, v_pools, table,
                            table_starts, offsets, lengths, sizes, Hq, Hkv, S, D, Dv);
  else
    append_and_attend<float>(qp, kp, vp, op, layer, (float)scale, window, (float)softcap, sink_p, k_pools, v_pools, table,
                             table_starts, offsets, lengths, sizes, Hq, Hkv, S, D, Dv);
  return out;
}

}  // namespace kvcache_kernels

TORCH_LIBRARY(kvcache_native, m) {
  m.def("attend_spans(Tensor q, Tensor k, Tensor v, int layer, float scale, Tensor(a!)[] k_pools, "
        "Tensor(b!)[] v_pools, Tensor tables, int[] table_starts, int[] offsets, int[] lengths, int[] sizes, "
        "int window=0, float softcap=0.0, Tensor? sinks=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvcache_native, CPU, m) { m.impl("attend_spans", &kvcache_kernels::attend_spans); }
