// Products of float32 rows by weights kept in blocks (pallas_kernels/block_products/formats.py),
// the blocks read and dequantized in registers: the block-products kernel's whole engine
// (block_products.cc's header says how it works and what it costs), shared by that kernel
// (projections: one weight [N, K]) and the grouped products' (grouped_products.cc: routed
// experts, one weight per group of rows), so each block format is decoded in one place.
//
// `run_unit(p, unit)` multiplies every one of p.rows rows of p.x by weight rows
// [32 unit, 32 unit + 32) of p's weight; `unit_runner` chooses its instance for a format.
//
// A source that includes this must be compiled without associative math, as block_products.cc
// says why (`#pragma GCC optimize("no-associative-math")` before its includes): GCC inlines
// a function only into one of the same floating-point options, and regrouped sums would make
// a row's product depend on which path computed it.

#ifndef ETJAX_PALLAS_KERNELS_CPU_BLOCK_ROWS_H_
#define ETJAX_PALLAS_KERNELS_CPU_BLOCK_ROWS_H_

#include <cstdint>
#include <cstring>
#include <vector>

#include "kernel_math.h"
#include "row_blocks.h"

namespace etjax_cpu {

constexpr int64_t kGroupsPerUnit = 8;  // as row_products.cc
constexpr int64_t kNibbleBlock = 32;   // 4-bit values are packed in 32s: 16 bytes


struct Product {
  const float* x;
  const void* quants;
  const void* scales;
  const void* offsets;  // null: none
  float* out;
  int64_t rows, in, outs, block;
};

inline float scalar(const float* p, int64_t i) { return p[i]; }
inline float scalar(const _Float16* p, int64_t i) {
#if defined(__F16C__)
  // The instruction: without AVX512-FP16, GCC converts a scalar _Float16 in a library call.
  uint16_t bits;
  std::memcpy(&bits, p + i, sizeof bits);
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(p[i]);
#endif
}

// n scales as float32 (float16 ones eight at a time with F16C: each exactly, as `scalar`).
inline void to_floats(const float* p, int64_t n, float* out) {
  std::memcpy(out, p, n * sizeof(float));
}
inline void to_floats(const _Float16* p, int64_t n, float* out) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
#endif
  for (; i < n; ++i) out[i] = scalar(p, i);
}

// Values of a row read at once: 4-bit values come in 32s (16 bytes), 8-bit ones a register's
// lanes at a time; as kSteps registers of lanes.
template <int kBits>
constexpr int64_t kStep = kBits == 4 ? kNibbleBlock : kLanes;
template <int kBits>
constexpr int64_t kSteps = kStep<kBits> / kLanes;

