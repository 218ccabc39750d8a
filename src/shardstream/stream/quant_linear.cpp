// y = x @ Wᵀ for a quantized or 16-bit weight W, decoded 16 values at a time inside the product (see
// quant_linear.py and half_linear.py).
//
// A quantized W is N x K, stored flat in bitsandbytes' layout: 4-bit NF4, two codes a byte (the first in the
// high nibble), or 8-bit, one code a byte; one float32 absmax per `blocksize` values; value = table[code] *
// absmax, the same float32 product that dequantization writes; for a bfloat16 or float16 weight (`round`
// 1 or 2) that product rounded to the weight's dtype, to nearest even, as dequantization's cast does, so
// the values multiplied are the dequantized weight's. A bfloat16 or float16 W (half_linear) is read as
// stored, N rows of K values `ws` apart, each value widened to float32 exactly. Every output y[m][n] is one
// sum, always in the same order whatever the number of rows: each lane accumulates x[m][k] * W[n][k] over
// its k with fused multiply-adds, k ascending, then the lanes are added in a fixed tree. So a row gives the
// same bits alone or in any batch.
//
// Work is split over threads by groups of output columns (a decode step's few rows, kFewRows, over
// work_pool.h's threads, more over torch's), and each thread multiplies a panel of its groups by x a block
// of rows at a time, both sized for the L2 cache. For fewer than `buffer_rows` rows (a 16-bit W: any
// number), each tile decodes its weights into registers; from then on, each panel is decoded once into a
// buffer that every row reads. One row of x against a 16-bit W reads W as a few sequential streams instead
// (one_row).
// Built for AVX-512F (16 lanes, tiles of 6 rows x 4 columns, or 8 x 3 for 7-8 rows) or, where the CPU has
// no AVX-512, AVX2 + FMA + F16C (8 lanes, 4 x 3 tiles): quant_linear.py picks the flags. A 4-bit code is
// looked up in registers among its block's 16 values, made once a block (AVX2: a byte shuffle per byte of the
// values), an 8-bit one gathered from its 256-entry table; a bfloat16 value is shifted into a float32's high
// half, a float16 one converted. A quantized W's K and blocksize are multiples of 16; a 16-bit W's K is any:
// the last K % 16 (AVX2: K % 8) values of each row of W and of x are read into a zero-padded chunk, summed last.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "read_ahead.h"
#include "work_pool.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

#ifdef __AVX512F__
constexpr int kColumns = 4;
constexpr int kRows = 6;
constexpr int kLanes = 16;
using Vec = __m512;

// The 4-bit block a row is being read in, and its 16 values (see Weight::enter): one register.
struct Block4 {
  int64_t index = -1;
  __m512 values;
};
template <int Round>
inline void set_values(Block4& block, const __m512 (&values)[1]) { block.values = values[0]; }

// 16 values from 8 bytes of 4-bit codes: the nibbles in order, looked up in the block's values.
template <int Round>
inline Vec decode4(const uint8_t* bytes, const Block4& block) {
  __m128i packed = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes));
  __m128i high = _mm_srli_epi16(packed, 4);              // each byte's high nibble in its low 4 bits
  __m128i pairs = _mm_unpacklo_epi8(high, packed);       // high0 low0 high1 low1 ... (low 4 bits count)
  __m512i index = _mm512_cvtepu8_epi32(pairs);           // permutexvar reads only the low 4 bits
  return _mm512_permutexvar_ps(index, block.values);
}

// 16 entries of the 256-entry table from 16 bytes of 8-bit codes.
inline Vec decode8(const uint8_t* bytes, const float* table) {
  __m512i index = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  return _mm512_i32gather_ps(index, table, 4);
}

// The float32 values rounded to bfloat16 (to nearest even: add 0x7FFF plus the kept part's lowest bit, cut
// the low 16 bits; the decoded values are finite) or to float16 (a round trip through the conversion).
inline Vec round_bf16(Vec v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline Vec round_fp16(Vec v) { return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)); }

