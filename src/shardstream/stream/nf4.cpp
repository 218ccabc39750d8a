// y = x @ Wᵀ for a 4-bit NF4 weight W, decoded 16 values at a time inside the product (see nf4.py).
//
// W is N x K, stored flat in bitsandbytes' layout: two codes a byte (the first in the high nibble),
// one float32 absmax per `blocksize` values, value = table[code] * absmax, the same float32 product
// that dequantization writes. Every output y[m][n] is one sum, always in the same order whatever the
// number of rows: 16 lanes accumulate x[m][k] * W[n][k] over k with fused multiply-adds, k ascending,
// then `_mm512_reduce_add_ps` adds the lanes. So a row gives the same bits alone or in any batch.
//
// Work is split over torch's threads by groups of 4 output columns. For a few rows, each group decodes
// its weights into registers; from `buffer_rows` rows on, it decodes the group's 4 x K weights once
// into a small buffer, then every row reads them from L1/L2 (6 rows x 4 columns of accumulators).
// Needs AVX-512F; K and blocksize multiples of 16.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <vector>

namespace {

constexpr int kColumns = 4;
constexpr int kRows = 6;

// 16 values from 8 bytes of codes: the nibbles in order, looked up in the 16-entry table, times the scale.
inline __m512 decode16(const uint8_t* bytes, __m512 table, __m512 scale) {
  __m128i packed = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes));
  __m128i high = _mm_srli_epi16(packed, 4);              // each byte's high nibble in its low 4 bits
  __m128i pairs = _mm_unpacklo_epi8(high, packed);       // high0 low0 high1 low1 ... (low 4 bits count)
  __m512i index = _mm512_cvtepu8_epi32(pairs);           // permutexvar reads only the low 4 bits
  return _mm512_mul_ps(_mm512_permutexvar_ps(index, table), scale);
}

struct Weight {
  const uint8_t* codes;
  const float* absmax;
  int64_t K;
  int64_t blocksize;
  __m512 table;

  inline __m512 chunk(int64_t n, int64_t k) const {
    const int64_t flat = n * K + k;
    return decode16(codes + flat / 2, table, _mm512_set1_ps(absmax[flat / blocksize]));
  }
};

// Where a tile's weights come from: decoded on the fly, or from a group's decoded buffer.
struct FromCodes {
  const Weight& w;
  int64_t n0;
  inline __m512 operator()(int c, int64_t k) const { return w.chunk(n0 + c, k); }
};
struct FromBuffer {
  const float* buffer;
  int64_t K;
  inline __m512 operator()(int c, int64_t k) const { return _mm512_loadu_ps(buffer + c * K + k); }
};

template <int R, int C, class Source>
void tile(const float* x, int64_t xs, const Source& source, int64_t K, float* y, int64_t ys) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 w[C];
    for (int c = 0; c < C; ++c) w[c] = source(c, k);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * xs + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(xv, w[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ys + c] = _mm512_reduce_add_ps(acc[r][c]);
}

// All M rows against C columns (y and source start at the group's first column).
template <int C, class Source>
void rows(const float* x, int64_t M, int64_t xs, const Source& source, int64_t K, float* y, int64_t ys) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) tile<kRows, C>(x + m * xs, xs, source, K, y + m * ys, ys);
  x += m * xs;
  y += m * ys;
  switch (M - m) {
    case 1: tile<1, C>(x, xs, source, K, y, ys); break;
    case 2: tile<2, C>(x, xs, source, K, y, ys); break;
    case 3: tile<3, C>(x, xs, source, K, y, ys); break;
    case 4: tile<4, C>(x, xs, source, K, y, ys); break;
    case 5: tile<5, C>(x, xs, source, K, y, ys); break;
    default: break;
  }
}

}  // namespace

// x: M rows of K floats, `xs` apart; y: M rows of N floats, `ys` apart.
extern "C" void nf4_linear(const float* x, int64_t M, int64_t K, int64_t xs, const uint8_t* codes,
                           const float* absmax, int64_t N, int64_t blocksize, const float* table16, float* y,
                           int64_t ys, int64_t buffer_rows) {
  const Weight w{codes, absmax, K, blocksize, _mm512_loadu_ps(table16)};
  const int64_t groups = N / kColumns;
  const int64_t leftover = N % kColumns;
  at::parallel_for(0, groups + leftover, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(M >= buffer_rows ? kColumns * K : 0);
    for (int64_t g = begin; g < end; ++g) {
      if (g >= groups) {  // the last N % 4 columns, one at a time
        const int64_t n = groups * kColumns + (g - groups);
        rows<1>(x, M, xs, FromCodes{w, n}, K, y + n, ys);
      } else if (buffer.empty()) {
        rows<kColumns>(x, M, xs, FromCodes{w, g * kColumns}, K, y + g * kColumns, ys);
      } else {
        for (int c = 0; c < kColumns; ++c)
          for (int64_t k = 0; k < K; k += 16) _mm512_storeu_ps(buffer.data() + c * K + k, w.chunk(g * kColumns + c, k));
        rows<kColumns>(x, M, xs, FromBuffer{buffer.data(), K}, K, y + g * kColumns, ys);
      }
    }
  });
}
