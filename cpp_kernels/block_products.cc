// Products of float32 rows by quantized weights, out = x @ w.T with w [N, K] kept in blocks
// (pallas_kernels/block_products/formats.py): an XLA FFI custom call for CPUs that reads each
// weight block once for all the rows of a step and dequantizes it in registers.
//
// A decode step is the read of every weight of the model; kept in 4 or 8 bits the read is
// 6.4 or 3.8 times smaller than in float32. The kernel is row_products.cc's with the
// weights widened as they are loaded: each group of 4 weight rows is dequantized kLanes
// values at a time (bytes to int32 lanes to float32, times the block's scale, plus its
// offset) and multiplied against a block of up to kRowBlock input rows (row_blocks.h). With
// more rows than one block the group is dequantized once into an L1 scratch and every block
// of rows is multiplied against that, so the dequantization is paid once per weight, not
// once per block of rows.
//
//   x [M, K] f32, quants s8 [N, K] (8 bits) | u8 [N, K / 2] (4 bits, GGUF's nibble order),
//   scales f16 | f32 [N, K / block], offsets of the same type and shape, or empty (8 bits:
//   none; 4 bits: the value is scale * (q - 8)) -> out [M, N] f32. K a multiple of 32, block
//   of kLanes (32 for 4 bits), N of 4.
//
// A weight is scale * q + offset rounded once to float32 (a fused multiply-add) whichever
// path computed it, and each output is one float32 sum over K in row_blocks.h's fixed order,
// so a row's product does not depend on the rows beside it or on how many there are.

#include <functional>
#include <memory>
#include <vector>

// The library is built with -fassociative-math (build.py), which lets GCC regroup the two
// registers of 4-bit values added into one accumulator; then a row's sums would differ
// between the paths. The sums here are written in vector lanes already and need no licence.
#pragma GCC optimize("no-associative-math")

#include "kernel_math.h"
#include "row_blocks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace etjax_cpu;  // NOLINT: this file's own helpers

