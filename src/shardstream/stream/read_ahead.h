// Software prefetch for the weights a decode step streams through once (quant_linear.cpp's one-row product
// of a 16-bit weight, int4_linear.cpp's tiles of codes): each stream asks for the cache line a fixed
// distance ahead of the one it multiplies, with the non-temporal hint, as the line is read once and need not
// push out of the caches what the rest of the step reuses (activations, the KV cache, the interpreter's own
// data). The hardware prefetcher alone starts each of a step's many short streams late. The gain shows in a
// whole model's decode step, not in a lone product that the hardware prefetcher follows well enough
// (docs/BENCHMARKS.md, "Beside llama.cpp on the CPU"). A prefetch never faults, so one past the end of a
// weight is harmless.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace read_ahead {

// How far ahead of the bytes being multiplied a stream asks for its next line.
constexpr int64_t kDistance = 2048;
constexpr int64_t kLine = 64;

// The cache line kDistance bytes past `p` asked for, not to be kept.
inline void line_after(const void* p) {
  _mm_prefetch(static_cast<const char*>(p) + kDistance, _MM_HINT_NTA);
}

}  // namespace read_ahead
