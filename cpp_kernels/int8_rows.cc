// Products of rows rounded to int8 by weights in blocks of 32 interleaved 16 outputs at a time,
// out = x @ w.T with w [N, K] in formats.py's interleaved layout (pallas_kernels/block_products/
// formats.py, "Interleaved"): an XLA FFI custom call for CPUs, the arithmetic llama.cpp runs
// GGUF files with, on a layout made for it.
//
// Why: block_products.cc multiplies float32 rows, 16 multiply-adds a register, and at 8 rows
// (a verifying step of speculation, a batch-8 decode step) the arithmetic, not the weights'
// bytes, bounds it: 8 rows cost 2.5 times one. Rows rounded to int8 per block of 32 are
// multiplied by AVX-512 VNNI's dot products, 64 byte products a register.
//
// How: each row is quantized once per call (per block of 32: dx = max |x| / 127, q = x / dx
// rounded to nearest even, and xsum = dx x the sum of q). A unit is 16 outputs, whose values
// the interleaved layout keeps as one stream: a block is 8 (8 bits) or 4 (4 bits: low and high
// nibbles) registers of 64 bytes, register k holding values 4k..4k+3 of each output in its
// 32-bit lane, read once for all the rows; a row's 8 words of quantized values are broadcast
// against them. So a lane accumulates one output's integer dot product of the block, exact in
// int32, and one conversion, one multiply and one multiply-add a block serve 16 outputs:
//
//   out[r][o] = sum over blocks b, in order, of
//       float(sum_i q_w[o][i] q_x[r][i] - c * sum_i q_x[r][i]) * (scale[o][b] * dx[r][b])
//       + offset[o][b] * xsum[r][b]                        (4 bits with offsets)
//   c: 128 for 8 bits (weights biased to unsigned bytes), 8 for 4 bits without offsets
//   (value = scale * (q - 8)), 0 with offsets.
//
// Every row's outputs are that sum whatever the rows beside it (a batch-1 step and a verifying
// step of 8 rows give a row the same bits). The error against float32 rows is the rows'
// rounding: per block at most dx / 2 x the sum of the weights' magnitudes (reference.py's
// int8_rows_bound). With AVX2 alone (8 outputs a register), or neither (a portable loop), the
// same integers and float32 operations give the same bits.
//
//   x [M, K] f32, quants s8 [N, K] (8 bits) | u8 [N, K / 2] (4 bits), scales f16 | f32
//   [N, K / 32], offsets of the same type and shape, or empty; all interleaved -> out [M, N]
//   f32. K a multiple of 32, N of 16.

// The library is built with -fassociative-math (build.py); the float32 operations here are
// written in the order the header states, which the portable loop must keep. Before the
// includes, as in block_products.cc: GCC inlines a function only into one of the same options.
#pragma GCC optimize("no-associative-math")

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "kernel_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using etjax_cpu::run_units;

namespace {

constexpr int64_t kBlock = 32;    // values a row's quantization (and a weight's scale) covers
constexpr int64_t kOuts = 16;     // outputs a unit computes: a register's 32-bit lanes
constexpr int kTileRows = 8;      // rows multiplied against a block's registers at once

// A call's rows, quantized: q [M, K] int8; per row and block dx (the step), qsum (the
// quantized values' sum) and xsum (dx x qsum).
struct Rows {
  int64_t count, in;
  std::vector<int8_t> q;
  std::vector<float> dx, xsum;
  std::vector<int32_t> qsum;
};

// A block of 32 values of a row quantized: q's 32 values, dx, qsum, and xsum = dx x qsum, the
// block's sum as its quantized values have it: the offset term is then dx x offset x qsum, so
// each value's rounding meets the whole weight (scale x q + offset), not scale x q alone,
// which for 4-bit values (0..15) is far from centred: against the exact float32 sum, SmolLM2
// Q4_1's perplexity rose 0.74% instead of 0.57% (docs/PERF.md, "Int8 rows"). Every path rounds
// x * (127 / max |x|) to nearest, ties to even (the vector conversion under the default
// rounding mode; nearbyint).
inline void quantize_block(const float* v, int8_t* q, float& dx, float& xsum, int32_t& qsum) {
#if defined(__AVX512F__)
  const __m512 a = _mm512_loadu_ps(v), c = _mm512_loadu_ps(v + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
  const __m512 inverse = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inverse));
  const __m512i qc = _mm512_cvtps_epi32(_mm512_mul_ps(c, inverse));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qc));
  qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qc));