namespace {

constexpr int64_t kGroupsPerUnit = 8;  // as row_products.cc
constexpr int64_t kNibbleBlock = 32;   // 4-bit values are packed in 32s: 16 bytes


struct Product {
  const float* x;
  const void* quants;
  const void* scales;
  const void* offsets;  // null: none
  float* out;
  int64_t rows, in, outs, block;
  // With int8 rows (quantize_rows): x in int8, each 64 values reordered as the weights'
  // nibbles come out of 32 bytes; per 64 values 16 lanes of x's block scales; per block of
  // 32 the scale times the sum of its int8 values.
  std::vector<int8_t> xq;
  std::vector<float> x_scales, x_sums;
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

// The kStep integer values of weight row `row` from value i on (a multiple of kStep), as
// float32 lanes in order (4 bits: 0..15; in each 32, byte j holds value j in its low nibble
// and j + 16 in its high one).
template <int kBits>
inline void load_values(const void* quants, int64_t in, int64_t row, int64_t i,
                        Lanes (&q)[kSteps<kBits>]) {
  if constexpr (kBits == 8)
    q[0] = signed_bytes(static_cast<const int8_t*>(quants) + row * in + i);
  else
    nibbles(static_cast<const uint8_t*>(quants) + (row * in + i) / 2, q);
}

// A block's scale and offset as lanes (4 bits without offsets: value = scale * (q - 8), so
// the offset is -8 * scale, exact).
template <int kBits, bool kOffsets, typename S>
inline void scale_offset(const Product& p, int64_t row, int64_t b, Lanes& scale, Lanes& offset) {
  const int64_t at = row * (p.in / p.block) + b;
  const float s = scalar(static_cast<const S*>(p.scales), at);
  scale = Lanes{} + s;
  if constexpr (kOffsets)
    offset = Lanes{} + scalar(static_cast<const S*>(p.offsets), at);
  else
    offset = Lanes{} + (kBits == 4 ? -8.0f * s : 0.0f);
}

// Weight values q dequantized: one rounding (a fused multiply-add), the same in both paths.
template <int kBits, bool kOffsets>
inline Lanes dequantize(Lanes q, Lanes scale, Lanes offset) {
  if constexpr (kBits == 8) return q * scale;
  return q * scale + offset;
}

// R <= kRowBlock rows of x against weight rows [row, row + kOutStep), dequantized as they
// are loaded, a block at a time; the same sums, in the same order, as row_blocks.h's
// rows_by_group on the dequantized weights.
template <int R, int kBits, bool kOffsets, typename S>
inline void rows_by_blocks(const Product& p, const float* x, int64_t row, float* out) {
  constexpr int64_t kN = kSteps<kBits>;
  Lanes acc[kRowBlock * kOutStep] = {};
  for (int64_t b = 0, i = 0; b < p.in / p.block; ++b) {
    Lanes scale[kOutStep], offset[kOutStep];
    for (int64_t o = 0; o < kOutStep; ++o)
      scale_offset<kBits, kOffsets, S>(p, row + o, b, scale[o], offset[o]);
    for (const int64_t end = i + p.block; i < end; i += kStep<kBits>) {
      Lanes wl[kOutStep][kN];
      for (int64_t o = 0; o < kOutStep; ++o) {
        load_values<kBits>(p.quants, p.in, row + o, i, wl[o]);
        for (int64_t k = 0; k < kN; ++k)
          wl[o][k] = dequantize<kBits, kOffsets>(wl[o][k], scale[o], offset[o]);
      }
      for (int64_t k = 0; k < kN; ++k)
        for (int r = 0; r < R; ++r) {
          const Lanes xl = load_lanes(x + r * p.in + i + k * kLanes);
          for (int64_t o = 0; o < kOutStep; ++o) acc[r * kOutStep + o] += xl * wl[o][k];
        }
    }
  }
  float sums[kLanes];
  store_lanes(sums, sum_each(acc));
  for (int r = 0; r < R; ++r)
    std::memcpy(out + r * p.outs, sums + r * kOutStep, kOutStep * sizeof(float));
}

// Weight rows [row, row + kOutStep) dequantized into `w` (kOutStep x in floats).
template <int kBits, bool kOffsets, typename S>
inline void dequantize_group(const Product& p, int64_t row, float* w) {
  for (int64_t o = 0; o < kOutStep; ++o)
    for (int64_t b = 0, i = 0; b < p.in / p.block; ++b) {
      Lanes scale, offset;
      scale_offset<kBits, kOffsets, S>(p, row + o, b, scale, offset);
      for (const int64_t end = i + p.block; i < end; i += kStep<kBits>) {
        Lanes q[kSteps<kBits>];
        load_values<kBits>(p.quants, p.in, row + o, i, q);
        for (int64_t k = 0; k < kSteps<kBits>; ++k)
          store_lanes(w + o * p.in + i + k * kLanes, dequantize<kBits, kOffsets>(q[k], scale, offset));
      }
    }
}

template <int kBits, bool kOffsets, typename S>
void run_unit(const Product& p, int64_t unit) {
  const int64_t groups = p.outs / kOutStep;
  const int64_t first = unit * kGroupsPerUnit, last = std::min(groups, first + kGroupsPerUnit);
  thread_local std::vector<float> scratch;
  for (int64_t g = first; g < last; ++g) {
    const int64_t row = g * kOutStep;
    if (p.rows <= kRowBlock) {
      // A decode step of a few rows: the weights are multiplied as they are dequantized.
      if (p.rows == kRowBlock)
        rows_by_blocks<kRowBlock, kBits, kOffsets, S>(p, p.x, row, p.out + row);
      if constexpr (kRowBlock > 3)
        if (p.rows == 3) rows_by_blocks<3, kBits, kOffsets, S>(p, p.x, row, p.out + row);
      if constexpr (kRowBlock > 2)
        if (p.rows == 2) rows_by_blocks<2, kBits, kOffsets, S>(p, p.x, row, p.out + row);
      if constexpr (kRowBlock > 1)
        if (p.rows == 1) rows_by_blocks<1, kBits, kOffsets, S>(p, p.x, row, p.out + row);
      continue;
    }
    // More rows: the group is dequantized once into L1 and multiplied as float32 weights.
    scratch.resize(kOutStep * p.in);
    dequantize_group<kBits, kOffsets, S>(p, row, scratch.data());
    all_rows_by_group(p.x, p.rows, scratch.data(), p.in, p.out + row, p.outs);
  }
}

#if defined(__AVX512VNNI__) && ETJAX_LANES == 16
constexpr bool kInt8Rows = true;
constexpr int64_t kChunk = 64;  // values of a row multiplied per instruction

// x's rows quantized to int8 per block of 32 (scale = max |x| / 127, rounded to nearest):
// in each 64 values, blocks A and B are stored A 0-15, B 0-15, A 16-31, B 16-31, the order
// of 32 bytes of nibbles split into low and high halves (nibbles() of two blocks at once).
void quantize_rows(Product& p) {
  const int64_t chunks = p.in / kChunk;
  p.xq.resize(p.rows * p.in);
  p.x_scales.resize(p.rows * chunks * kLanes);
  p.x_sums.resize(p.rows * (p.in / kNibbleBlock));
  for (int64_t r = 0; r < p.rows; ++r)
    for (int64_t c = 0; c < chunks; ++c) {
      float scale[2];
      for (int64_t h = 0; h < 2; ++h) {
        const float* x = p.x + r * p.in + c * kChunk + h * kNibbleBlock;
        float top = 0.0f;
        for (int64_t v = 0; v < kNibbleBlock; ++v) top = std::max(top, std::fabs(x[v]));
        scale[h] = top / 127.0f;
        const float inverse = top > 0.0f ? 127.0f / top : 0.0f;
        int32_t sum = 0;
        int8_t* q = p.xq.data() + r * p.in + c * kChunk;
        for (int64_t v = 0; v < kNibbleBlock; ++v) {
          const int8_t value = static_cast<int8_t>(std::nearbyint(x[v] * inverse));
          q[(v / 16) * 32 + h * 16 + v % 16] = value;
          sum += value;
        }
        p.x_sums[r * (p.in / kNibbleBlock) + 2 * c + h] = scale[h] * static_cast<float>(sum);
      }
      float* lanes = p.x_scales.data() + (r * chunks + c) * kLanes;
      for (int64_t l = 0; l < kLanes; ++l) lanes[l] = scale[(l / 4) % 2];
    }
}

// R <= kRowBlock int8 rows against 4-bit weight rows [row, row + kOutStep) with blocks of 32:
// per 64 values and pair (row, weight row) one dot product of bytes into 16 int32 lanes
// (each the sum of 4 products of one block), widened and scaled by both blocks' scales.
// scales/offsets: the group's, kOutStep x blocks, in float32.
template <int R>
inline void int8_rows_by_blocks(const Product& p, int64_t r0, int64_t row, const float* scales,
                                const float* offsets, float* out) {
  const int64_t chunks = p.in / kChunk, blocks = p.in / kNibbleBlock;
  const __m512i pair_index = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m256i mask = _mm256_set1_epi8(0x0F);
  __m512 acc[kRowBlock * kOutStep];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    __m512i q[kOutStep];
    __m512 s[kOutStep];
    for (int64_t o = 0; o < kOutStep; ++o) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
          static_cast<const uint8_t*>(p.quants) + (row + o) * (p.in / 2) + c * kChunk / 2));
      q[o] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, mask)),
                                _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask), 1);
      const __m512 pair = _mm512_castps128_ps512(_mm_castpd_ps(
          _mm_load_sd(reinterpret_cast<const double*>(scales + o * blocks + 2 * c))));
      s[o] = _mm512_permutexvar_ps(pair_index, pair);
    }
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_loadu_si512(p.xq.data() + (r0 + r) * p.in + c * kChunk);
      const __m512 xs = _mm512_loadu_ps(p.x_scales.data() + ((r0 + r) * chunks + c) * kLanes);
      for (int64_t o = 0; o < kOutStep; ++o) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[o], xv);
        acc[r * kOutStep + o] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                                _mm512_mul_ps(s[o], xs), acc[r * kOutStep + o]);
      }
    }
  }
  Lanes lanes[kLanes];
  std::memcpy(lanes, acc, sizeof lanes);
  float sums[kLanes];
  store_lanes(sums, sum_each(lanes));
  for (int r = 0; r < R; ++r)
    for (int64_t o = 0; o < kOutStep; ++o) {
      // The offsets' part: offset times the block's sum of x, for every block.
      const float* x_sums = p.x_sums.data() + (r0 + r) * blocks;
      float shift = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) shift += offsets[o * blocks + b] * x_sums[b];
      out[r * p.outs + o] = sums[r * kOutStep + o] + shift;
    }
}

