// The vector attention of attend_spans.cpp, included there twice: with 8-lane AVX2 vectors, and with
// 16-lane AVX-512 ones where the CPU has them. The includer defines Vec (its lanes W and operations),
// CHUNK, WIDEN_ROWS, PREFETCH_CHUNKS, PREFETCH_HINT, Half, Paged, Scratch and widen, and wraps this in a
// namespace of its own.
//
// R query rows that share one history (the query heads of one KV head, for one token or for several
// tokens of a span: row r sees keys begin[r] .. visible[r] - 1, both nondecreasing in r; begin is 0 but
// in a sliding window) in one pass over it, in chunks of CHUNK keys with an online softmax (flash
// attention). Chunks lie at multiples of CHUNK: a row takes part in the chunks its keys overlap, from the
// one holding begin[r], and a chunk no row's keys overlap (a gap between windows) is never read. Scores
// are vectors over the keys (stored transposed, [D] by [B] a block): lane t of a row's score vector is its
// dot product with key t, summed over the head dim, so no horizontal sums are needed, and the rows share
// each key vector loaded. With many rows, a chunk's keys and values are first widened to float32, once for
// all of them.
// Each row's operations, and their order, depend only on its own query, begin and visible length, never
// on which rows share its pass: a token's attention is bitwise the same decoded alone, in a batch, or in
// any chunk of a prefill.

// A chunk's keys and values where the row loops read them: key vector c (lanes = keys c W .. c W + W - 1)
// of head dim d at key[c] + d * stride, value row u at value[u >> shift] + (u & mask) * D. Either the pool's
// own blocks (float16 or float32) or their float32 copies in scratch: widening is exact, so the sums are
// the same bits either way.
template <class T>
struct ChunkView {
  const T* key[CHUNK / Vec::W];
  int64_t stride;
  const T* value[CHUNK / 4];
  int shift, mask;
  const T* row(int u, int64_t D) const { return value[u >> shift] + (u & mask) * D; }
};

// The first two pool blocks of the chunk PREFETCH_CHUNKS on (the whole chunk, with the served block size of
// 16), fetched a line a block each step of the score and value loops: spread over the work, the fetches keep
// the memory busy without crowding the loads in hand. (Straight-line code inside loops that do real work:
// gcc drops a loop that only prefetches.)
struct Ahead {
  const char *key[2], *value[2];  // the second is the first again where the chunk lies in one block
  int64_t key_step, value_step;   // bytes from one step's line to the next
};

inline void fetch(const char* const* blocks, int64_t at) {
  _mm_prefetch(blocks[0] + at, PREFETCH_HINT);
  _mm_prefetch(blocks[1] + at, PREFETCH_HINT);
}

// Scores of M rows (queries qs, D floats each, already scaled) against the chunk's keys. Each lane sums its
// key's products over the head dim in Vec::CHAINS chains, dim d in chain d % CHAINS, then adds the chains:
// with 16 lanes a chunk is 2 vectors, and a row or two alone would wait on each multiply-add's latency; with
// 8 lanes it is 4, and the registers are better spent on a second row.
template <int D, int M, class T>
void score_rows(const float* qs, const ChunkView<T>& view, float* s, const Ahead* ahead) {
  using R = typename Vec::R;
  constexpr int CW = CHUNK / Vec::W, C = Vec::CHAINS;
  static_assert(D % C == 0, "the chains split the head dim evenly");
  R acc[C][M][CW];
  for (int h = 0; h < C; ++h)
    for (int m = 0; m < M; ++m)
      for (int c = 0; c < CW; ++c) acc[h][m][c] = Vec::zero();
  for (int d = 0; d < D; d += C) {
    R k[C][CW];
    for (int h = 0; h < C; ++h)
      for (int c = 0; c < CW; ++c) k[h][c] = Vec::load(view.key[c] + (d + h) * view.stride);
    if (ahead != nullptr) fetch(ahead->key, d / C * ahead->key_step);
    for (int m = 0; m < M; ++m)
      for (int h = 0; h < C; ++h) {
        const R q = Vec::set1(qs[m * D + d + h]);
        for (int c = 0; c < CW; ++c) acc[h][m][c] = Vec::fma(q, k[h][c], acc[h][m][c]);
      }
  }
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < CW; ++c) {
      R total = acc[0][m][c];
      for (int h = 1; h < C; ++h) total = Vec::add(total, acc[h][m][c]);
      Vec::store(s + m * CHUNK + c * Vec::W, total);
    }
}