#if ETJAX_LANES == 16 || (ETJAX_LANES == 8 && defined(__AVX2__))
// Integers in registers as float32 lanes. GCC widens a vector of bytes one byte at a time
// (a vector_size(16) of int8 converted to int32 lanes became dozens of scalar shifts): the
// instructions instead.
#if ETJAX_LANES == 16
inline Lanes as_lanes(__m512i ints) {
  const __m512 floats = _mm512_cvtepi32_ps(ints);
#else
inline Lanes as_lanes(__m256i ints) {
  const __m256 floats = _mm256_cvtepi32_ps(ints);
#endif
  Lanes lanes;
  std::memcpy(&lanes, &floats, sizeof lanes);
  return lanes;
}

inline Lanes signed_bytes(const int8_t* p) {
#if ETJAX_LANES == 16
  return as_lanes(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  return as_lanes(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#endif
}

// The 32 values of 16 bytes of nibbles: the low nibbles in order, then the high ones.
inline void nibbles(const uint8_t* p, Lanes (&q)[32 / kLanes]) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i low = _mm_and_si128(bytes, mask);
  const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
#if ETJAX_LANES == 16
  q[0] = as_lanes(_mm512_cvtepu8_epi32(low));
  q[1] = as_lanes(_mm512_cvtepu8_epi32(high));
#else
  q[0] = as_lanes(_mm256_cvtepu8_epi32(low));
  q[1] = as_lanes(_mm256_cvtepu8_epi32(_mm_srli_si128(low, 8)));
  q[2] = as_lanes(_mm256_cvtepu8_epi32(high));
  q[3] = as_lanes(_mm256_cvtepu8_epi32(_mm_srli_si128(high, 8)));
#endif
}
#else
inline Lanes signed_bytes(const int8_t* p) {
  Lanes lanes;
  for (int64_t l = 0; l < kLanes; ++l) lanes[l] = p[l];
  return lanes;
}

inline void nibbles(const uint8_t* p, Lanes (&q)[32 / kLanes]) {
  for (int64_t v = 0; v < 32; ++v)
    q[v / kLanes][v % kLanes] = v < 16 ? p[v] & 0x0F : p[v - 16] >> 4;
}
#endif

// The group's scales and offsets in float32, kOutStep x blocks each, converted once per
// group (4 bits without offsets: value = scale * (q - 8), so the offset is -8 * scale,
// exact; 8 bits: no offset).
template <int kBits, bool kOffsets, typename S>
inline void group_scales(const Product& p, int64_t row, float* scales, float* offsets) {
  // The group's rows are consecutive, so their scales are one run of kOutStep x blocks.
  const int64_t blocks = p.in / p.block, count = kOutStep * blocks;
  to_floats(static_cast<const S*>(p.scales) + row * blocks, count, scales);
  if constexpr (kOffsets)
    to_floats(static_cast<const S*>(p.offsets) + row * blocks, count, offsets);
  else
    for (int64_t i = 0; i < count; ++i) offsets[i] = kBits == 4 ? -8.0f * scales[i] : 0.0f;
}

#if ETJAX_LANES == 16
// 4-bit values through a table: the block's 16 possible weights, scale * q + offset for q
// = 0..15, computed once per block (one multiply-add) and looked up by each value's nibble
// (a permute reads only the low 4 bits of its index, so the nibbles need no masking). The
// table's entries are the same multiply-adds the values would get one by one.
constexpr bool kTables = true;
#else
constexpr bool kTables = false;
#endif

// What dequantizes a block of one weight row: its table (kTables, 4 bits) or its scale and
// offset as lanes.
struct BlockLanes {
  Lanes scale, offset;
};

template <int kBits>
inline BlockLanes block_lanes(float scale, float offset) {
  if constexpr (kBits == 4 && kTables) {
    Lanes iota;
    for (int64_t l = 0; l < kLanes; ++l) iota[l] = static_cast<float>(l);
    return {iota * scale + offset, Lanes{}};
  }
  return {Lanes{} + scale, Lanes{} + offset};
}

// Weight row values [i, i + kStep) at `quants` (the row's start), dequantized: one rounding
// (a fused multiply-add), the same in both paths.
template <int kBits>
inline void weight_values(const void* quants, int64_t i, const BlockLanes& d,
                          Lanes (&w)[kSteps<kBits>]) {
  if constexpr (kBits == 8) {
    w[0] = signed_bytes(static_cast<const int8_t*>(quants) + i) * d.scale;
  } else if constexpr (kTables) {
#if ETJAX_LANES == 16
    const __m128i bytes =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(quants) + i / 2));
    __m512 table;
    std::memcpy(&table, &d.scale, sizeof table);
    const __m512 low = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(bytes), table);
    const __m512 high = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_srli_epi16(bytes, 4)), table);
    std::memcpy(&w[0], &low, sizeof low);
    std::memcpy(&w[1], &high, sizeof high);
#endif
  } else {
    nibbles(static_cast<const uint8_t*>(quants) + i / 2, w);
    for (int64_t k = 0; k < kSteps<kBits>; ++k) w[k] = w[k] * d.scale + d.offset;
  }
}

// Holds a row's values in a register for every weight row they multiply: GCC otherwise folds
// the load into each multiply-add, reading the values once per weight row, and the loads then
// bound the loop beside the multiply-adds (Zen 4: one 512-bit load and one 512-bit
// multiply-add a cycle). At 4 and 8 rows: a third less time (docs/PERF.md, "Block products").
inline void in_register(Lanes& v) {
#if defined(__x86_64__) && (defined(__AVX2__) || defined(__AVX512F__))
  asm("" : "+v"(v));
#endif
}

// Bytes of quants per weight row.
template <int kBits>
inline int64_t row_bytes(int64_t in) {
  return kBits == 4 ? in / 2 : in;
}