#else
  float amax = 0.0f;
  for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
  qsum = 0;
  for (int64_t i = 0; i < kBlock; ++i) {
    const int32_t value = static_cast<int32_t>(std::nearbyint(v[i] * inverse));
    q[i] = static_cast<int8_t>(std::max(-127, std::min(127, value)));
    qsum += q[i];
  }
#endif
  dx = amax / 127.0f;
  xsum = dx * static_cast<float>(qsum);
}

// The rows quantized, each block on its own: the same values whatever the rows beside it.
void quantize_rows(const float* x, int64_t count, int64_t in, Rows& rows) {
  const int64_t blocks = in / kBlock;
  rows.count = count;
  rows.in = in;
  rows.q.resize(count * in);
  rows.dx.resize(count * blocks);
  rows.xsum.resize(count * blocks);
  rows.qsum.resize(count * blocks);
  for (int64_t r = 0; r < count; ++r)
    for (int64_t b = 0; b < blocks; ++b)
      quantize_block(x + r * in + b * kBlock, rows.q.data() + r * in + b * kBlock,
                     rows.dx[r * blocks + b], rows.xsum[r * blocks + b],
                     rows.qsum[r * blocks + b]);
}

struct Weight {
  const uint8_t* quants;
  const void* scales;
  const void* offsets;  // null: none
  bool f16_scales;
  int bits;
  int64_t outs, in;

  int64_t blocks() const { return in / kBlock; }
  int64_t tile() const { return bits == 4 ? 16 * kOuts : 32 * kOuts; }  // bytes of a unit's block
  // Unit u's block b: its registers' 64-byte chunks, one after another.
  const uint8_t* chunks(int64_t u, int64_t b) const { return quants + (u * blocks() + b) * tile(); }
};

// The 16 float32 scales (or offsets) of unit u's block b, kept together by the layout.
inline void block_scales(const Weight& w, const void* base, int64_t u, int64_t b, float* out) {
  const int64_t at = (u * w.blocks() + b) * kOuts;
  if (w.f16_scales)
    etjax_cpu::as_float(static_cast<const _Float16*>(base) + at, kOuts, out);
  else
    std::memcpy(out, static_cast<const float*>(base) + at, kOuts * sizeof(float));
}

// The integer correction c of the header's formula.
inline int32_t correction(const Weight& w) {
  if (w.bits == 8) return 128;
  return w.offsets ? 0 : 8;
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
// Unit u's block b as 8 registers of unsigned bytes: register k holds values 4k..4k+3 of each
// output in its lane.
inline void block_registers(const Weight& w, int64_t u, int64_t b, __m512i (&reg)[8]) {
  const uint8_t* p = w.chunks(u, b);
  if (w.bits == 4) {
    const __m512i mask = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {  // low nibbles: values 4c.., high: 16 + 4c..
      const __m512i v = _mm512_loadu_si512(p + 64 * c);
      reg[c] = _mm512_and_si512(v, mask);
      reg[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
    }
  } else {
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));  // q + 128, unsigned
    for (int k = 0; k < 8; ++k) reg[k] = _mm512_xor_si512(_mm512_loadu_si512(p + 64 * k), bias);
  }
}

// Outputs of unit u for R rows from `first`, into out (row stride outs).
template <int R>
void unit_tile(const Weight& w, const Rows& rows, int64_t u, int64_t first, float* out) {
  const int64_t blocks = w.blocks();
  const int32_t c = correction(w);
  __m512 f[R];
  for (int r = 0; r < R; ++r) f[r] = _mm512_setzero_ps();
  alignas(64) float scales[kOuts], offsets[kOuts] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i reg[8];
    block_registers(w, u, b, reg);
    block_scales(w, w.scales, u, b, scales);
    if (w.offsets) block_scales(w, w.offsets, u, b, offsets);
    const __m512 scale = _mm512_load_ps(scales), offset = _mm512_load_ps(offsets);
    // Unrolled, so that f[] stays in registers (as a loop GCC kept it on the stack).
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t row = first + r;
      const int8_t* q = rows.q.data() + row * rows.in + b * kBlock;
      // Two chains of dot products: each waits on its last (4 cycles on Zen 4), half as long.
      __m512i acc = _mm512_set1_epi32(-c * rows.qsum[row * blocks + b]);
      __m512i odd = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int k = 0; k < 8; k += 2) {
        int32_t words[2];
        std::memcpy(words, q + 4 * k, sizeof words);
        acc = _mm512_dpbusd_epi32(acc, reg[k], _mm512_set1_epi32(words[0]));
        odd = _mm512_dpbusd_epi32(odd, reg[k + 1], _mm512_set1_epi32(words[1]));
      }
      acc = _mm512_add_epi32(acc, odd);
      const __m512 step = _mm512_mul_ps(scale, _mm512_set1_ps(rows.dx[row * blocks + b]));
      f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), step, f[r]);
      if (w.offsets)
        f[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(rows.xsum[row * blocks + b]), f[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (first + r) * w.outs + u * kOuts, f[r]);
}