// 16 bfloat16 (Format 1) or float16 (Format 2) values as float32, exactly.
template <int Format>
inline Vec widen(const uint16_t* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (Format == 1) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
  else return _mm512_cvtph_ps(half);
}

inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec broadcast(float v) { return _mm512_set1_ps(v); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float sum(Vec v) { return _mm512_reduce_add_ps(v); }
#else
constexpr int kColumns = 3;
constexpr int kRows = 4;
constexpr int kLanes = 8;
using Vec = __m256;

// The 4-bit block a row is being read in, and its 16 values (see Weight::enter) as byte planes: plane j holds
// byte j of every value, so that one byte shuffle looks up a byte of 16 values at once. A bfloat16 value
// (Round 1) is its upper two bytes, the lower two are zero; a float16 one (Round 2) is its two bytes as
// float16; a float32 one, its upper two bytes (planes 0-1) and then its lower two (2-3).
struct Block4 {
  int64_t index = -1;
  __m128i planes[4];
};
template <int Round>
inline void set_values(Block4& block, const __m256 (&values)[2]) {
  if constexpr (Round == 2) {
    const __m128i bytes = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);   // low bytes, high bytes
    const __m128i first = _mm_shuffle_epi8(_mm256_cvtps_ph(values[0], _MM_FROUND_TO_NEAREST_INT), bytes);
    const __m128i second = _mm_shuffle_epi8(_mm256_cvtps_ph(values[1], _MM_FROUND_TO_NEAREST_INT), bytes);
    block.planes[0] = _mm_unpacklo_epi64(first, second);
    block.planes[1] = _mm_unpackhi_epi64(first, second);
  } else {
    // each quarter's 4 values with their bytes gathered (byte 0 of each, then byte 1, ...), then the 4 x 4
    // words transposed into planes
    const __m128i bytes = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const auto quarter = [&](__m128 v) { return _mm_shuffle_epi8(_mm_castps_si128(v), bytes); };
    const __m128i q0 = quarter(_mm256_castps256_ps128(values[0])), q1 = quarter(_mm256_extractf128_ps(values[0], 1));
    const __m128i q2 = quarter(_mm256_castps256_ps128(values[1])), q3 = quarter(_mm256_extractf128_ps(values[1], 1));
    const __m128i t0 = _mm_unpacklo_epi32(q0, q1), t1 = _mm_unpackhi_epi32(q0, q1);
    const __m128i t2 = _mm_unpacklo_epi32(q2, q3), t3 = _mm_unpackhi_epi32(q2, q3);
    block.planes[0] = _mm_unpacklo_epi64(t1, t3);   // byte 2
    block.planes[1] = _mm_unpackhi_epi64(t1, t3);   // byte 3
    if constexpr (Round == 0) {
      block.planes[2] = _mm_unpacklo_epi64(t0, t2);   // byte 0
      block.planes[3] = _mm_unpackhi_epi64(t0, t2);   // byte 1
    }
  }
}

// 8 values from 4 bytes of 4-bit codes: the nibbles in order, each byte of their values looked up in its plane.
template <int Round>
inline Vec decode4(const uint8_t* bytes, const Block4& block) {
  int32_t four;
  std::memcpy(&four, bytes, sizeof four);
  const __m128i packed = _mm_cvtsi32_si128(four);
  const __m128i codes = _mm_and_si128(_mm_unpacklo_epi8(_mm_srli_epi16(packed, 4), packed), _mm_set1_epi8(0x0F));
  const auto plane = [&](int j) { return _mm_shuffle_epi8(block.planes[j], codes); };
  const __m128i upper = _mm_unpacklo_epi8(plane(0), plane(1));   // each value's two bytes from planes 0-1
  if constexpr (Round == 2) return _mm256_cvtph_ps(upper);
  __m128i lower = _mm_setzero_si128();
  if constexpr (Round == 0) lower = _mm_unpacklo_epi8(plane(2), plane(3));
  const __m128i first = _mm_unpacklo_epi16(lower, upper), second = _mm_unpackhi_epi16(lower, upper);
  return _mm256_castsi256_ps(_mm256_set_m128i(second, first));
}

