// RMSNorm of float32 rows: y = w * (x / sqrt(mean(x²) + eps)), in one pass of native code instead of the seven
// small torch operations of transformers' forward, each a few microseconds of dispatch for a row of a decode
// step. The sum of squares runs over 16 lanes in a fixed order (lanes.h, no fast-math).
#include <cmath>
#include <cstdint>

#include "lanes.h"

extern "C" void rms_norm(const float* x, int64_t rows, int64_t n, int64_t stride, const float* w, float eps,
                         float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * stride;
    float* out = y + r * n;
    const float inverse = 1.0f / std::sqrt(lanes::dot(row, row, n) / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (row[i] * inverse);
  }
}
