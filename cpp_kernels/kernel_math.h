// What the CPU attention kernels share: float conversion of page tiles, the dot products and
// weighted sums in lanes of a vector register, an exponential the compiler vectorises, and
// the loop that spreads work units over XLA's intra-op threads.

#ifndef ETJAX_PALLAS_KERNELS_CPU_KERNEL_MATH_H_
#define ETJAX_PALLAS_KERNELS_CPU_KERNEL_MATH_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace etjax_cpu {

// Masked scores and empty log-sum-exps: large and finite, as in the XLA kernels, so a block
// with nothing visible contributes exp(-huge) = 0 and never NaN.
constexpr float kMasked = -1e30f;
// exp(x) for x <= 0 (scores minus their running maximum), written so the compiler vectorises
// it: Cody-Waite range reduction and a degree-6 polynomial, within 2 ulp of expf.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// A page's [ps, hd] tile of one KV head as float32: the pool itself for float32 pools, else
// converted into `scratch`.
template <typename T>
const float* as_float(const T* src, int64_t count, float* scratch);

template <>
inline const float* as_float<float>(const float* src, int64_t, float*) {
  return src;
}

template <>
inline const float* as_float<_Float16>(const _Float16* src, int64_t count, float* scratch) {
  int64_t i = 0;
#if defined(__AVX512F__)
  // GCC does not vectorise the scalar conversion below; these are one instruction per 16.
  for (; i + 16 <= count; i += 16)
    _mm512_storeu_ps(scratch + i, _mm512_cvtph_ps(_mm256_loadu_si256(
                                      reinterpret_cast<const __m256i*>(src + i))));
#elif defined(__F16C__)
  for (; i + 8 <= count; i += 8)
    _mm256_storeu_ps(scratch + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < count; ++i) scratch[i] = static_cast<float>(src[i]);
  return scratch;
}

struct BFloat16 {
  uint16_t bits;
};

template <>
inline const float* as_float<BFloat16>(const BFloat16* src, int64_t count, float* scratch) {
  auto* out = reinterpret_cast<uint32_t*>(scratch);
  for (int64_t i = 0; i < count; ++i) out[i] = static_cast<uint32_t>(src[i].bits) << 16;
  return scratch;
}

// One vector register of floats: 16 with AVX-512, 8 with AVX2 (4 elsewhere). The width must
// be the register's: GCC keeps a wider vector (a 64-byte one on an AVX2 machine) on the stack
// and moves it through memory around every operation, which made these kernels run at 2
// GFLOP/s on a Zen 3 EPYC, several times slower than XLA's own loops (docs/PERF.md, "CPU
// kernels on AVX2 machines").
#if defined(__AVX512F__)
#define ETJAX_LANES 16
#elif defined(__AVX__)
#define ETJAX_LANES 8
#else
#define ETJAX_LANES 4
#endif
constexpr int64_t kLanes = ETJAX_LANES;
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