// R <= kRowBlock rows of x against weight rows [row, row + kOutStep), dequantized as they
// are loaded, a block at a time; the same sums, in the same order, as row_blocks.h's
// rows_by_group on the dequantized weights. scales/offsets: the group's (group_scales).
template <int R, int kBits>
inline void rows_by_blocks(const Product& p, const float* x, int64_t row, const float* scales,
                           const float* offsets, float* out) {
  constexpr int64_t kN = kSteps<kBits>;
  const int64_t blocks = p.in / p.block;
  const uint8_t* quants = static_cast<const uint8_t*>(p.quants) + row * row_bytes<kBits>(p.in);
  Lanes acc[kRowBlock * kOutStep] = {};
  for (int64_t b = 0, i = 0; b < blocks; ++b) {
    BlockLanes d[kOutStep];
    for (int64_t o = 0; o < kOutStep; ++o)
      d[o] = block_lanes<kBits>(scales[o * blocks + b], offsets[o * blocks + b]);
    for (const int64_t end = i + p.block; i < end; i += kStep<kBits>) {
      Lanes wl[kOutStep][kN];
      for (int64_t o = 0; o < kOutStep; ++o) {
        // The next group's row o at the same offset, a line at a time: as row_blocks.h does
        // for 16-bit weights, the hardware prefetcher begins each group's streams anew.
        if (i % (kBits == 4 ? 128 : 64) == 0)
          __builtin_prefetch(quants + (kOutStep + o) * row_bytes<kBits>(p.in) + i * kBits / 8);
        weight_values<kBits>(quants + o * row_bytes<kBits>(p.in), i, d[o], wl[o]);
      }
      for (int64_t k = 0; k < kN; ++k)
        for (int r = 0; r < R; ++r) {
          Lanes xl = load_lanes(x + r * p.in + i + k * kLanes);
          if constexpr (R > 1) in_register(xl);  // one row: as measured before, folded
          for (int64_t o = 0; o < kOutStep; ++o) acc[r * kOutStep + o] += xl * wl[o][k];
        }
    }
  }
  float sums[kLanes];
  store_lanes(sums, sum_each(acc));
  for (int r = 0; r < R; ++r)
    std::memcpy(out + r * p.outs, sums + r * kOutStep, kOutStep * sizeof(float));
}

// A decode step of more rows than kRowBlock, up to kPairRows (AVX-512: 5 to 8): a group's
// weight rows two at a time against all the rows at once, so each weight is dequantized once
// and used from registers by every row, instead of written to L1 and read back per block of
// rows (the dequantize_group path, 2.4x the fused-multiply-adds' floor at 8 rows). 2 x 8
// accumulators, 2 x 2 weight registers, the tables and a row's values fit AVX-512's 32
// registers; AVX2's 16 do not, so there the L1 path stays. Each output's sum is as
// rows_by_blocks's: lane by lane in the order of the inputs, then sum_each.
constexpr int64_t kPairOuts = 2;
constexpr bool kPairs = ETJAX_LANES == 16;
constexpr int64_t kPairRows = kPairs ? kLanes / kPairOuts : kRowBlock;

// R <= kPairRows rows of x against weight rows [row, row + kPairOuts); scales/offsets: the
// pair's (group_scales' rows from the pair's first on).
template <int R, int kBits>
inline void rows_by_pair(const Product& p, int64_t row, const float* scales,
                         const float* offsets, float* out) {
  constexpr int64_t kN = kSteps<kBits>;
  const int64_t blocks = p.in / p.block, stride = row_bytes<kBits>(p.in);
  const uint8_t* quants = static_cast<const uint8_t*>(p.quants) + row * stride;
  Lanes acc[kLanes] = {};
  for (int64_t b = 0, i = 0; b < blocks; ++b) {
    BlockLanes d[kPairOuts];
    for (int64_t o = 0; o < kPairOuts; ++o)
      d[o] = block_lanes<kBits>(scales[o * blocks + b], offsets[o * blocks + b]);
    for (const int64_t end = i + p.block; i < end; i += kStep<kBits>) {
      Lanes wl[kPairOuts][kN];
      for (int64_t o = 0; o < kPairOuts; ++o) {
        if (i % (kBits == 4 ? 128 : 64) == 0)  // as rows_by_blocks: the next group's rows
          __builtin_prefetch(quants + (kOutStep + o) * stride + i * kBits / 8);
        weight_values<kBits>(quants + o * stride, i, d[o], wl[o]);
      }
      for (int64_t k = 0; k < kN; ++k)
        for (int r = 0; r < R; ++r) {
          Lanes xl = load_lanes(p.x + r * p.in + i + k * kLanes);
          in_register(xl);
          for (int64_t o = 0; o < kPairOuts; ++o) acc[r * kPairOuts + o] += xl * wl[o][k];
        }
    }
  }
  float sums[kLanes];
  store_lanes(sums, sum_each(acc));
  for (int r = 0; r < R; ++r)
    std::memcpy(out + r * p.outs, sums + r * kPairOuts, kPairOuts * sizeof(float));
}