template <bool kOffsets, typename S>
void run_int8_unit(const Product& p, int64_t unit) {
  const int64_t groups = p.outs / kOutStep, blocks = p.in / kNibbleBlock;
  const int64_t first = unit * kGroupsPerUnit, last = std::min(groups, first + kGroupsPerUnit);
  thread_local std::vector<float> scratch;
  scratch.resize(2 * kOutStep * blocks);
  float *scales = scratch.data(), *offsets = scales + kOutStep * blocks;
  for (int64_t g = first; g < last; ++g) {
    const int64_t row = g * kOutStep;
    for (int64_t o = 0; o < kOutStep; ++o)
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t at = (row + o) * blocks + b;
        scales[o * blocks + b] = scalar(static_cast<const S*>(p.scales), at);
        offsets[o * blocks + b] = kOffsets ? scalar(static_cast<const S*>(p.offsets), at)
                                           : -8.0f * scales[o * blocks + b];
      }
    int64_t r = 0;
    float* out = p.out + row;
    for (; r + kRowBlock <= p.rows; r += kRowBlock)
      int8_rows_by_blocks<kRowBlock>(p, r, row, scales, offsets, out + r * p.outs);
    const int64_t left = p.rows - r;
    if (left == 3) int8_rows_by_blocks<3>(p, r, row, scales, offsets, out + r * p.outs);
    if (left == 2) int8_rows_by_blocks<2>(p, r, row, scales, offsets, out + r * p.outs);
    if (left == 1) int8_rows_by_blocks<1>(p, r, row, scales, offsets, out + r * p.outs);
  }
}
#else
constexpr bool kInt8Rows = false;
constexpr int64_t kChunk = 64;
#endif

