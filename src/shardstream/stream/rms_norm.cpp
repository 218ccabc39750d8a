// RMSNorm of float32 rows: y = w * (x / sqrt(mean(x²) + eps)), in one pass of native code instead of the seven
// small torch operations of transformers' forward, each a few microseconds of dispatch for a row of a decode
// step. The sum of squares runs over 16 lanes added pairwise at the end, in a fixed order (no fast-math).
#include <cmath>
#include <cstdint>

extern "C" void rms_norm(const float* x, int64_t rows, int64_t n, int64_t stride, const float* w, float eps,
                         float* y) {
  constexpr int kLanes = 16;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * stride;
    float* out = y + r * n;
    float lanes[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes)
      for (int l = 0; l < kLanes; ++l) lanes[l] += row[i + l] * row[i + l];
    float eight[8], four[4];
    for (int l = 0; l < 8; ++l) eight[l] = lanes[l] + lanes[l + 8];
    for (int l = 0; l < 4; ++l) four[l] = eight[l] + eight[l + 4];
    float squares = (four[0] + four[2]) + (four[1] + four[3]);
    for (; i < n; ++i) squares += row[i] * row[i];
    const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(n) + eps);
    for (i = 0; i < n; ++i) out[i] = w[i] * (row[i] * inverse);
  }
}