// The group at `row` against p.rows = R or fewer rows (more than kRowBlock), a pair of its
// weight rows at a time.
template <int R, int kBits>
inline void group_by_pairs(const Product& p, int64_t row, const float* scales,
                           const float* offsets, float* out) {
  if constexpr (R > kRowBlock) {
    if (p.rows < R) return group_by_pairs<R - 1, kBits>(p, row, scales, offsets, out);
    const int64_t blocks = p.in / p.block;
    for (int64_t o = 0; o < kOutStep; o += kPairOuts)
      rows_by_pair<R, kBits>(p, row + o, scales + o * blocks, offsets + o * blocks, out + o);
  }
}

// Weight rows [row, row + kOutStep) dequantized into `w` (kOutStep x in floats).
template <int kBits>
inline void dequantize_group(const Product& p, int64_t row, const float* scales,
                             const float* offsets, float* w) {
  const int64_t blocks = p.in / p.block;
  for (int64_t o = 0; o < kOutStep; ++o) {
    const uint8_t* quants =
        static_cast<const uint8_t*>(p.quants) + (row + o) * row_bytes<kBits>(p.in);
    for (int64_t b = 0, i = 0; b < blocks; ++b) {
      const BlockLanes d = block_lanes<kBits>(scales[o * blocks + b], offsets[o * blocks + b]);
      for (const int64_t end = i + p.block; i < end; i += kStep<kBits>) {
        Lanes values[kSteps<kBits>];
        weight_values<kBits>(quants, i, d, values);
        for (int64_t k = 0; k < kSteps<kBits>; ++k)
          store_lanes(w + o * p.in + i + k * kLanes, values[k]);
      }
    }
  }
}

// Above this many rows (prompt chunks) a unit's 32 outputs are dequantized once, laid out
// input-major, and multiplied as a matrix product's register tiles are (rows_by_panel): each
// row's sums then take another order than the few-rows path's, so up to here, as in the
// row-products kernel, a row's product does not depend on the rows beside it.
constexpr int64_t kPanelRows = 32;
constexpr int64_t kPanel = kGroupsPerUnit * kOutStep;  // outputs of a unit: 32
constexpr int64_t kPanelLanes = 2;                     // registers of outputs a tile holds
constexpr int64_t kPanelWidth = kPanelLanes * kLanes;  // outputs a tile computes
// Rows of a tile: 2 x 12 accumulators and 2 weight registers of AVX-512's 32 (AVX2's 16: 2 x 6).
constexpr int kTileRows = ETJAX_LANES == 16 ? 12 : 6;

// R rows of x (in floats apart) times kPanelWidth outputs of `panel` ([in][kPanel] floats,
// this tile's at panel + 0): out[r][0..kPanelWidth), each output one float32 sum in the
// order of the inputs, x's values broadcast against the weights' lanes.
template <int R>
inline void rows_by_panel(const float* x, int64_t in, const float* panel, float* out,
                          int64_t outs) {
  Lanes acc[R][kPanelLanes] = {};
  for (int64_t k = 0; k < in; ++k) {
    Lanes w[kPanelLanes];
    for (int64_t j = 0; j < kPanelLanes; ++j) w[j] = load_lanes(panel + k * kPanel + j * kLanes);
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * in + k];
      for (int64_t j = 0; j < kPanelLanes; ++j) acc[r][j] += xv * w[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < kPanelLanes; ++j) store_lanes(out + r * outs + j * kLanes, acc[r][j]);
}

template <int R>
inline void tile_rows(const Product& p, int64_t r, const float* panel, float* out) {
  for (int64_t t = 0; t < kPanel; t += kPanelWidth)
    rows_by_panel<R>(p.x + r * p.in, p.in, panel + t, out + r * p.outs + t, p.outs);
}

