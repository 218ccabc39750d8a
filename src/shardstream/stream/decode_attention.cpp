// Attention of a decode step on the CPU, in float32: one query row a sequence against its cached keys and values.
//
// torch's scaled_dot_product_attention splits such a call over its OpenMP threads, and where those sleep
// between parallel regions (`import shardstream` sets OMP_WAIT_POLICY=PASSIVE) every call of every block
// waits for them to wake, for work of a few microseconds. Here the pairs (sequence, key/value head) are
// shared by work_pool.h's threads, awake between a decode step's products. Each pair reads its keys and
// values once for all the query heads that share them (grouped-query attention), and each query head
// computes `softmax(scale * q·Kᵀ) V` in two passes over its scores: their maximum, then their exponentials
// (Cephes' expf polynomial) and sum, then the weighted sum of the values.
// Built with the ISA flags and -fno-trapping-math (which lets the compiler vectorize comparisons and rounding;
// no fast-math): the sums run over 16 lanes in a fixed order (lanes.h), so a row's output does not depend on
// the threads or on the other rows.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "lanes.h"
#include "work_pool.h"

namespace {

using lanes::dot;
using lanes::kLanes;
using lanes::lane_sum;

float most(const float* x, int64_t n) {
  float lanes[kLanes];
  std::fill_n(lanes, kLanes, -std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] = x[i + l] > lanes[l] ? x[i + l] : lanes[l];
  float largest = lanes[0];
  for (int l = 1; l < kLanes; ++l) largest = lanes[l] > largest ? lanes[l] : largest;
  for (; i < n; ++i) largest = x[i] > largest ? x[i] : largest;
  return largest;
}

float sum(const float* x, int64_t n) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += x[i + l];
  float total = lane_sum(lanes);
  for (; i < n; ++i) total += x[i];
  return total;
}

// x[i] = exp(x[i]) for x[i] <= 0 (scores less their maximum): Cephes' expf, 2^k exp(r) with |r| <= ln2 / 2;
// below -87 (exp under 2^-125) a score counts as exp(-87), which no sum of at least one 1 can tell from 0.
void exp_in_place(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i] < -87.0f ? -87.0f : x[i];
    const float k = std::floor(v * 1.44269504088896341f + 0.5f);
    const float r = v - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    x[i] = p * scale;
  }
}

struct Tensor4 {       // a [batch, heads, rows, D] float32 tensor whose last dimension is contiguous
  const float* data;
  int64_t batch, head, row;
  const float* at(int64_t b, int64_t h, int64_t t) const { return data + b * batch + h * head + t * row; }
};

// The query heads of key/value head g of sequence b: `group` heads from g * group, over T keys. kDim: the head
// size where it is one the compiler unrolls for (each output row then sums in registers), else 0 and `dim`.
template <int64_t kDim>
void attend(const Tensor4& q, const Tensor4& k, const Tensor4& v, int64_t b, int64_t g, int64_t group, int64_t T,
            int64_t dim, float scale, float* out, int64_t heads) {
  const int64_t D = kDim ? kDim : dim;
  thread_local std::vector<float> buffer;   // group rows of T scores
  buffer.resize(static_cast<size_t>(group * T));
  float* scores = buffer.data();
  for (int64_t t = 0; t < T; ++t) {
    const float* key = k.at(b, g, t);
    for (int64_t j = 0; j < group; ++j) scores[j * T + t] = dot(q.at(b, g * group + j, 0), key, D) * scale;
  }
  for (int64_t j = 0; j < group; ++j) {
    float* row = scores + j * T;
    const float largest = most(row, T);
    for (int64_t t = 0; t < T; ++t) row[t] -= largest;
    exp_in_place(row, T);
    float sums[kDim ? kDim : 1];
    float* o = out + (b * heads + g * group + j) * D;
    float* into = kDim ? sums : o;
    std::fill_n(into, D, 0.0f);
    for (int64_t t = 0; t < T; ++t) {
      const float weight = row[t];
      const float* value = v.at(b, g, t);
      for (int64_t d = 0; d < D; ++d) into[d] += weight * value[d];
    }
    const float inverse = 1.0f / sum(row, T);
    for (int64_t d = 0; d < D; ++d) o[d] = into[d] * inverse;
  }
}

}  // namespace

// out[b, h, :] = softmax(scale * q[b, h] · k[b, h / G]ᵀ) v[b, h / G] for G = heads / kv_heads; q is [B, heads, D]
// and k, v [B, kv_heads, T, D] given by their strides in floats (last dimension contiguous), out [B, heads, D]
// contiguous.
extern "C" void decode_attention(const float* q, int64_t qb, int64_t qh, const float* k, int64_t kb, int64_t kh,
                                 int64_t kt, const float* v, int64_t vb, int64_t vh, int64_t vt, int64_t B,
                                 int64_t heads, int64_t kv_heads, int64_t T, int64_t D, float scale, float* out) {
  const Tensor4 query{q, qb, qh, 0}, keys{k, kb, kh, kt}, values{v, vb, vh, vt};
  const int64_t group = heads / kv_heads;
  const auto head_of = D == 64 ? attend<64> : D == 128 ? attend<128> : attend<0>;
  work_pool::parallel_for(0, B * kv_heads, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair)
      head_of(query, keys, values, pair / kv_heads, pair % kv_heads, group, T, D, scale, out, heads);
  });
}