// acc[m] = acc[m] * corr[m] + sum over the first n keys u of p[m][u] * v[u], for M rows.
template <int D, int M, class T>
void add_values(float* acc, const float* p, const float* corr, const ChunkView<T>& view, int n, const Ahead* ahead) {
  using R = typename Vec::R;
  constexpr int NV = D / Vec::W, Q = NV < 4 ? NV : 4;  // Q: value vectors a pass, so M x Q sums stay in registers
  for (int part = 0; part < NV / Q; ++part) {
    R a[M][Q];
    for (int m = 0; m < M; ++m)
      for (int i = 0; i < Q; ++i) a[m][i] = Vec::mul(Vec::load(acc + m * D + Vec::W * (Q * part + i)), Vec::set1(corr[m]));
    for (int u = 0; u < n; ++u) {
      const T* vrow = view.row(u, D) + Vec::W * Q * part;
      if (ahead != nullptr && part == 0) fetch(ahead->value, u * ahead->value_step);
      R v[Q];
      for (int i = 0; i < Q; ++i) v[i] = Vec::load(vrow + Vec::W * i);
      for (int m = 0; m < M; ++m) {
        const R pu = Vec::set1(p[m * CHUNK + u]);
        for (int i = 0; i < Q; ++i) a[m][i] = Vec::fma(pu, v[i], a[m][i]);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int i = 0; i < Q; ++i) Vec::store(acc + m * D + Vec::W * (Q * part + i), a[m][i]);
  }
}

// The scores of rows first .. rows - 1 against one chunk, SCORE_ROWS rows at a time (their sums in registers).
template <int D, class T>
void score_chunk(const float* qs, float* s, int first, int rows, const ChunkView<T>& view, const Ahead* ahead) {
  constexpr int SCORE_ROWS = std::max(1, std::min(6, (Vec::REGS - 8) / (Vec::CHAINS * (CHUNK / Vec::W))));
  for (int r = first; r < rows; r += SCORE_ROWS) {
    switch (std::min(SCORE_ROWS, rows - r)) {  // keys past the history are masked afterwards
#define KVSERVE_SCORE(m) case m: score_rows<D, m>(qs + r * D, view, s + r * CHUNK, r == first ? ahead : nullptr); break;
      KVSERVE_SCORE(1) KVSERVE_SCORE(2) KVSERVE_SCORE(3) KVSERVE_SCORE(4) KVSERVE_SCORE(5) KVSERVE_SCORE(6)
#undef KVSERVE_SCORE
    }
  }
}

// The chunk's values added to rows first .. rows - 1, up to VALUE_ROWS rows at a time that see as many of its keys.
template <int D, class T>
void value_chunk(float* acc, const float* s, const float* corr, const int64_t* visible, int first, int rows, int64_t t0,
                 const ChunkView<T>& view, const Ahead* ahead) {
  constexpr int VALUE_ROWS = std::min(4, Vec::REGS / 2 / (D / Vec::W < 4 ? D / Vec::W : 4));
  for (int r = first, m; r < rows; r += m) {
    const int64_t seen = std::min<int64_t>(CHUNK, visible[r] - t0);
    for (m = 1; m < VALUE_ROWS && r + m < rows && std::min<int64_t>(CHUNK, visible[r + m] - t0) == seen;) ++m;
    switch (m) {
#define KVSERVE_VALUES(k) case k: add_values<D, k>(acc + r * D, s + r * CHUNK, corr + r, view, (int)seen, r == first ? ahead : nullptr); break;
      KVSERVE_VALUES(1) KVSERVE_VALUES(2) KVSERVE_VALUES(3) KVSERVE_VALUES(4)
#undef KVSERVE_VALUES
    }
  }
}

// Attention-logit soft-capping (Gemma 2) of a row's scores: c tanh(s / c), with tanh(x) = 1 - 2 / (e^2x + 1).
// exp saturates, so a score far past the cap comes out as +-c exactly.
template <int CW>
void soft_cap(float* sr, float cap) {
  using R = typename Vec::R;
  const R two = Vec::set1(2.0f), one = Vec::set1(1.0f), c = Vec::set1(cap), twice_inv = Vec::set1(2.0f / cap);
  for (int i = 0; i < CW; ++i) {
    const R e = Vec::exp(Vec::mul(Vec::load(sr + i * Vec::W), twice_inv));
    Vec::store(sr + i * Vec::W, Vec::mul(c, Vec::sub(one, Vec::div(two, Vec::add(e, one)))));
  }
}

// rows query rows (keys begin[r] .. visible[r] - 1 each, both nondecreasing) over one history; see the top of
// this file. softcap > 0 caps each score (after the scale) at +-softcap; sink[r], where not null, is row r's
// sink logit, which joins its softmax at the end (attend_scalar.h).
template <int D, class T>
void attend_rows(const float* const* q, float* const* out, const int64_t* begin, const int64_t* visible, int rows,
                 const Paged<T>& keys, const Paged<T>& values, float scale, float softcap, const float* const* sink,
                 Scratch& sc) {
  using R = typename Vec::R;
  constexpr int W = Vec::W, CW = CHUNK / W;
  static_assert(D % W == 0 && CHUNK % W == 0, "rows and chunks are whole vectors");
  sc.size(rows, D);
  float *qs = sc.q.data(), *acc = sc.acc.data(), *s = sc.s.data(), *kt = sc.kt.data(), *vb = sc.vb.data();
  float *top = sc.top.data(), *shift = sc.shift.data(), *corr = sc.corr.data(), *total = sc.total.data();
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < D; i += W) {
      Vec::store(qs + r * D + i, Vec::mul(Vec::load(q[r] + i), Vec::set1(scale)));
      Vec::store(acc + r * D + i, Vec::zero());
    }
    top[r] = -INFINITY;
    total[r] = 0.0f;
  }
  // Many rows share each key and value: widen them once. Few read them straight from the blocks, where a
  // block holds whole vectors of keys.
  const int64_t B = keys.mask + 1;
  const bool widened = rows >= WIDEN_ROWS || B < W;
  ChunkView<float> copy;
  ChunkView<T> direct;
  copy.stride = CHUNK, direct.stride = B;
  for (int c = 0; c < CW; ++c) copy.key[c] = kt + c * W;
  copy.value[0] = vb, copy.shift = 30, copy.mask = CHUNK - 1;
  direct.shift = __builtin_ctzll(std::min<int64_t>(B, CHUNK)), direct.mask = (1 << direct.shift) - 1;
  Ahead ahead;
  const int64_t block_bytes = B * D * (int64_t)sizeof(T);
  ahead.key_step = block_bytes / (D / Vec::CHAINS), ahead.value_step = block_bytes / CHUNK;
  const int64_t end = visible[rows - 1];
  // Rows first .. last - 1 see some of the chunk: those before first are done, those from last on have not
  // begun (their window starts past it).
  int first = 0, last = 0;
  for (int64_t t0 = begin[0] / CHUNK * CHUNK; t0 < end; t0 += CHUNK) {
    while (visible[first] <= t0) ++first;
    while (last < rows && begin[last] < t0 + CHUNK) ++last;
    if (last == first) {  // no row sees this chunk: go on at the chunk where the next row's window begins
      t0 = begin[first] / CHUNK * CHUNK - CHUNK;
      continue;
    }
    const int n = (int)std::min<int64_t>(CHUNK, end - t0);
    for (int c = 0; c < CW; ++c) {  // keys past the history's last block are read from its first: masked anyway
      const int64_t t = t0 + c * W < end ? t0 + c * W : 0;
      direct.key[c] = keys.blocks[t >> keys.shift] + (t & keys.mask);
    }
    for (int64_t t = t0; t < t0 + n; t += direct.mask + 1) direct.value[(t - t0) >> direct.shift] = values.row(t);
    const int64_t next = t0 + PREFETCH_CHUNKS * CHUNK, second = std::min(next + B, end - 1) >> keys.shift;
    const Ahead* fetching = next < end ? &ahead : nullptr;
    if (fetching != nullptr) {
      ahead.key[0] = reinterpret_cast<const char*>(keys.blocks[next >> keys.shift]);
      ahead.key[1] = reinterpret_cast<const char*>(keys.blocks[second]);
      ahead.value[0] = reinterpret_cast<const char*>(values.blocks[next >> keys.shift]);
      ahead.value[1] = reinterpret_cast<const char*>(values.blocks[second]);
    }
    if (widened) {
      widen(keys, values, t0, n, D, kt, vb);
      score_chunk<D>(qs, s, first, last, copy, fetching);
    } else {
      score_chunk<D>(qs, s, first, last, direct, fetching);
    }
    // The online softmax: rescale what each row has summed by e^(old max - new max).
    for (int r = first; r < last; ++r) {
      float* sr = s + r * CHUNK;
      if (softcap > 0.0f) soft_cap<CW>(sr, softcap);
      std::fill(sr + std::min<int64_t>(CHUNK, visible[r] - t0), sr + CHUNK, -INFINITY);
      if (begin[r] > t0) std::fill(sr, sr + (begin[r] - t0), -INFINITY);  // keys before the row's window
      R m = Vec::load(sr);
      for (int c = 1; c < CW; ++c) m = Vec::max(m, Vec::load(sr + c * W));
      const float now = std::max(top[r], Vec::hmax(m));
      shift[r] = top[r] - now;  // -inf on a row's first chunk: exp flushes it to about 0, and its sums are 0
      top[r] = now;
    }
    for (int r = first; r < last; r += W) Vec::store(corr + r, Vec::exp(Vec::load(shift + r)));
    for (int r = first; r < last; ++r) {
      float* sr = s + r * CHUNK;
      const R now = Vec::set1(top[r]);
      R sum = Vec::zero();
      for (int c = 0; c < CW; ++c) {
        const R p = Vec::exp(Vec::sub(Vec::load(sr + c * W), now));
        Vec::store(sr + c * W, p);
        sum = Vec::add(sum, p);
      }
      total[r] = total[r] * corr[r] + Vec::hsum(sum);
    }
    if (widened) value_chunk<D>(acc, s, corr, visible, first, last, t0, copy, fetching);
    else value_chunk<D>(acc, s, corr, visible, first, last, t0, direct, fetching);
  }
  for (int r = 0; r < rows; ++r) {
    const R inv = Vec::set1(attend_scalar::output_scale(top[r], total[r], sink[r]));
    for (int i = 0; i < D; i += W) Vec::store(out[r] + i, Vec::mul(Vec::load(acc + r * D + i), inv));
  }
}