// The last R or fewer rows, from r on.
template <int R>
inline void last_tile(const Product& p, int64_t r, const float* panel, float* out) {
  if constexpr (R > 0) {
    if (p.rows - r == R)
      tile_rows<R>(p, r, panel, out);
    else
      last_tile<R - 1>(p, r, panel, out);
  }
}

// Every row against a unit's kPanel outputs from `row` on, dequantized into `rows` ([kPanel][in]
// floats) and laid out input-major in `panel`.
template <int kBits, bool kOffsets, typename S>
inline void panel_unit(const Product& p, int64_t row, float* scales, float* offsets, float* rows,
                float* panel) {
  for (int64_t g = 0; g < kGroupsPerUnit; ++g) {
    group_scales<kBits, kOffsets, S>(p, row + g * kOutStep, scales, offsets);
    dequantize_group<kBits>(p, row + g * kOutStep, scales, offsets, rows + g * kOutStep * p.in);
  }
  for (int64_t k = 0; k < p.in; ++k)
    for (int64_t o = 0; o < kPanel; ++o) panel[k * kPanel + o] = rows[o * p.in + k];
  float* out = p.out + row;
  int64_t r = 0;
  for (; r + kTileRows <= p.rows; r += kTileRows) tile_rows<kTileRows>(p, r, panel, out);
  last_tile<kTileRows - 1>(p, r, panel, out);
}

template <int kBits, bool kOffsets, typename S>
inline void run_unit(const Product& p, int64_t unit) {
  const int64_t groups = p.outs / kOutStep, blocks = p.in / p.block;
  const int64_t first = unit * kGroupsPerUnit, last = std::min(groups, first + kGroupsPerUnit);
  const bool panel = p.rows > kPanelRows && last - first == kGroupsPerUnit;
  thread_local std::vector<float> scratch;
  scratch.resize(2 * kOutStep * blocks +
                 (panel ? 2 * kPanel * p.in : p.rows > kPairRows ? kOutStep * p.in : 0));
  float *scales = scratch.data(), *offsets = scales + kOutStep * blocks;
  float* weights = offsets + kOutStep * blocks;
  if (panel) return panel_unit<kBits, kOffsets, S>(p, first * kOutStep, scales, offsets, weights,
                                                   weights + kPanel * p.in);
  for (int64_t g = first; g < last; ++g) {
    const int64_t row = g * kOutStep;
    float* out = p.out + row;
    group_scales<kBits, kOffsets, S>(p, row, scales, offsets);
    if (p.rows <= kRowBlock) {
      // A decode step of a few rows: the weights are multiplied as they are dequantized.
      if (p.rows == kRowBlock) rows_by_blocks<kRowBlock, kBits>(p, p.x, row, scales, offsets, out);
      if constexpr (kRowBlock > 3)
        if (p.rows == 3) rows_by_blocks<3, kBits>(p, p.x, row, scales, offsets, out);
      if constexpr (kRowBlock > 2)
        if (p.rows == 2) rows_by_blocks<2, kBits>(p, p.x, row, scales, offsets, out);
      if constexpr (kRowBlock > 1)
        if (p.rows == 1) rows_by_blocks<1, kBits>(p, p.x, row, scales, offsets, out);
      continue;
    }
    if (p.rows <= kPairRows) {
      group_by_pairs<kPairRows, kBits>(p, row, scales, offsets, out);
      continue;
    }
    // More rows: the group is dequantized once into L1 and multiplied as float32 weights.
    dequantize_group<kBits>(p, row, scales, offsets, weights);
    all_rows_by_group(p.x, p.rows, weights, p.in, out, p.outs);
  }
}

// run_unit's instance for weights of `bits` (8 or 4), with offsets or not (4 bits only),
// scales in float16 or float32.
using UnitRunner = void (*)(const Product&, int64_t);

template <typename S>
inline UnitRunner unit_runner_for(int bits, bool offsets) {
  if (bits == 8) return run_unit<8, false, S>;
  return offsets ? run_unit<4, true, S> : run_unit<4, false, S>;
}

inline UnitRunner unit_runner(int bits, bool offsets, bool f16_scales) {
  return f16_scales ? unit_runner_for<_Float16>(bits, offsets)
                    : unit_runner_for<float>(bits, offsets);
}

}  // namespace etjax_cpu

#endif  // ETJAX_PALLAS_KERNELS_CPU_BLOCK_ROWS_H_