template <int kBits, bool kOffsets, typename S>
std::function<void(int64_t)> body(std::shared_ptr<Product> p) {
  return [p](int64_t u) { run_unit<kBits, kOffsets, S>(*p, u); };
}

#if defined(__AVX512VNNI__) && ETJAX_LANES == 16
template <bool kOffsets, typename S>
std::function<void(int64_t)> int8_body(std::shared_ptr<Product> p) {
  return [p](int64_t u) { run_int8_unit<kOffsets, S>(*p, u); };
}
#endif

template <typename S>
std::function<void(int64_t)> body_for(std::shared_ptr<Product> p, int bits) {
  if (bits == 8) return body<8, false, S>(p);
  return p->offsets ? body<4, true, S>(p) : body<4, false, S>(p);
}

ffi::Error BlockProductsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer quants,
                             ffi::AnyBuffer scales, ffi::AnyBuffer offsets,
                             ffi::ResultBuffer<ffi::F32> out, int32_t int8_rows) {
  const auto x_dims = x.dimensions(), q_dims = quants.dimensions(), s_dims = scales.dimensions();
  if (x_dims.size() != 2 || q_dims.size() != 2 || s_dims.size() != 2)
    return ffi::Error::InvalidArgument("block products: expected x [M, K], quants and scales 2-D");
  const int bits = quants.element_type() == ffi::DataType::S8   ? 8
                   : quants.element_type() == ffi::DataType::U8 ? 4
                                                                : 0;
  if (!bits) return ffi::Error::InvalidArgument("block products: quants must be s8 or u8");
  const int64_t in = x_dims[1], outs = q_dims[0];
  if (q_dims[1] * (bits == 4 ? 2 : 1) != in || s_dims[0] != outs || s_dims[1] <= 0 ||
      in % s_dims[1])
    return ffi::Error::InvalidArgument("block products: quants or scales do not fit x");
  const int64_t block = in / s_dims[1];
  if (in % kNibbleBlock || block % (bits == 4 ? kNibbleBlock : kLanes) || outs % kOutStep)
    return ffi::Error::InvalidArgument(
        "block products: K must be a multiple of 32, the block of the lanes, N of 4");
  const bool has_offsets = offsets.element_count() > 0;
  if (has_offsets && (bits != 4 || offsets.element_type() != scales.element_type() ||
                      offsets.element_count() != scales.element_count()))
    return ffi::Error::InvalidArgument("block products: offsets must match the 4-bit scales");
  auto product = std::make_shared<Product>(
      Product{x.typed_data(), quants.untyped_data(), scales.untyped_data(),
              has_offsets ? offsets.untyped_data() : nullptr, out->typed_data(), x_dims[0], in,
              outs, block});
  if (scales.element_type() != ffi::DataType::F32 && scales.element_type() != ffi::DataType::F16)
    return ffi::Error::InvalidArgument("block products: scales must be f16 or f32");
  const bool f16 = scales.element_type() == ffi::DataType::F16;
  std::function<void(int64_t)> run;
  if (int8_rows && kInt8Rows && bits == 4 && block == kNibbleBlock && in % kChunk == 0) {
#if defined(__AVX512VNNI__) && ETJAX_LANES == 16
    quantize_rows(*product);
    if (has_offsets)
      run = f16 ? int8_body<true, _Float16>(product) : int8_body<true, float>(product);
    else
      run = f16 ? int8_body<false, _Float16>(product) : int8_body<false, float>(product);
#endif
  } else {
    run = f16 ? body_for<_Float16>(product, bits) : body_for<float>(product, bits);
  }
  const int64_t groups = outs / kOutStep;
  run_units(std::make_shared<std::function<void(int64_t)>>(std::move(run)),
            (groups + kGroupsPerUnit - 1) / kGroupsPerUnit, pool);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EtjaxBlockProductsCpu, BlockProductsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::AnyBuffer>()         // quants
                                  .Arg<ffi::AnyBuffer>()         // scales
                                  .Arg<ffi::AnyBuffer>()         // offsets, or empty
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<int32_t>("int8_rows")
);