inline Lanes load_lanes(const float* p) {
  Lanes x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

inline void store_lanes(float* p, Lanes x) { std::memcpy(p, &x, sizeof x); }

// query . key over hd floats. Written in lanes because the compiler does not vectorise a
// one-accumulator float sum (it may not reorder it) and reduces each key's sum only once.
inline float dot(const float* query, const float* key, int64_t hd) {
  float sum = 0.0f;
  int64_t d = 0;
  if (hd >= kLanes) {
    Lanes lanes = load_lanes(query) * load_lanes(key);
    for (d = kLanes; d + kLanes <= hd; d += kLanes)
      lanes += load_lanes(query + d) * load_lanes(key + d);
    for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
  }
  for (; d < hd; ++d) sum += query[d] * key[d];
  return sum;
}

// Lane j of the result is the sum of v[j]'s kLanes lanes. Summing each register on its own
// costs a reduction per register, which bound the kernels; here they are reduced together,
// halving them pairwise in rounds of shuffles (15 additions for 16 sums instead of 16 x 15).
// Every v[j] is summed in the same order, whatever the others hold.
inline Lanes sum_each(const Lanes v[kLanes]) {
#if ETJAX_LANES == 16
  // Round 1: w[j] lanes 0-7 hold v[j]'s partial sums, lanes 8-15 v[j + 8]'s.
  Lanes w[8];
  for (int j = 0; j < 8; ++j)
    w[j] = __builtin_shufflevector(v[j], v[j + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20,
                                   21, 22, 23) +
           __builtin_shufflevector(v[j], v[j + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27,
                                   28, 29, 30, 31);
  // Round 2: x[j] in fours: v[j], v[j + 4], v[j + 8], v[j + 12].
  Lanes x[4];
  for (int j = 0; j < 4; ++j)
    x[j] = __builtin_shufflevector(w[j], w[j + 4], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24,
                                   25, 26, 27) +
           __builtin_shufflevector(w[j], w[j + 4], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28,
                                   29, 30, 31);
  // Round 3: y[j] in pairs: v[j], v[j + 2], v[j + 4], ..., v[j + 14].
  Lanes y[2];
  for (int j = 0; j < 2; ++j)
    y[j] = __builtin_shufflevector(x[j], x[j + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12,
                                   13, 28, 29) +
           __builtin_shufflevector(x[j], x[j + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14,
                                   15, 30, 31);
  // Round 4: lane j is v[j]'s sum.
  return __builtin_shufflevector(y[0], y[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28,
                                 14, 30) +
         __builtin_shufflevector(y[0], y[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29,
                                 15, 31);
#elif ETJAX_LANES == 8
  // The same three rounds lower: w[j] holds v[j]'s and v[j + 4]'s partial sums in fours,
  // x[j] v[j], v[j + 2], v[j + 4], v[j + 6] in pairs, and lane j of the result v[j]'s sum.
  Lanes w[4];
  for (int j = 0; j < 4; ++j)
    w[j] = __builtin_shufflevector(v[j], v[j + 4], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(v[j], v[j + 4], 4, 5, 6, 7, 12, 13, 14, 15);
  Lanes x[2];
  for (int j = 0; j < 2; ++j)
    x[j] = __builtin_shufflevector(w[j], w[j + 2], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(w[j], w[j + 2], 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(x[0], x[1], 0, 8, 2, 10, 4, 12, 6, 14) +
         __builtin_shufflevector(x[0], x[1], 1, 9, 3, 11, 5, 13, 7, 15);
#else
  Lanes sums;
  for (int j = 0; j < kLanes; ++j) {
    float sum = 0.0f;
    for (int l = 0; l < kLanes; ++l) sum += v[j][l];
    sums[j] = sum;
  }
  return sums;
#endif
}

// query . key for kLanes consecutive keys (rows `hd` floats apart), lane j holding key j's
// score, for hd a multiple of kLanes.
inline Lanes dots_of_keys(const float* query, const float* keys, int64_t hd) {
  Lanes v[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    const float* key = keys + j * hd;
    Lanes acc = load_lanes(query) * load_lanes(key);
    for (int64_t d = kLanes; d < hd; d += kLanes) acc += load_lanes(query + d) * load_lanes(key + d);
    v[j] = acc;
  }
  return sum_each(v);
}

// scores[j] = query . keys[j] for the `count` keys at `keys`: kLanes at a time where count and
// hd are multiples of kLanes (a page's 16 keys), else one by one.
inline void dots(const float* query, const float* keys, int64_t count, int64_t hd,
                 float* scores) {
  if (count % kLanes == 0 && hd % kLanes == 0) {
    for (int64_t j = 0; j < count; j += kLanes)
      store_lanes(scores + j, dots_of_keys(query, keys + j * hd, hd));
  } else {
    for (int64_t j = 0; j < count; ++j) scores[j] = dot(query, keys + j * hd, hd);
  }
}

// out = out * rescale + sum over keys j in [from, to) of weights[j] * values[j], each block of
// kLanes output floats held in a register across the keys.
inline void add_weighted(float* out, float rescale, const float* weights, const float* values,
                         int64_t from, int64_t to, int64_t hd) {
  int64_t d = 0;
  for (; d + kLanes <= hd; d += kLanes) {
    Lanes lanes = load_lanes(out + d) * rescale;
    for (int64_t j = from; j < to; ++j) lanes += weights[j] * load_lanes(values + j * hd + d);
    store_lanes(out + d, lanes);
  }
  for (; d < hd; ++d) {
    float x = out[d] * rescale;
    for (int64_t j = from; j < to; ++j) x += weights[j] * values[j * hd + d];
    out[d] = x;
  }
}

// Runs units 0 .. total - 1 of `run` on the calling thread and on helpers from XLA's intra-op
// pool, taking them from an atomic counter. The caller waits only for units that were taken,
// so a helper that starts after the last was taken finds nothing and returns; `run` (and
// what it points to) is kept alive by the helpers' copies of the shared pointer.
template <typename Run>
void run_units(std::shared_ptr<Run> run, int64_t total, xla::ffi::ThreadPool& pool) {
  struct Progress {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto progress = std::make_shared<Progress>();
  auto work = [run, progress, total]() {
    for (int64_t u; (u = progress->next.fetch_add(1)) < total;) {
      (*run)(u);
      progress->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), total) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(work)(work));
  work();
  while (progress->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
}

}  // namespace etjax_cpu

#endif  // ETJAX_PALLAS_KERNELS_CPU_KERNEL_MATH_H_
