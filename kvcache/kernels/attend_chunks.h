// The vector attention of attend_spans.cpp, included there twice: with 8-lane AVX2 vectors, and with
// 16-lane AVX-512 ones where the CPU has them (half the instructions for the same multiply-adds). The
// includer defines Vec (its lanes W and its operations), CHUNK, AHEAD, Half and Paged, and wraps this
// in a namespace of its own.

// G query heads of one KV head, one query each, over `visible` keys/values (element type T), head dim
// D. One pass in chunks of CHUNK rows with an online softmax (flash-decoding): a chunk's keys and
// values are read from memory once and used while they are in L1, where a scores pass and then a
// values pass over the whole history would read the values twice. Each key and value vector is loaded
// (and widened, for float16) once for all G heads: widening costs about as much as the multiply-adds
// it feeds.
template <int D, int G, class T>
void attend_group(const float* const* q, const Paged<T>& keys, const Paged<T>& values, int64_t visible, float scale,
                  float* const* out) {
  using R = typename Vec::R;
  constexpr int W = Vec::W, NV = D / W, Q = NV < 4 ? NV : 4;  // Q: value vectors summed per pass
  static_assert(D % W == 0 && CHUNK % W == 0, "rows and chunks are whole vectors");
  alignas(64) float qs[G][D], acc[G][D] = {}, s[G][CHUNK];
  alignas(64) float top[W], shift[W] = {};  // per head: the running max, and old max - new max
  float total[G] = {};
  for (int g = 0; g < G; ++g) {
    top[g] = -INFINITY;
    for (int i = 0; i < NV; ++i) Vec::store(qs[g] + W * i, Vec::mul(Vec::load(q[g] + W * i), Vec::set1(scale)));
  }
  for (int64_t t0 = 0; t0 < visible; t0 += CHUNK) {
    const int n = (int)std::min<int64_t>(CHUNK, visible - t0);
    // Scores 4 keys at a time (B is a multiple of 4, so the 4 rows share a block): G x 4 accumulators,
    // each reduced to its sum by a hadd tree.
    int j = 0;
    for (; j + 4 <= n; j += 4) {
      const T* krows = keys.row(t0 + j);
      // History rows are cold: fetch the keys and values AHEAD rows on while these are used.
      if (t0 + j + AHEAD < visible) {
        const char *kr = reinterpret_cast<const char*>(keys.row(t0 + j + AHEAD)), *vr = reinterpret_cast<const char*>(values.row(t0 + j + AHEAD));
        for (int b = 0; b < 4 * D * (int)sizeof(T); b += 64) {
          _mm_prefetch(kr + b, _MM_HINT_T0);
          _mm_prefetch(vr + b, _MM_HINT_T0);
        }
      }
      R part[G][4];
      for (int g = 0; g < G; ++g)
        for (int r = 0; r < 4; ++r) part[g][r] = Vec::zero();
      for (int i = 0; i < NV; ++i)
        for (int r = 0; r < 4; ++r) {
          const R k = Vec::load(krows + r * D + W * i);
          for (int g = 0; g < G; ++g) part[g][r] = Vec::fma(Vec::load(qs[g] + W * i), k, part[g][r]);
        }
      for (int g = 0; g < G; ++g) _mm_store_ps(s[g] + j, Vec::sum4(part[g]));
    }
    for (; j < n; ++j) {
      const T* krow = keys.row(t0 + j);
      for (int g = 0; g < G; ++g) {
        R a = Vec::mul(Vec::load(qs[g]), Vec::load(krow));
        for (int i = 1; i < NV; ++i) a = Vec::fma(Vec::load(qs[g] + W * i), Vec::load(krow + W * i), a);
        s[g][j] = Vec::hsum(a);
      }
    }
    // The online softmax: rescale what is summed so far by e^(old max - new max), one exp for all heads.
    for (int g = 0; g < G; ++g) {
      std::fill(s[g] + n, s[g] + CHUNK, -INFINITY);
      R m = Vec::load(s[g]);
      for (int u = W; u < CHUNK; u += W) m = Vec::max(m, Vec::load(s[g] + u));
      const float now = std::max(top[g], Vec::hmax(m));
      shift[g] = top[g] - now;  // -inf on the first chunk: exp flushes it to about 0, and acc is 0
      top[g] = now;
    }
    alignas(64) float corr[W];
    Vec::store(corr, Vec::exp(Vec::load(shift)));
    for (int g = 0; g < G; ++g) {
      const R now = Vec::set1(top[g]);
      R sum = Vec::zero();
      for (int u = 0; u < CHUNK; u += W) {
        const R p = Vec::exp(Vec::sub(Vec::load(s[g] + u), now));
        Vec::store(s[g] + u, p);
        sum = Vec::add(sum, p);
      }
      total[g] = total[g] * corr[g] + Vec::hsum(sum);
    }
    // Values Q vectors at a time, so the G x Q accumulators stay in registers.
    for (int part = 0; part < NV / Q; ++part) {
      R a[G][Q];
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < Q; ++i) a[g][i] = Vec::mul(Vec::load(acc[g] + W * (Q * part + i)), Vec::set1(corr[g]));
      for (int u = 0; u < n; ++u) {
        const T* vrow = values.row(t0 + u) + W * Q * part;
        R p[G];
        for (int g = 0; g < G; ++g) p[g] = Vec::set1(s[g][u]);
        for (int i = 0; i < Q; ++i) {
          const R v = Vec::load(vrow + W * i);
          for (int g = 0; g < G; ++g) a[g][i] = Vec::fma(p[g], v, a[g][i]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < Q; ++i) Vec::store(acc[g] + W * (Q * part + i), a[g][i]);
    }
  }
  for (int g = 0; g < G; ++g) {
    const R inv = Vec::set1(1.0f / total[g]);
    for (int i = 0; i < NV; ++i) Vec::store(out[g] + W * i, Vec::mul(Vec::load(acc[g] + W * i), inv));
  }
}

// The n query heads of one KV head, in groups of up to 3 (the registers' limit), for one token.
template <int D, class T>
void attend_heads(const float* const* q, const Paged<T>& keys, const Paged<T>& values, int64_t visible, float scale,
                  float* const* out, int64_t n) {
  int64_t g = 0;
  for (; g + 3 <= n; g += 3) attend_group<D, 3>(q + g, keys, values, visible, scale, out + g);
  if (n - g == 2) attend_group<D, 2>(q + g, keys, values, visible, scale, out + g);
  if (n - g == 1) attend_group<D, 1>(q + g, keys, values, visible, scale, out + g);
}
