#pragma once
// The fp64 oracle of the attention tests (DESIGN.md section 6): one query
// head's attention over a list of token positions in fp64, and the naive
// fp32 one with its output rounded to the KV type, the low-precision
// baseline of the FlashAttention tolerance rule
// max|out - ref64| <= 2 * max|naive - ref64| + atol.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "hisparse/core/dtype.hpp"

namespace hisparse::test {

/// q: head_dim elements; keys/values: [tokens][kv_heads][head_dim] of one
/// sequence, attended through KV head h at `pos`. Returns the natural LSE of
/// the scaled scores. With `round_weights`, the naive attention is
/// FlashAttention's low-precision reference (PyTorch in T): the scores and
/// the softmax's output rounded to T before P V.
template <class T>
double attend_fp64(const T* q, const T* keys, const T* values, int kv_heads, int h, int head_dim,
                   const std::vector<std::int64_t>& pos, std::vector<double>& ref, std::vector<double>& naive,
                   bool round_weights = false) {
  const int D = head_dim;
  std::vector<double> s(pos.size());
  std::vector<float> sf(pos.size());
  for (std::size_t j = 0; j < pos.size(); ++j) {
    double acc = 0;
    float accf = 0;
    const std::size_t at = (static_cast<std::size_t>(pos[j]) * kv_heads + h) * D;
    for (int d = 0; d < D; ++d) {
      acc += to_double(q[d]) * to_double(keys[at + d]);
      accf += to_float(q[d]) * to_float(keys[at + d]);
    }
    s[j] = acc / std::sqrt(static_cast<double>(D));
    sf[j] = accf / std::sqrt(static_cast<float>(D));
    if (round_weights) sf[j] = to_float(from_float<T>(to_float(from_float<T>(accf)) / std::sqrt(static_cast<float>(D))));
  }
  const double m = *std::max_element(s.begin(), s.end());
  const float mf = *std::max_element(sf.begin(), sf.end());
  double sum = 0;
  float sumf = 0;
  for (std::size_t j = 0; j < pos.size(); ++j) sumf += std::exp(sf[j] - mf);
  ref.assign(D, 0.0);
  std::vector<float> of(D, 0.0f);
  for (std::size_t j = 0; j < pos.size(); ++j) {
    const double w = std::exp(s[j] - m);
    // The fp32 naive divides by the sum at the end; PyTorch's rounds each
    // normalized weight.
    const float wf = std::exp(sf[j] - mf);
    const float wpv = round_weights ? to_float(from_float<T>(wf / sumf)) : wf;
    sum += w;
    const std::size_t at = (static_cast<std::size_t>(pos[j]) * kv_heads + h) * D;
    for (int d = 0; d < D; ++d) {
      ref[d] += w * to_double(values[at + d]);
      of[d] += wpv * to_float(values[at + d]);
    }
  }
  naive.assign(D, 0.0);
  for (int d = 0; d < D; ++d) {
    ref[d] /= sum;
    naive[d] = to_double(from_float<T>(round_weights ? of[d] : of[d] / sumf));
  }
  return m + std::log(sum);
}

}  // namespace hisparse::test
