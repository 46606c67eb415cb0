// Per-row attention in plain C++ for attend_spans.cpp: the whole row for head dims without a vector path,
// and the softmax's last step with a learned sink (gpt-oss), which the vector paths share.
//
// A sink is one more logit in a row's softmax, with no value: out = sum_t e^(s_t) v_t / (e^sink + sum_t e^(s_t)).
// A row without one computes exactly what it did before sinks existed.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace attend_scalar {

// What a row's value sums are multiplied by to give its output, after an online softmax whose largest score
// is top and whose sum of e^(s - top) is total: 1 / total, or with a sink, 1 / (total + e^(sink - top)), the
// sums rescaled to the sink where it exceeds every score (so nothing overflows).
inline float output_scale(float top, float total, const float* sink) {
  if (sink == nullptr) return 1.0f / total;
  const float now = std::max(top, *sink), corr = std::exp(top - now);
  return corr / (total * corr + std::exp(*sink - now));
}

// One query row q (D floats) over keys begin .. visible - 1 of a paged history (keys.key(t, d), values.row(t)),
// a score at a time: scaled, capped at +-softcap where softcap > 0, softmaxed with the row's sink if any.
template <class Paged>
void attend_one_any(const float* q, const Paged& keys, const Paged& values, int64_t begin, int64_t visible, float scale,
                    float softcap, const float* sink, int64_t D, int64_t Dv, float* out, std::vector<float>& scores) {
  scores.resize(visible);
  float top = -INFINITY;
  for (int64_t t = begin; t < visible; ++t) {
    float s = 0.0f;
    for (int64_t i = 0; i < D; ++i) s += q[i] * keys.key(t, i);
    s *= scale;
    if (softcap > 0.0f) s = softcap * std::tanh(s / softcap);
    top = std::max(top, scores[t] = s);
  }
  if (sink != nullptr) top = std::max(top, *sink);
  float total = sink != nullptr ? std::exp(*sink - top) : 0.0f;
  for (int64_t t = begin; t < visible; ++t) total += scores[t] = std::exp(scores[t] - top);
  std::fill(out, out + Dv, 0.0f);
  for (int64_t t = begin; t < visible; ++t) {
    const auto* vrow = values.row(t);
    for (int64_t i = 0; i < Dv; ++i) out[i] += scores[t] / total * static_cast<float>(vrow[i]);
  }
}

}  // namespace attend_scalar
