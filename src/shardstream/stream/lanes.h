// Sums over 16 lanes in a fixed order, for the kernels that reduce a row (decode_attention.cpp, rms_norm.cpp):
// each loop over the lanes is one vector where the build's ISA flags allow it, and the lanes are added pairwise
// at the end (8 + 8, then 4 + 4, ...: a few vector shuffles, not 16 dependent additions). No fast-math is
// needed, and a row's sum does not depend on where it is computed.
#pragma once

#include <cstdint>

namespace lanes {

constexpr int kLanes = 16;

inline float lane_sum(const float* lanes) {
  float eight[8], four[4];
  for (int l = 0; l < 8; ++l) eight[l] = lanes[l] + lanes[l + 8];
  for (int l = 0; l < 4; ++l) four[l] = eight[l] + eight[l + 4];
  return (four[0] + four[2]) + (four[1] + four[3]);
}

// a · b over n floats.
inline float dot(const float* a, const float* b, int64_t n) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += a[i + l] * b[i + l];
  float sum = lane_sum(lanes);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

}  // namespace lanes
