// The micro-kernel of the row products (row_products.cc) and the routed experts' grouped
// products (grouped_products.cc): a few input rows against a group of 4 weight rows that sits
// in L1, a register's lanes at a time into as many accumulators as it has lanes. 16-bit
// weights are widened to float32 in registers as they are loaded.

#ifndef ETJAX_PALLAS_KERNELS_CPU_ROW_BLOCKS_H_
#define ETJAX_PALLAS_KERNELS_CPU_ROW_BLOCKS_H_

#include <cstdint>
#include <cstring>

#include "kernel_math.h"

namespace etjax_cpu {

// Weight rows of a group, and input rows multiplied against it at once: kRowBlock x 4
// accumulators, one per lane (one register sum for all their outputs). With AVX-512, 4 x 4
// of 16 lanes and 8 loads for 16 multiply-adds; with AVX2, 2 x 4 of 8 lanes and 6 for 8.
constexpr int64_t kOutStep = 4;
constexpr int64_t kRowBlock = kLanes / kOutStep;

// kLanes weights as float32 lanes. Widening 16-bit weights here, in registers, rather than a
// group at a time into a float32 scratch (as the kernels did): the scratch's stores and
// reloads cost as much as the halved read saved, and bfloat16 experts ran no faster than
// float32 ones (docs/PERF.md, "Routed experts on a CPU"). Both widenings are exact.
inline Lanes load_weight_lanes(const float* p) { return load_lanes(p); }

inline Lanes load_weight_lanes(const _Float16* p) {
  // GCC 12 converts a vector of _Float16 one value at a time: the instructions instead.
  Lanes lanes;
#if defined(__AVX512F__)
  const __m512 wide = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  std::memcpy(&lanes, &wide, sizeof lanes);
#elif defined(__F16C__) && ETJAX_LANES == 8
  const __m256 wide = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&lanes, &wide, sizeof lanes);
#elif defined(__F16C__) && ETJAX_LANES == 16
  const __m256 low = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 high = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  std::memcpy(&lanes, &low, sizeof low);
  std::memcpy(reinterpret_cast<char*>(&lanes) + sizeof low, &high, sizeof high);
#else
  for (int64_t l = 0; l < kLanes; ++l) lanes[l] = static_cast<float>(p[l]);
#endif
  return lanes;
}

inline Lanes load_weight_lanes(const BFloat16* p) {
  // bfloat16 is float32's upper half: zero-extend each to 32 bits and shift it up.
  typedef uint16_t Halves __attribute__((vector_size(kLanes * sizeof(uint16_t))));
  typedef uint32_t Words __attribute__((vector_size(kLanes * sizeof(uint32_t))));
  Halves h;
  std::memcpy(&h, p, sizeof h);
  const Words words = __builtin_convertvector(h, Words) << 16;
  Lanes lanes;
  std::memcpy(&lanes, &words, sizeof lanes);
  return lanes;
}

// out[r][o] for R <= kRowBlock input rows (`in` floats apart in x, `outs` apart in out)
// against the kOutStep weight rows at w (`in` weights apart; float32, float16 or BFloat16).
// The kLanes accumulators are summed together (sum_each), output (r, o) in lane 4r + o
// whatever R is, so each output is one float32 sum over `in` in a fixed order, the same for
// a row whatever rows are beside it.
template <int R, typename W>
inline void rows_by_group(const float* x, const W* w, int64_t in, float* out, int64_t outs) {
  Lanes acc[kRowBlock * kOutStep] = {};
  for (int64_t i = 0; i < in; i += kLanes) {
    Lanes wl[kOutStep];
    for (int64_t o = 0; o < kOutStep; ++o) {
      // The next group's row o at the same offset: the hardware prefetcher begins each
      // group's four streams anew, and on 16-bit rows (768 weights: an expert's down
      // projection) the group is read before it catches up (docs/PERF.md, "bfloat16
      // experts widened in registers"). float32 weights are left as they were measured.
      if constexpr (sizeof(W) == 2) __builtin_prefetch(w + (kOutStep + o) * in + i);
      wl[o] = load_weight_lanes(w + o * in + i);
    }
    for (int r = 0; r < R; ++r) {
      const Lanes xl = load_lanes(x + r * in + i);
      for (int64_t o = 0; o < kOutStep; ++o) acc[r * kOutStep + o] += xl * wl[o];
    }
  }
  float sums[kLanes];
  store_lanes(sums, sum_each(acc));
  for (int r = 0; r < R; ++r)
    std::memcpy(out + r * outs, sums + r * kOutStep, kOutStep * sizeof(float));
}

// Every one of `rows` input rows at x against the kOutStep weight rows at w: out[r][0..4).
template <typename W>
inline void all_rows_by_group(const float* x, int64_t rows, const W* w, int64_t in, float* out,
                              int64_t outs) {
  int64_t r = 0;
  for (; r + kRowBlock <= rows; r += kRowBlock)
    rows_by_group<kRowBlock>(x + r * in, w, in, out + r * outs, outs);
  x += r * in;
  out += r * outs;
  const int64_t left = rows - r;  // fewer than kRowBlock
  if constexpr (kRowBlock > 3)
    if (left == 3) rows_by_group<3>(x, w, in, out, outs);
  if constexpr (kRowBlock > 2)
    if (left == 2) rows_by_group<2>(x, w, in, out, outs);
  if constexpr (kRowBlock > 1)
    if (left == 1) rows_by_group<1>(x, w, in, out, outs);
}

}  // namespace etjax_cpu

#endif  // ETJAX_PALLAS_KERNELS_CPU_ROW_BLOCKS_H_