template <int R>
void last_tile(const Weight& w, const Rows& rows, int64_t u, int64_t first, float* out) {
  if constexpr (R > 0) {
    if (rows.count - first == R) return unit_tile<R>(w, rows, u, first, out);
    last_tile<R - 1>(w, rows, u, first, out);
  }
}

// Unit u against every row, kTileRows at a time (a unit's blocks, 4.5 to 24 KB for SmolLM2's
// weights, stay in L1 and L2 from one tile of rows to the next).
void run_unit(const Weight& w, const Rows& rows, int64_t u, float* out) {
  int64_t r = 0;
  for (; r + kTileRows <= rows.count; r += kTileRows) unit_tile<kTileRows>(w, rows, u, r, out);
  last_tile<kTileRows - 1>(w, rows, u, r, out);
}
#elif defined(__AVX2__)
// Without VNNI (AVX2: Zen 2 and 3, Haswell to Cascade Lake), 8 outputs a 256-bit register, a
// unit's halves one after the other, and byte products summed in pairs to 16 bits (maddubs)
// then in fours to 32 (madd by ones): the same integers, never saturated (4 bits: at most
// 2 x 15 x 127; 8 bits, multiplied as |w| by x with w's sign: 2 x 128 x 127 < 2**15).
constexpr int kAvx2Rows = 4;

template <int R>
void half_tile(const Weight& w, const Rows& rows, int64_t u, int half, int64_t first, float* out) {
  const int64_t blocks = w.blocks();
  const int32_t c = w.bits == 8 ? 0 : correction(w);  // 8 bits: w itself, signed, not biased
  const __m256i ones = _mm256_set1_epi16(1), mask = _mm256_set1_epi8(0x0F);
  __m256 f[R];
  for (int r = 0; r < R; ++r) f[r] = _mm256_setzero_ps();
  alignas(64) float scales[kOuts], offsets[kOuts] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* p = w.chunks(u, b) + 32 * half;
    __m256i reg[8];
    if (w.bits == 4) {
      for (int k = 0; k < 4; ++k) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * k));
        reg[k] = _mm256_and_si256(v, mask);
        reg[k + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
      }
    } else {
      for (int k = 0; k < 8; ++k)
        reg[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * k));
    }
    block_scales(w, w.scales, u, b, scales);
    if (w.offsets) block_scales(w, w.offsets, u, b, offsets);
    const __m256 scale = _mm256_load_ps(scales + 8 * half);
    const __m256 offset = _mm256_load_ps(offsets + 8 * half);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int64_t row = first + r;
      const int8_t* q = rows.q.data() + row * rows.in + b * kBlock;
      __m256i acc = _mm256_set1_epi32(-c * rows.qsum[row * blocks + b]);
#pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) {
        int32_t word;
        std::memcpy(&word, q + 4 * k, sizeof word);
        const __m256i x = _mm256_set1_epi32(word);
        const __m256i pairs =
            w.bits == 4 ? _mm256_maddubs_epi16(reg[k], x)
                        : _mm256_maddubs_epi16(_mm256_abs_epi8(reg[k]), _mm256_sign_epi8(x, reg[k]));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones));
      }
      const __m256 step = _mm256_mul_ps(scale, _mm256_set1_ps(rows.dx[row * blocks + b]));
      f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), step, f[r]);
      if (w.offsets)
        f[r] = _mm256_fmadd_ps(offset, _mm256_set1_ps(rows.xsum[row * blocks + b]), f[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    _mm256_storeu_ps(out + (first + r) * w.outs + u * kOuts + 8 * half, f[r]);
}

template <int R>
void last_tile(const Weight& w, const Rows& rows, int64_t u, int half, int64_t first, float* out) {
  if constexpr (R > 0) {
    if (rows.count - first == R) return half_tile<R>(w, rows, u, half, first, out);
    last_tile<R - 1>(w, rows, u, half, first, out);
  }
}

void run_unit(const Weight& w, const Rows& rows, int64_t u, float* out) {
  for (int half = 0; half < 2; ++half) {
    int64_t r = 0;
    for (; r + kAvx2Rows <= rows.count; r += kAvx2Rows)
      half_tile<kAvx2Rows>(w, rows, u, half, r, out);
    last_tile<kAvx2Rows - 1>(w, rows, u, half, r, out);
  }
}
#else
// Value i of block b of output l of unit u, as the unsigned integer the VNNI path multiplies.
inline int32_t weight_byte(const Weight& w, int64_t u, int64_t b, int64_t l, int64_t i) {
  const uint8_t* p = w.chunks(u, b);
  if (w.bits == 8) return static_cast<int8_t>(p[64 * (i / 4) + 4 * l + i % 4]) + 128;
  const int64_t j = i % 16;  // byte j of the row's block: value j low, j + 16 high
  const uint8_t byte = p[64 * (j / 4) + 4 * l + j % 4];
  return i < 16 ? byte & 0x0F : byte >> 4;
}

// The same integers and float32 operations, in the same order, one output at a time.
void run_unit(const Weight& w, const Rows& rows, int64_t u, float* out) {
  const int64_t blocks = w.blocks();
  const int32_t c = correction(w);
  float scales[kOuts], offsets[kOuts] = {};
  for (int64_t r = 0; r < rows.count; ++r) {
    float f[kOuts] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      block_scales(w, w.scales, u, b, scales);
      if (w.offsets) block_scales(w, w.offsets, u, b, offsets);
      const float dx = rows.dx[r * blocks + b];
      for (int64_t l = 0; l < kOuts; ++l) {
        int32_t acc = -c * rows.qsum[r * blocks + b];
        for (int64_t i = 0; i < kBlock; ++i)
          acc += weight_byte(w, u, b, l, i) * rows.q[r * rows.in + b * kBlock + i];
        f[l] = std::fma(static_cast<float>(acc), scales[l] * dx, f[l]);
        if (w.offsets) f[l] = std::fma(offsets[l], rows.xsum[r * blocks + b], f[l]);
      }
    }
    std::memcpy(out + r * w.outs + u * kOuts, f, sizeof f);
  }
}
#endif

ffi::Error Int8RowsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer quants,
                        ffi::AnyBuffer scales, ffi::AnyBuffer offsets,
                        ffi::ResultBuffer<ffi::F32> out) {
  const auto x_dims = x.dimensions(), q_dims = quants.dimensions(), s_dims = scales.dimensions();
  if (x_dims.size() != 2 || q_dims.size() != 2 || s_dims.size() != 2)
    return ffi::Error::InvalidArgument("int8 rows: expected x [M, K], quants and scales 2-D");
  const int bits = quants.element_type() == ffi::DataType::S8   ? 8
                   : quants.element_type() == ffi::DataType::U8 ? 4
                                                                : 0;
  if (!bits) return ffi::Error::InvalidArgument("int8 rows: quants must be s8 or u8");
  const int64_t in = x_dims[1], outs = q_dims[0];
  if (in % kBlock || outs % kOuts || q_dims[1] * (bits == 4 ? 2 : 1) != in ||
      s_dims[0] != outs || s_dims[1] != in / kBlock)
    return ffi::Error::InvalidArgument(
        "int8 rows: K must be a multiple of 32, N of 16, scales one per block of 32");
  if (scales.element_type() != ffi::DataType::F32 && scales.element_type() != ffi::DataType::F16)
    return ffi::Error::InvalidArgument("int8 rows: scales must be f16 or f32");
  const bool has_offsets = offsets.element_count() > 0;
  if (has_offsets && (bits != 4 || offsets.element_type() != scales.element_type() ||
                      offsets.element_count() != scales.element_count()))
    return ffi::Error::InvalidArgument("int8 rows: offsets must match the 4-bit scales");
  auto rows = std::make_shared<Rows>();
  quantize_rows(x.typed_data(), x_dims[0], in, *rows);
  const Weight weight{static_cast<const uint8_t*>(quants.untyped_data()), scales.untyped_data(),
                      has_offsets ? offsets.untyped_data() : nullptr,
                      scales.element_type() == ffi::DataType::F16, bits, outs, in};
  float* result = out->typed_data();
  std::function<void(int64_t)> run = [rows, weight, result](int64_t u) {
    run_unit(weight, *rows, u, result);
  };
  run_units(std::make_shared<std::function<void(int64_t)>>(std::move(run)), outs / kOuts, pool);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EtjaxInt8RowsCpu, Int8RowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::AnyBuffer>()         // quants
                                  .Arg<ffi::AnyBuffer>()         // scales
                                  .Arg<ffi::AnyBuffer>()         // offsets, or empty
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
);
