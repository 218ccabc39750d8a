// y = x @ Wᵀ for an int4 weight W (quant_int4.py's layout), in integer dot products (see int4_linear.py).
//
// Each row of x is quantized once per product, per block of 32 columns, to int8: d = max|x| / 127, q =
// round(x / d) (to nearest even), as llama.cpp's Q8_0. W's codes are c = w + 8 in [0, 15], so a block's
// integer sum of w * q is the sum of c * q (unsigned by signed bytes: what the instructions multiply) less
// 8 * the sum of q. Each output lane is one column: the block's integer sum, exact, converted to float32 and
// multiplied by (W's scale * x's scale) in one fused multiply-add into the column's float32 sum, blocks in
// order. Every output is that one sequence of float32 operations whatever the number of rows, the tile or
// the build, so a row gives the same bits alone or in any batch, on AVX-512 as on AVX2.
//
// Builds (int4_linear.py picks the flags): AVX-512 with VNNI (a vector is a group's 16 columns; vpdpbusd
// sums four byte products a lane), AVX2 with AVX-VNNI (8 columns, the 256-bit vpdpbusd) or AVX2 alone (8
// columns, vpmaddubsw then vpmaddwd). Work is split over threads by vectors of columns (a decode step's few
// rows over work_pool.h's, more over torch's), multiplied a tile of C vectors at a time (`product`); each tile
// walks every row, R rows at a time, so the tile's codes are read from memory once and from cache after.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "read_ahead.h"
#include "work_pool.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kBlock = 32;
constexpr int kGroup = 16;

#ifdef __AVX512F__
constexpr int kLanes = 16;
using Int = __m512i;
using Flt = __m512;