// 8 entries of the 256-entry table from 8 bytes of 8-bit codes.
inline Vec decode8(const uint8_t* bytes, const float* table) {
  __m256i index = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
  return _mm256_i32gather_ps(table, index, 4);
}

inline Vec round_bf16(Vec v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline Vec round_fp16(Vec v) { return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)); }

template <int Format>
inline Vec widen(const uint16_t* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (Format == 1) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
  else return _mm256_cvtph_ps(half);
}

inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec broadcast(float v) { return _mm256_set1_ps(v); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float sum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

// The first `count` (< kLanes) values from p, then zeros: a row's last, partial chunk.
template <class T>
inline const T* padded(const T* p, int64_t count, T (&tail)[kLanes]) {
  std::memset(tail, 0, sizeof tail);
  std::memcpy(tail, p, count * sizeof(T));
  return tail;
}

// A weight's value as dequantization writes it: the float32 product, or that rounded to the weight's dtype.
template <int Round>
inline Vec rounded(Vec v) {
  if constexpr (Round == 1) return round_bf16(v);
  else if constexpr (Round == 2) return round_fp16(v);
  else return v;
}

// What a product reads from no weight (a 16-bit one, a decoded buffer) as it goes along a row.
struct NoState {};

template <int Bits, int Round>
struct Weight {
  static constexpr bool kPartialChunks = false;   // K is whole chunks (quant_linear.packable)
  static constexpr int kBits = Bits;
  using State = std::conditional_t<Bits == 4, Block4, NoState>;
  const uint8_t* codes;
  const float* absmax;
  int64_t K;
  int64_t blocksize;
  int block_shift;   // log2(blocksize) where it is a power of two (bitsandbytes' always are), else -1
  const float* table;   // 16 entries (4-bit) or 256 (8-bit)

  // A chunk's block: a shift, not a 64-bit division, which is slow on some CPUs (AMD's Zen 1 among them) and,
  // once a chunk, bounds the whole product there (docs/BENCHMARKS.md, "int4 on the CPU").
  inline int64_t block(int64_t flat) const { return block_shift >= 0 ? flat >> block_shift : flat / blocksize; }

  // A 4-bit row is read a run of chunks at a time, each run entered (`enter`) before its chunks are read: a
  // block where every row starts on one (K a multiple of blocksize), else one chunk. Entering a block makes its
  // 16 values (each table entry times its absmax, rounded) once for all its chunks: the same products as for
  // each chunk, so the same bits, without a multiplication and a rounding every chunk. An 8-bit row is one run.
  inline int64_t run_end(int64_t k) const {
    if constexpr (Bits == 4) return k + (K % blocksize == 0 ? blocksize : kLanes);
    else return K;
  }
  inline void enter(int64_t n, int64_t k, State& state) const {
    if constexpr (Bits == 4) {
      const int64_t index = block(n * K + k);
      if (index == state.index) return;   // a run of one chunk in the block before's
      state.index = index;
      const Vec scale = broadcast(absmax[index]);
      Vec values[16 / kLanes];
      for (int i = 0; i < 16 / kLanes; ++i) values[i] = rounded<Round>(mul(load(table + i * kLanes), scale));
      set_values<Round>(state, values);
    }
  }

  // The kLanes values from (n, k) on, in the run entered; a chunk lies in one block (blocksize and K are
  // multiples of 16).
  inline Vec chunk(int64_t n, int64_t k, const State& state) const {
    const int64_t flat = n * K + k;
    if constexpr (Bits == 4) return decode4<Round>(codes + flat / 2, state);
    else return rounded<Round>(mul(decode8(codes + flat, table), broadcast(absmax[block(flat)])));
  }
};

// A bfloat16 (Format 1) or float16 (Format 2) weight as stored: row n at data + n * stride.
template <int Format>
struct HalfWeight {
  static constexpr bool kPartialChunks = true;
  static constexpr int kBits = 16;
  using State = NoState;
  const uint16_t* data;
  int64_t stride;
  int64_t K;

  inline int64_t run_end(int64_t) const { return K; }
  inline void enter(int64_t, int64_t, State&) const {}
  inline const uint16_t* at(int64_t n, int64_t k) const { return data + n * stride + k; }
  inline Vec chunk(int64_t n, int64_t k, const State&) const { return widen<Format>(at(n, k)); }
  inline Vec partial(int64_t n, int64_t k) const {
    uint16_t tail[kLanes];
    return widen<Format>(padded(at(n, k), K - k, tail));
  }
};

// Where a tile's weights come from: decoded on the fly, or from a group's decoded buffer (rows `stride`
// apart, each zero-padded to whole chunks). A tile reads each of its columns a run of chunks at a time
// (run_end, enter), keeping a `State` per column (W::State).
template <class W>
struct FromCodes {
  static constexpr bool kPartialChunks = W::kPartialChunks;
  using State = typename W::State;
  const W& w;
  int64_t n0;
  inline int64_t run_end(int64_t k) const { return w.run_end(k); }
  inline void enter(int c, int64_t k, State& state) const { w.enter(n0 + c, k, state); }
  inline Vec operator()(int c, int64_t k, const State& state) const { return w.chunk(n0 + c, k, state); }
  inline Vec partial(int c, int64_t k) const { return w.partial(n0 + c, k); }
};
struct FromBuffer {
  static constexpr bool kPartialChunks = true;
  using State = NoState;
  const float* buffer;
  int64_t stride;
  int64_t K;
  inline int64_t run_end(int64_t) const { return K; }
  inline void enter(int, int64_t, State&) const {}
  inline Vec operator()(int c, int64_t k, const State&) const { return load(buffer + c * stride + k); }
  inline Vec partial(int c, int64_t k) const { return load(buffer + c * stride + k); }
};

// C rows `gap` apart (row n0 + c * gap): each a stream of its own that goes on to the next row, and asks for
// its line read_ahead::kDistance bytes ahead as it enters each line (read_ahead.h).
template <class W>
struct FromRowsApart {
  static constexpr bool kPartialChunks = W::kPartialChunks;
  using State = typename W::State;
  const W& w;
  int64_t n0;
  int64_t gap;
  inline int64_t run_end(int64_t k) const { return w.run_end(k); }
  inline void enter(int c, int64_t k, State& state) const { w.enter(n0 + c * gap, k, state); }
  inline Vec operator()(int c, int64_t k, const State& state) const {
    if (k * W::kBits / 8 % read_ahead::kLine == 0) read_ahead::line_after(w.at(n0 + c * gap, k));
    return w.chunk(n0 + c * gap, k, state);
  }
  inline Vec partial(int c, int64_t k) const { return w.partial(n0 + c * gap, k); }
};

// Not inlined: a tile is a whole loop over K, and inlined into its callers its accumulators can lose registers.
template <int R, int C, class Source>
[[gnu::noinline]] void tile(const float* x, int64_t xs, const Source& source, int64_t K, float* y, int64_t ys) {
  Vec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = zero();
  // One step of k: C chunks of weights, each against R rows' chunks of x.
  const auto step = [&](const Vec (&w)[C], auto x_chunk) {
    for (int r = 0; r < R; ++r) {
      const Vec xv = x_chunk(r);
      for (int c = 0; c < C; ++c) acc[r][c] = fmadd(xv, w[c], acc[r][c]);
    }
  };
  typename Source::State state[C] = {};
  int64_t k = 0;
  while (k + kLanes <= K) {
    const int64_t end = std::min(K, source.run_end(k));
    for (int c = 0; c < C; ++c) source.enter(c, k, state[c]);
    for (; k + kLanes <= end; k += kLanes) {
      Vec w[C];
      for (int c = 0; c < C; ++c) w[c] = source(c, k, state[c]);
      step(w, [&](int r) { return load(x + r * xs + k); });
    }
  }
  if constexpr (Source::kPartialChunks) {
    if (k < K) {
      Vec w[C];
      for (int c = 0; c < C; ++c) w[c] = source.partial(c, k);
      step(w, [&](int r) {
        float tail[kLanes];
        return load(padded(x + r * xs + k, K - k, tail));
      });
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ys + c] = sum(acc[r][c]);
}

// All M rows against C columns, in tiles of R rows (y and source start at the group's first column).
template <int C, int R, class Source>
void rows(const float* x, int64_t M, int64_t xs, const Source& source, int64_t K, float* y, int64_t ys) {
  int64_t m = 0;
  for (; m + R <= M; m += R) tile<R, C>(x + m * xs, xs, source, K, y + m * ys, ys);
  x += m * xs;
  y += m * ys;
  switch (M - m) {   // the last M % R rows (R is at most 8)
    case 1: tile<1, C>(x, xs, source, K, y, ys); break;
    case 2: tile<2, C>(x, xs, source, K, y, ys); break;
    case 3: if constexpr (R > 3) tile<3, C>(x, xs, source, K, y, ys); break;
    case 4: if constexpr (R > 4) tile<4, C>(x, xs, source, K, y, ys); break;
    case 5: if constexpr (R > 5) tile<5, C>(x, xs, source, K, y, ys); break;
    case 6: if constexpr (R > 6) tile<6, C>(x, xs, source, K, y, ys); break;
    case 7: if constexpr (R > 7) tile<7, C>(x, xs, source, K, y, ys); break;
    default: break;
  }
}

// The group of C output columns from column n on, decoded into `buffer`: row c at c * stride, zero-padded.
template <int C, class W>
void decode_group(const W& w, int64_t n, int64_t K, int64_t stride, float* buffer) {
  for (int c = 0; c < C; ++c) {
    float* row = buffer + c * stride;
    typename W::State state{};
    int64_t k = 0;
    while (k + kLanes <= K) {
      const int64_t end = std::min(K, w.run_end(k));
      w.enter(n + c, k, state);
      for (; k + kLanes <= end; k += kLanes) store(row + k, w.chunk(n + c, k, state));
    }
    if constexpr (W::kPartialChunks) {
      if (k < K) store(row + k, w.partial(n + c, k));
    }
  }
}

// Sizes that keep a product's working set in each core's L2 cache: a panel of column groups (the bytes its
// tiles read: the weights as stored, or their float32 values in a buffer), multiplied by x a block of rows
// at a time. The panel is the larger, so that x, read again for each panel, is read fewer times.
constexpr int64_t kPanelBytes = 512 << 10;
constexpr int64_t kRowBlockBytes = 96 << 10;
// Up to this many rows (a decode step's) a product is short, and split over work_pool's threads.
constexpr int64_t kFewRows = 4;

// Every group of C output columns against all M rows, in tiles of R rows, the groups split over threads, a
// panel of them against a block of rows at a time. For fewer than `buffer_rows` rows, each tile decodes its
// weights into registers; from then on, each panel is decoded once into a buffer that all rows read.
template <int C, int R, class W>
void by_groups(const float* x, int64_t M, int64_t K, int64_t xs, const W& w, int64_t N, float* y, int64_t ys,
               int64_t buffer_rows) {
  const int64_t groups = N / C;
  const int64_t stride = std::max<int64_t>(kLanes, (K + kLanes - 1) / kLanes * kLanes);
  const bool buffered = M >= buffer_rows;
  const int64_t block = std::max<int64_t>(1, kRowBlockBytes / (stride * sizeof(float)) / R) * R;
  // One block of rows stays in cache whatever the panel: then a panel of one group, read while in L1.
  const int64_t panel_bits = C * stride * (buffered ? 32 : W::kBits);
  const int64_t panel = M <= block ? 1 : std::max<int64_t>(1, kPanelBytes * 8 / panel_bits);
  const auto span = [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(buffered ? std::min(panel, end - begin) * C * stride : 0);
    for (int64_t first = begin; first < end; first += panel) {
      const int64_t last = std::min(end, first + panel);
      if (buffered)
        for (int64_t g = first; g < last; ++g)
          decode_group<C>(w, g * C, K, stride, buffer.data() + (g - first) * C * stride);
      for (int64_t m = 0; m < M; m += block) {
        const int64_t count = std::min(block, M - m);
        for (int64_t g = first; g < last; ++g) {
          float* out = y + m * ys + g * C;
          if (buffered)
            rows<C, R>(x + m * xs, count, xs, FromBuffer{buffer.data() + (g - first) * C * stride, stride, K}, K, out, ys);
          else
            rows<C, R>(x + m * xs, count, xs, FromCodes<W>{w, g * C}, K, out, ys);
        }
      }
    }
  };
  if (M <= kFewRows) work_pool::parallel_for(0, groups, span);
  else at::parallel_for(0, groups, 1, span);
  for (int64_t n = groups * C; n < N; ++n) rows<1, R>(x, M, xs, FromCodes<W>{w, n}, K, y + n, ys);   // the last N % C
}

// The sequential streams a one-row product reads its weight as (see one_row).
constexpr int kStreams = 4;

// One row of x against a 16-bit weight, a product bound by reading the weight. Each thread cuts its rows into
// kStreams equal spans and multiplies the i-th row of every span together: every span is read from start to
// end, a sequential stream the hardware prefetcher follows across rows, and the spans' sums are independent
// chains of fused multiply-adds, so they overlap. Tiles of adjacent rows would read every row as a short
// stream of its own, which the prefetcher picks up late (benchmarks/kernels.py). Each output is still one
// tile's sum, in the same order as in any batch.
template <class W>
void one_row_span(const float* x, int64_t K, const W& w, int64_t begin, int64_t end, float* y) {
  const int64_t span = (end - begin) / kStreams;
  float out[kStreams];
  for (int64_t i = 0; i < span; ++i) {
    tile<1, kStreams>(x, 0, FromRowsApart<W>{w, begin + i, span}, K, out, 0);
    for (int c = 0; c < kStreams; ++c) y[begin + i + c * span] = out[c];
  }
  for (int64_t n = begin + kStreams * span; n < end; ++n) tile<1, 1>(x, 0, FromCodes<W>{w, n}, K, y + n, 0);
}

template <class W>
void one_row(const float* x, int64_t K, const W& w, int64_t N, float* y) {
  work_pool::parallel_for(0, N, [&](int64_t begin, int64_t end) { one_row_span(x, K, w, begin, end, y); });
}

// `count` one-row products y_i = x_i @ W_iᵀ against 16-bit weights, each N x K with rows ws[i] apart (y's rows
// N floats apart): all their rows split over work_pool.h's threads at once, each share of a W read as one_row
// reads it, so that a token's few small matrices (an MoE block's routed experts) cost one split and wait, not
// one each.
template <int Format>
void half_rows(int64_t count, const float* const* x, int64_t K, const uint16_t* const* w, const int64_t* ws,
               int64_t N, float* y) {
  work_pool::parallel_for(0, count * N, [&](int64_t begin, int64_t end) {
    for (int64_t at = begin; at < end;) {
      const int64_t i = at / N, first = at % N, last = std::min(N, first + end - at);
      one_row_span(x[i], K, HalfWeight<Format>{w[i], ws[i], K}, first, last, y + i * N);
      at += last - first;
    }
  });
}

template <class W>
void linear(const float* x, int64_t M, int64_t K, int64_t xs, const W& w, int64_t N, float* y, int64_t ys,
            int64_t buffer_rows) {
  // 7 or 8 rows decoding in registers (a batch of 8's decode step): one tile of 8 x 3 rather than two of
  // 6 x 4, which decode every weight twice (docs/BENCHMARKS.md, "Quantized stores").
  if constexpr (kLanes == 16) {
    if ((M == 7 || M == 8) && M < buffer_rows) return by_groups<3, 8>(x, M, K, xs, w, N, y, ys, buffer_rows);
  }
  if constexpr (W::kBits == 16) {
    if (M == 1) return one_row(x, K, w, N, y);
  }
  by_groups<kColumns, kRows>(x, M, K, xs, w, N, y, ys, buffer_rows);
}

template <int Bits, int Round>
void quantized(const float* x, int64_t M, int64_t K, int64_t xs, const uint8_t* codes, const float* absmax,
               int64_t N, int64_t blocksize, const float* table, float* y, int64_t ys, int64_t buffer_rows) {
  const bool power_of_two = blocksize > 0 && (blocksize & (blocksize - 1)) == 0;
  const int shift = power_of_two ? __builtin_ctzll(static_cast<unsigned long long>(blocksize)) : -1;
  linear(x, M, K, xs, Weight<Bits, Round>{codes, absmax, K, blocksize, shift, table}, N, y, ys, buffer_rows);
}

template <int Bits>
void rounded(const float* x, int64_t M, int64_t K, int64_t xs, const uint8_t* codes, const float* absmax, int64_t N,
             int64_t blocksize, const float* table, float* y, int64_t ys, int64_t buffer_rows, int64_t round) {
  if (round == 1) quantized<Bits, 1>(x, M, K, xs, codes, absmax, N, blocksize, table, y, ys, buffer_rows);
  else if (round == 2) quantized<Bits, 2>(x, M, K, xs, codes, absmax, N, blocksize, table, y, ys, buffer_rows);
  else quantized<Bits, 0>(x, M, K, xs, codes, absmax, N, blocksize, table, y, ys, buffer_rows);
}

}  // namespace

// x: M rows of K floats, `xs` apart; y: M rows of N floats, `ys` apart; `bits`: 4 or 8; `round`: 0 (a float32
// weight), 1 (bfloat16) or 2 (float16).
extern "C" void quant_linear(const float* x, int64_t M, int64_t K, int64_t xs, const uint8_t* codes,
                             const float* absmax, int64_t N, int64_t blocksize, const float* table, float* y,
                             int64_t ys, int64_t buffer_rows, int64_t bits, int64_t round) {
  if (bits == 4) rounded<4>(x, M, K, xs, codes, absmax, N, blocksize, table, y, ys, buffer_rows, round);
  else rounded<8>(x, M, K, xs, codes, absmax, N, blocksize, table, y, ys, buffer_rows, round);
}

// The same for a bfloat16 (`format` 1) or float16 (2) weight: N rows of K values, `ws` apart. Its values are
// widened in registers at every row count, never through a float32 buffer: read from a panel in L2, half the
// buffer's bytes, they are multiplied as fast or faster (benchmarks/kernels.py).
extern "C" void half_linear(const float* x, int64_t M, int64_t K, int64_t xs, const uint16_t* w, int64_t ws,
                            int64_t N, float* y, int64_t ys, int64_t format) {
  constexpr int64_t never = std::numeric_limits<int64_t>::max();
  if (format == 1) linear(x, M, K, xs, HalfWeight<1>{w, ws, K}, N, y, ys, never);
  else linear(x, M, K, xs, HalfWeight<2>{w, ws, K}, N, y, ys, never);
}

// `count` one-row products against bfloat16 (`format` 1) or float16 (2) weights: see half_rows.
extern "C" void half_linear_rows(int64_t count, const float* const* x, int64_t K, const uint16_t* const* w,
                                 const int64_t* ws, int64_t N, float* y, int64_t format) {
  if (format == 1) half_rows<1>(count, x, K, w, ws, N, y);
  else half_rows<2>(count, x, K, w, ws, N, y);
}
