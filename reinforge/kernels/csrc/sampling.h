// Keyed sampling of one token per row from fp32 logits, shared by decode.cpp's `sample` op and its
// `decode_step` (the whole decoding step in one call).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace reinforge_kernels {

// splitmix64's finaliser (Steele, Lea and Flood, OOPSLA 2014), as reinforge.rollout.sampling.mix64.
inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// A float's bit pattern: for non-negative floats, ordered as the floats are.
inline uint32_t float_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}

// The top-p threshold of one row's probabilities p [V]: the smallest float bit pattern t with
// sum(p_i : bits(p_i) > t) < top_p, so that the nucleus is every token with bits(p_i) >= t: the tokens
// whose strictly more likely tokens hold less than top_p of the mass (Holtzman et al., arXiv
// 1904.09751; rollout.sampling.filter_logits), ties at the threshold all kept. Non-negative floats
// order as their bits, so t is found digit by digit, most significant first (a radix select): one
// pass per digit builds the mass of each digit value among the tokens that share the digits found
// so far, and the digit is the lowest value whose higher values, with the mass above the prefix,
// hold less than top_p. Three passes over the row where a sort takes V log V.
inline uint32_t nucleus_threshold(const float* p, int64_t V, double top_p, std::vector<double>& mass) {
  constexpr int SHIFTS[3] = {20, 8, 0}, WIDTHS[3] = {11, 12, 8};     // 31 bits: 11 + 12 + 8
  uint32_t prefix = 0;          // the digits found so far, in place
  double above = 0.0;           // the mass of tokens whose bits exceed every value with this prefix
  for (int level = 0; level < 3; ++level) {
    const int shift = SHIFTS[level], values = 1 << WIDTHS[level];
    const uint32_t high = level ? ~0u << (SHIFTS[level - 1]) : 0u;    // the bits fixed already
    mass.assign(values, 0.0);
    for (int64_t i = 0; i < V; ++i) {
      const uint32_t bits = float_bits(p[i]);
      if ((bits & high) == prefix) mass[(bits >> shift) & (values - 1)] += p[i];   // above it: in `above`
    }
    int digit = values - 1;
    double higher = above;      // mass above digit `digit` within the prefix, plus `above`
    while (digit > 0 && higher + mass[digit] < top_p) higher += mass[digit--];
    prefix |= (uint32_t)digit << shift;
    above = higher;
  }
  return prefix;
}

// Rows [b0, b1) of fp32 logits lp [B, V] (row b at lp + b * V), with no top-k / min-p filter, as
// reinforge.rollout.sampling.sample_tokens with keyed_uniforms: temperature > 0 draws from
// softmax(logits / T) by inverting its CDF (accumulated in double, as torch's cumsum) at the
// uniform of draw `counters[b]` of stream `keys[b]`; temperature <= 0 takes the argmax (first of
// ties) with the untempered log-prob. top_p < 1: from the nucleus (`nucleus_threshold`),
// renormalised, with the log-prob under it. Writes tokens tp[b] and log-probs op[b]. Each row's
// numbers depend on that row alone. One copy of it serves both ops (noinline), so that they compute alike.
__attribute__((noinline)) inline void sample_rows(int64_t* tp, float* op, const float* lp, int64_t V, int64_t b0, int64_t b1, double temperature,
                        const int64_t* kp, const int64_t* cp, double top_p) {
  const bool greedy = temperature <= 0;
  const float t = greedy ? 1.f : (float)temperature;
  std::vector<float> scores(V), cdf(V);
  std::vector<double> mass;
  for (int64_t b = b0; b < b1; ++b) {
    const float* row = lp + b * V;
    int64_t best = 0;
    for (int64_t i = 0; i < V; ++i) {
      scores[i] = t == 1.f ? row[i] : row[i] / t;
      if (scores[i] > scores[best]) best = i;
    }
    const float top = scores[best];
    float sum = 0.f;
    for (int64_t i = 0; i < V; ++i) sum += expf(scores[i] - top);
    const float log_total = top + logf(sum);
    if (greedy) {
      tp[b] = best;
      op[b] = scores[best] - log_total;
      continue;
    }
    double acc = 0.0;
    float log_kept = 0.f;     // log of the nucleus's mass: 0 without top-p
    if (top_p < 1.0) {
      for (int64_t i = 0; i < V; ++i) cdf[i] = expf(scores[i] - log_total);      // the probabilities
      const uint32_t threshold = nucleus_threshold(cdf.data(), V, top_p, mass);
      for (int64_t i = 0; i < V; ++i) {
        if (float_bits(cdf[i]) >= threshold) acc += (double)cdf[i];
        cdf[i] = (float)acc;
      }
      log_kept = logf((float)acc);
    } else {
      for (int64_t i = 0; i < V; ++i) {
        acc += (double)expf(scores[i] - log_total);
        cdf[i] = (float)acc;
      }
    }
    const uint64_t z = mix64((uint64_t)kp[b] + (uint64_t)(cp[b] + 1) * 0x9E3779B97F4A7C15ull);
    const float u = (float)(z >> 40) * 0x1p-24f * cdf[V - 1];
    const int64_t token = std::min<int64_t>(std::upper_bound(cdf.begin(), cdf.end(), u) - cdf.begin(), V - 1);
    tp[b] = token;
    op[b] = scores[token] - log_total - log_kept;
  }
}

}  // namespace reinforge_kernels