inline Int load_codes(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline Int low_nibbles(Int v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
inline Int high_nibbles(Int v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
inline Int broadcast32(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
inline Int set1(int32_t v) { return _mm512_set1_epi32(v); }
inline Int dot(Int acc, Int codes, Int x) { return _mm512_dpbusd_epi32(acc, codes, x); }
// 16 bfloat16 scales as float32: their bits in the high half of each lane.
inline Flt load_scales(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline Flt to_float(Int v) { return _mm512_cvtepi32_ps(v); }
inline Flt fzero() { return _mm512_setzero_ps(); }
inline Flt fset1(float v) { return _mm512_set1_ps(v); }
inline Flt fload(const float* p) { return _mm512_loadu_ps(p); }
inline void fstore(float* p, Flt v) { _mm512_storeu_ps(p, v); }
inline Flt fmul(Flt a, Flt b) { return _mm512_mul_ps(a, b); }
inline Flt fdiv(Flt a, Flt b) { return _mm512_div_ps(a, b); }
inline Flt fmadd(Flt a, Flt b, Flt c) { return _mm512_fmadd_ps(a, b, c); }
inline Flt fabs_(Flt v) { return _mm512_abs_ps(v); }
inline Flt fmax_(Flt a, Flt b) { return _mm512_max_ps(a, b); }
inline Flt fadd(Flt a, Flt b) { return _mm512_add_ps(a, b); }
inline Flt fsub(Flt a, Flt b) { return _mm512_sub_ps(a, b); }
inline float hmax(Flt v) { return _mm512_reduce_max_ps(v); }
inline float hsum(Flt v) { return _mm512_reduce_add_ps(v); }
inline Int round_to_int(Flt v) { return _mm512_cvtps_epi32(v); }   // to nearest even (the default MXCSR)
inline int32_t isum(Int v) { return _mm512_reduce_add_epi32(v); }
inline Int iadd(Int a, Int b) { return _mm512_add_epi32(a, b); }
inline Int izero() { return _mm512_setzero_si512(); }
// Two vectors of 16 int32 (each within int8's range) as 32 bytes.
inline void store_bytes(int8_t* p, Int a, Int b) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(a));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 16), _mm512_cvtsepi32_epi8(b));
}
// Tiles: a decode step's 1-3 rows take 4 vectors (64 columns); more rows, tiles of 4 rows x 2 vectors.
constexpr int kNarrowColumns = 4;
constexpr int kRows = 4;
constexpr int kColumns = 2;
#else
constexpr int kLanes = 8;
using Int = __m256i;
using Flt = __m256;

inline Int load_codes(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline Int low_nibbles(Int v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline Int high_nibbles(Int v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
inline Int broadcast32(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm256_set1_epi32(v); }
inline Int set1(int32_t v) { return _mm256_set1_epi32(v); }
#ifdef __AVXVNNI__
inline Int dot(Int acc, Int codes, Int x) { return _mm256_dpbusd_avx_epi32(acc, codes, x); }
#endif
inline Flt load_scales(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline Flt to_float(Int v) { return _mm256_cvtepi32_ps(v); }
inline Flt fzero() { return _mm256_setzero_ps(); }
inline Flt fset1(float v) { return _mm256_set1_ps(v); }
inline Flt fload(const float* p) { return _mm256_loadu_ps(p); }
inline void fstore(float* p, Flt v) { _mm256_storeu_ps(p, v); }
inline Flt fmul(Flt a, Flt b) { return _mm256_mul_ps(a, b); }
inline Flt fdiv(Flt a, Flt b) { return _mm256_div_ps(a, b); }
inline Flt fmadd(Flt a, Flt b, Flt c) { return _mm256_fmadd_ps(a, b, c); }
inline Flt fabs_(Flt v) { return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))); }
inline Flt fmax_(Flt a, Flt b) { return _mm256_max_ps(a, b); }
inline Flt fadd(Flt a, Flt b) { return _mm256_add_ps(a, b); }
inline Flt fsub(Flt a, Flt b) { return _mm256_sub_ps(a, b); }
inline float hmax(Flt v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline float hsum(Flt v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline Int round_to_int(Flt v) { return _mm256_cvtps_epi32(v); }
inline int32_t isum(Int v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}
inline Int iadd(Int a, Int b) { return _mm256_add_epi32(a, b); }
inline Int izero() { return _mm256_setzero_si256(); }
// Four vectors of 8 int32 (each within int8's range) as 32 bytes: the packs interleave 128-bit lanes,
// the permute puts them back in order.
inline void store_bytes4(int8_t* p, Int a, Int b, Int c, Int d) {
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
// Tiles (16 vector registers): a decode step's single row takes 4 vectors (32 columns); more rows, tiles of
// 2 rows x 2 vectors.
constexpr int kNarrowColumns = 4;
constexpr int kRows = 2;
constexpr int kColumns = 2;
#endif
constexpr int kPerGroup = kGroup / kLanes;   // vectors a group of 16 columns
constexpr int kNarrowRows = kRows - 1;        // up to this many rows take the narrow tile
constexpr int kSplitRows = 16;                // from this many rows on, a tile's codes are split once

// x's rows as the products take them: int8 values, and per block of 32 its scale and -8 * its sum.
struct Activations {
  std::vector<int8_t> q;        // M x P
  std::vector<float> scale;     // M x B
  std::vector<int32_t> offset;  // M x B
  int64_t P, B;
};

// One block of 32 floats into `q`; returns its scale (NaN where the block holds NaN or infinity, so the
// row's products are NaN as float products would be) and stores -8 * the sum of its q in `offset`.
inline float quantize_block(const float* x, int8_t* q, int32_t* offset) {
  constexpr int kVectors = kBlock / kLanes;
  Flt v[kVectors];
  Flt peak = fzero(), nonfinite = fzero();
  for (int i = 0; i < kVectors; ++i) {
    v[i] = fload(x + i * kLanes);
    peak = fmax_(peak, fabs_(v[i]));
    nonfinite = fadd(nonfinite, fsub(v[i], v[i]));   // NaN where any value is NaN or infinite
  }
  const float amax = hmax(peak);
  if (amax == 0.0f || std::isnan(hsum(nonfinite))) {
    std::memset(q, 0, kBlock);
    *offset = 0;
    return amax == 0.0f ? 0.0f : NAN;
  }
  const float d = amax / 127.0f;
  const Flt dv = fset1(d);
  Int iv[kVectors];
  Int sum = izero();
  for (int i = 0; i < kVectors; ++i) {
    iv[i] = round_to_int(fdiv(v[i], dv));
    sum = iadd(sum, iv[i]);
  }
#ifdef __AVX512F__
  store_bytes(q, iv[0], iv[1]);
#else
  store_bytes4(q, iv[0], iv[1], iv[2], iv[3]);
#endif
  *offset = -8 * isum(sum);
  return d;
}

Activations quantize_rows(const float* x, int64_t M, int64_t K, int64_t xs) {
  Activations a;
  a.B = (K + kBlock - 1) / kBlock;
  a.P = a.B * kBlock;
  a.q.resize(M * a.P);
  a.scale.resize(M * a.B);
  a.offset.resize(M * a.B);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    float padded[kBlock];
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < a.B; ++b) {
        const float* block = x + m * xs + b * kBlock;
        const int64_t have = K - b * kBlock;
        if (have < kBlock) {   // the last block of a row whose length is not a multiple of 32: zero-padded
          std::memset(padded, 0, sizeof padded);
          std::memcpy(padded, block, have * sizeof(float));
          block = padded;
        }
        a.scale[m * a.B + b] = quantize_block(block, a.q.data() + m * a.P + b * kBlock, a.offset.data() + m * a.B + b);
      }
    }
  });
  return a;
}

// The weight: codes and bfloat16 scales of its full groups of 16 columns, in quant_int4.py's layout.
struct Weights {
  const uint8_t* codes;
  const uint16_t* scales;
  int64_t P, B;
  // Vector j's codes for block b start at codes(j) + b * 256 (4 chunks of 64 bytes, a 16-column group's);
  // its 16 or 8 scales for block b at scales_of(j) + b * 16.
  const uint8_t* codes_of(int64_t j) const { return codes + j / kPerGroup * kGroup * P / 2 + j % kPerGroup * kLanes * 4; }
  const uint16_t* scales_of(int64_t j) const { return scales + j / kPerGroup * kGroup * B + j % kPerGroup * kLanes; }
};

// Where a tile's codes come from: the stored bytes, split into low and high nibbles as they are read (each vector's
// a stream that asks for its line read_ahead::kDistance bytes ahead: read_ahead.h); or, for many rows, a buffer
// that holds them split once for all rows (kSplitRows).
template <int C>
struct Packed {
  const uint8_t* codes[C];
  inline void get(int c, int64_t b, int chunk, Int& low, Int& high) const {
    const uint8_t* line = codes[c] + b * 256 + chunk * 64;
    read_ahead::line_after(line);
    const Int v = load_codes(line);
    low = low_nibbles(v);
    high = high_nibbles(v);
  }
};
struct Split {
  const uint8_t* bytes;   // per vector, block and chunk: its low nibbles as bytes, then its high ones
  int64_t B;
  inline void get(int c, int64_t b, int chunk, Int& low, Int& high) const {
    const uint8_t* at = bytes + ((c * B + b) * 4 + chunk) * 2 * sizeof(Int);
    low = load_codes(at);
    high = load_codes(at + sizeof(Int));
  }
};

// One block's integer sums for R rows by C vectors of columns: sum over the block of code * q, less 8 * sum q.
template <int R, int C, class Source>
inline void block_sums(const Activations& a, int64_t m0, int64_t b, const Source& codes, Int (&sums)[R][C]) {
  const int8_t* x[R];
  for (int r = 0; r < R; ++r) x[r] = a.q.data() + (m0 + r) * a.P + b * kBlock;
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sums[r][c] = set1(a.offset[(m0 + r) * a.B + b]);
  for (int chunk = 0; chunk < 4; ++chunk) {
    for (int c = 0; c < C; ++c) {
      Int low, high;
      codes.get(c, b, chunk, low, high);
      for (int r = 0; r < R; ++r) {
        sums[r][c] = dot(sums[r][c], low, broadcast32(x[r] + chunk * 8));
        sums[r][c] = dot(sums[r][c], high, broadcast32(x[r] + chunk * 8 + 4));
      }
    }
  }
#else
  // vpmaddubsw sums byte products in pairs into int16: at most 2 * 15 * 128 each, 8 of them fit in int16.
  Int pairs[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) pairs[r][c] = izero();
  for (int chunk = 0; chunk < 4; ++chunk) {
    for (int c = 0; c < C; ++c) {
      Int low, high;
      codes.get(c, b, chunk, low, high);
      for (int r = 0; r < R; ++r) {
        pairs[r][c] = _mm256_add_epi16(pairs[r][c], _mm256_maddubs_epi16(low, broadcast32(x[r] + chunk * 8)));
        pairs[r][c] = _mm256_add_epi16(pairs[r][c], _mm256_maddubs_epi16(high, broadcast32(x[r] + chunk * 8 + 4)));
      }
    }
  }
  const Int ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      sums[r][c] = _mm256_add_epi32(_mm256_madd_epi16(pairs[r][c], ones), set1(a.offset[(m0 + r) * a.B + b]));
#endif
}

// Rows m0..m0+R-1 against the C vectors of columns whose codes and scales are `codes` and `scales`, their outputs
// `gap` vectors apart in y.
template <int R, int C, class Source>
void tile(const Activations& a, int64_t m0, const Source& codes, const uint16_t* const* scales, float* y, int64_t ys,
          int64_t gap) {
  Flt acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = fzero();
  for (int64_t b = 0; b < a.B; ++b) {
    Int sums[R][C];
    block_sums<R, C, Source>(a, m0, b, codes, sums);
    Flt w[C];
    for (int c = 0; c < C; ++c) w[c] = load_scales(scales[c] + b * kGroup);
    for (int r = 0; r < R; ++r) {
      const Flt d = fset1(a.scale[(m0 + r) * a.B + b]);
      for (int c = 0; c < C; ++c) acc[r][c] = fmadd(to_float(sums[r][c]), fmul(w[c], d), acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) fstore(y + (m0 + r) * ys + c * gap * kLanes, acc[r][c]);
}

// All M rows against C vectors of columns, in tiles of R rows, then the last M % R rows.
template <int R, int C, class Source>
void all_rows(const Activations& a, int64_t M, const Source& codes, const uint16_t* const* scales, float* y,
              int64_t ys, int64_t gap) {
  int64_t m = 0;
  for (; m + R <= M; m += R) tile<R, C>(a, m, codes, scales, y, ys, gap);
  switch (M - m) {
    case 1: tile<1, C>(a, m, codes, scales, y, ys, gap); break;
    case 2: if constexpr (R > 2) tile<2, C>(a, m, codes, scales, y, ys, gap); break;
    case 3: if constexpr (R > 3) tile<3, C>(a, m, codes, scales, y, ys, gap); break;
    default: break;
  }
}

// All M rows against C vectors of columns, vectors j, j + gap, j + 2 * gap, ...; from kSplitRows rows on, their
// codes split into `split` first (a buffer of the thread's, reused).
template <int R, int C>
void columns(const Activations& a, int64_t M, const Weights& w, int64_t j, int64_t gap, float* y, int64_t ys,
             std::vector<Int>& split) {
  Packed<C> packed;
  const uint16_t* scales[C];
  for (int c = 0; c < C; ++c) {
    packed.codes[c] = w.codes_of(j + c * gap);
    scales[c] = w.scales_of(j + c * gap);
  }
  if (M < kSplitRows) return all_rows<R, C>(a, M, packed, scales, y + j * kLanes, ys, gap);
  split.resize(C * a.B * 8);
  for (int c = 0; c < C; ++c)
    for (int64_t b = 0; b < a.B; ++b)
      for (int chunk = 0; chunk < 4; ++chunk) packed.get(c, b, chunk, split[((c * a.B + b) * 4 + chunk) * 2],
                                                      split[((c * a.B + b) * 4 + chunk) * 2 + 1]);
  all_rows<R, C>(a, M, Split{reinterpret_cast<const uint8_t*>(split.data()), a.B}, scales, y + j * kLanes, ys, gap);
}

// Vectors [begin, end) of one weight, C a tile: for a decode step (`streams`), vector i of each of the range's C
// equal parts side by side, so that each part is read from start to end as one stream, long enough for the
// prefetchers (as quant_linear.cpp's one_row reads a 16-bit weight); else C adjacent vectors.
template <int R, int C>
void share(const Activations& a, int64_t M, const Weights& w, int64_t begin, int64_t end, bool streams, float* y,
           int64_t ys, std::vector<Int>& split) {
  const int64_t tiles = std::max<int64_t>(0, end - begin) / C;
  for (int64_t i = 0; i < tiles; ++i) {
    if (streams) columns<R, C>(a, M, w, begin + i, tiles, y, ys, split);
    else columns<R, C>(a, M, w, begin + i * C, 1, y, ys, split);
  }
  for (int64_t v = begin + tiles * C; v < end; ++v) columns<R, 1>(a, M, w, v, 1, y, ys, split);
}

// Every full group's vectors (`share`s of them), and the last N % 16 columns from a copy widened to a group
// (`rest`), over work_pool.h's threads for the narrow tile's few rows (a decode step's), else torch's.
template <int R, int C>
void product(const Activations& a, int64_t M, const Weights& w, int64_t N, const Weights& rest, float* y, int64_t ys) {
  const int64_t vectors = N / kGroup * kPerGroup, tail = N % kGroup;
  const bool streams = M <= kNarrowRows;
  const auto shares = [&](int64_t begin, int64_t end) {   // vectors [begin, end); past them, the last columns
    std::vector<Int> split;
    share<R, C>(a, M, w, begin, std::min(end, vectors), streams, y, ys, split);
    if (end > vectors) {
      std::vector<float> out(M * kGroup);
      for (int64_t j = 0; j < kPerGroup; ++j) columns<R, 1>(a, M, rest, j, 1, out.data(), kGroup, split);
      for (int64_t m = 0; m < M; ++m) std::memcpy(y + m * ys + N / kGroup * kGroup, out.data() + m * kGroup, tail * sizeof(float));
    }
  };
  const int64_t items = vectors + (tail ? 1 : 0);
  if (streams) work_pool::parallel_for(0, items, shares);
  else at::parallel_for(0, items, C, shares);
}

}  // namespace

// x: M rows of K floats, `xs` apart; codes and scales (bfloat16 bits): an N x K int4 weight; y: M rows of N
// floats, `ys` apart.
extern "C" void int4_linear(const float* x, int64_t M, int64_t K, int64_t xs, const uint8_t* codes,
                            const uint16_t* scales, int64_t N, float* y, int64_t ys) {
  const Activations a = quantize_rows(x, M, K, xs);
  const Weights w{codes, scales, a.P, a.B};
  // The last N % 16 columns are stored 4 bytes a column a chunk, not 16: copied into a zero-padded group.
  const int64_t tail = N % kGroup, full = N / kGroup;
  std::vector<uint8_t> rest_codes(tail ? kGroup * a.P / 2 : 0);
  std::vector<uint16_t> rest_scales(tail ? kGroup * a.B : 0);
  for (int64_t b = 0; b < a.B && tail; ++b) {
    for (int chunk = 0; chunk < 4; ++chunk)
      std::memcpy(rest_codes.data() + b * 256 + chunk * 64,
                  codes + full * kGroup * a.P / 2 + b * 16 * tail + chunk * 4 * tail, 4 * tail);
    std::memcpy(rest_scales.data() + b * kGroup, scales + full * kGroup * a.B + b * tail, tail * sizeof(uint16_t));
  }
  const Weights rest{rest_codes.data(), rest_scales.data(), a.P, a.B};
  if (M <= kNarrowRows) product<kNarrowRows, kNarrowColumns>(a, M, w, N, rest, y, ys);
  else product<kRows, kColumns>(a, M, w, N, rest, y, ys);
}

// `count` one-row products, y_i = x_i @ W_iᵀ (the rows of y, N floats apart), every W_i N x K with N a multiple
// of 16: their vectors of columns split over work_pool.h's threads at once (each part read as `share` reads a
// decode step's), so that a token's few small matrices (an MoE block's routed experts) cost one split and wait,
// not one each. Each distinct x_i (a pointer repeated in a row
// counts once) is quantized once. Every output is the same sum as int4_linear's.
extern "C" void int4_linear_rows(int64_t count, const float* const* x, int64_t K, const uint8_t* const* codes,
                                 const uint16_t* const* scales, int64_t N, float* y) {
  std::vector<Activations> rows;
  std::vector<int64_t> row_of(count);
  for (int64_t i = 0; i < count; ++i) {
    if (i == 0 || x[i] != x[i - 1]) rows.push_back(quantize_rows(x[i], 1, K, K));
    row_of[i] = static_cast<int64_t>(rows.size()) - 1;
  }
  const int64_t vectors = N / kGroup * kPerGroup;
  work_pool::parallel_for(0, count * vectors, [&](int64_t begin, int64_t end) {
    std::vector<Int> split;
    for (int64_t at = begin; at < end;) {   // each product's part of the share as product() reads a share
      const int64_t i = at / vectors, first = at % vectors, last = std::min(vectors, first + end - at);
      const Activations& a = rows[row_of[i]];
      share<kNarrowRows, kNarrowColumns>(a, 1, Weights{codes[i], scales[i], a.P, a.B}, first, last, true, y + i * N,
                                         N, split);
      at += last - first;
    }
  });
}
