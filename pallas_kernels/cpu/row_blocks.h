// The micro-kernel of the row products (row_products.cc) and the routed experts' grouped
// products (grouped_products.cc): a few input rows against a group of 4 weight rows that sits
// in L1, 16 lanes at a time into 16 accumulators.

#ifndef ETJAX_PALLAS_KERNELS_CPU_ROW_BLOCKS_H_
#define ETJAX_PALLAS_KERNELS_CPU_ROW_BLOCKS_H_

#include <cstdint>
#include <cstring>

#include "kernel_math.h"

namespace etjax_cpu {

// Weight rows of a group, and input rows multiplied against it at once: 4 x 4 accumulators
// of 16 lanes (one register sum for all 16 outputs), with 8 loads for 16 multiply-adds.
constexpr int64_t kOutStep = 4;
constexpr int64_t kRowBlock = 4;

// out[r][o] for R <= 4 input rows (`in` floats apart in x, `outs` apart in out) against the
// kOutStep weight rows at w (`in` floats apart). The 16 accumulators are summed together
// (sum_each_of_16), output (r, o) in lane 4r + o whatever R is, so each output is one
// float32 sum over `in` in a fixed order, the same for a row whatever rows are beside it.
template <int R>
inline void rows_by_group(const float* x, const float* w, int64_t in, float* out,
                          int64_t outs) {
  Lanes acc[kRowBlock * kOutStep] = {};
  for (int64_t i = 0; i < in; i += kLanes) {
    Lanes wl[kOutStep];
    for (int64_t o = 0; o < kOutStep; ++o) wl[o] = load_lanes(w + o * in + i);
    for (int r = 0; r < R; ++r) {
      const Lanes xl = load_lanes(x + r * in + i);
      for (int64_t o = 0; o < kOutStep; ++o) acc[r * kOutStep + o] += xl * wl[o];
    }
  }
  float sums[kLanes];
  store_lanes(sums, sum_each_of_16(acc));
  for (int r = 0; r < R; ++r)
    std::memcpy(out + r * outs, sums + r * kOutStep, kOutStep * sizeof(float));
}

// Every one of `rows` input rows at x against the kOutStep weight rows at w: out[r][0..4).
inline void all_rows_by_group(const float* x, int64_t rows, const float* w, int64_t in,
                              float* out, int64_t outs) {
  int64_t r = 0;
  for (; r + kRowBlock <= rows; r += kRowBlock)
    rows_by_group<kRowBlock>(x + r * in, w, in, out + r * outs, outs);
  x += r * in;
  out += r * outs;
  switch (rows - r) {
    case 3: rows_by_group<3>(x, w, in, out, outs); break;
    case 2: rows_by_group<2>(x, w, in, out, outs); break;
    case 1: rows_by_group<1>(x, w, in, out, outs); break;
    default: break;
  }
}

}  // namespace etjax_cpu

#endif  // ETJAX_PALLAS_KERNELS_CPU_ROW_BLOCKS_H_
