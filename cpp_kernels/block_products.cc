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

#include "kernel_math.h"
#include "row_blocks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace etjax_cpu;  // NOLINT: this file's own helpers

namespace {

constexpr int64_t kGroupsPerUnit = 8;  // as row_products.cc
constexpr int64_t kNibbleBlock = 32;   // 4-bit values are packed in 32s: 16 bytes

typedef int8_t SignedBytes __attribute__((vector_size(kLanes)));
typedef uint8_t Bytes __attribute__((vector_size(kLanes)));
typedef int32_t Ints __attribute__((vector_size(kLanes * sizeof(int32_t))));

struct Product {
  const float* x;
  const void* quants;
  const void* scales;
  const void* offsets;  // null: none
  float* out;
  int64_t rows, in, outs, block;
};

inline float scalar(const float* p, int64_t i) { return p[i]; }
inline float scalar(const _Float16* p, int64_t i) { return static_cast<float>(p[i]); }

// The kLanes integer values of weight row `row` (8 bits: int8 [K]; 4 bits: packed [K / 2])
// from value i on (i a multiple of kLanes), as float32 lanes (4 bits: 0..15).
template <int kBits>
inline Lanes load_values(const void* quants, int64_t in, int64_t row, int64_t i) {
  if constexpr (kBits == 8) {
    SignedBytes b;
    std::memcpy(&b, static_cast<const int8_t*>(quants) + row * in + i, sizeof b);
    return __builtin_convertvector(__builtin_convertvector(b, Ints), Lanes);
  } else {
    // In each 32 values, byte j holds value j (low nibble) and j + 16 (high nibble).
    const int64_t within = i % kNibbleBlock;
    const uint8_t* p = static_cast<const uint8_t*>(quants) + row * (in / 2) +
                       (i - within) / 2 + within % (kNibbleBlock / 2);
    Bytes b;
    std::memcpy(&b, p, sizeof b);
    b = within < kNibbleBlock / 2 ? b & 0x0F : b >> 4;
    return __builtin_convertvector(__builtin_convertvector(b, Ints), Lanes);
  }
}

// Weight row `row`'s kLanes values from i on, dequantized in float32.
template <int kBits, bool kOffsets, typename S>
inline Lanes weight_lanes(const Product& p, int64_t row, int64_t i) {
  const int64_t b = row * (p.in / p.block) + i / p.block;
  const float scale = scalar(static_cast<const S*>(p.scales), b);
  const Lanes q = load_values<kBits>(p.quants, p.in, row, i);
  if constexpr (kOffsets) return q * scale + scalar(static_cast<const S*>(p.offsets), b);
  if constexpr (kBits == 4) return q * scale - 8.0f * scale;
  return q * scale;
}

// R <= kRowBlock rows of x against weight rows [row, row + kOutStep), dequantized as they
// are loaded; the same sums, in the same order, as row_blocks.h's rows_by_group.
template <int R, int kBits, bool kOffsets, typename S>
inline void rows_by_blocks(const Product& p, const float* x, int64_t row, float* out) {
  Lanes acc[kRowBlock * kOutStep] = {};
  for (int64_t i = 0; i < p.in; i += kLanes) {
    Lanes wl[kOutStep];
    for (int64_t o = 0; o < kOutStep; ++o) wl[o] = weight_lanes<kBits, kOffsets, S>(p, row + o, i);
    for (int r = 0; r < R; ++r) {
      const Lanes xl = load_lanes(x + r * p.in + i);
      for (int64_t o = 0; o < kOutStep; ++o) acc[r * kOutStep + o] += xl * wl[o];
    }
  }
  float sums[kLanes];
  store_lanes(sums, sum_each(acc));
  for (int r = 0; r < R; ++r)
    std::memcpy(out + r * p.outs, sums + r * kOutStep, kOutStep * sizeof(float));
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
    for (int64_t o = 0; o < kOutStep; ++o)
      for (int64_t i = 0; i < p.in; i += kLanes)
        store_lanes(scratch.data() + o * p.in + i,
                    weight_lanes<kBits, kOffsets, S>(p, row + o, i));
    all_rows_by_group(p.x, p.rows, scratch.data(), p.in, p.out + row, p.outs);
  }
}

template <int kBits, bool kOffsets, typename S>
std::function<void(int64_t)> body(std::shared_ptr<Product> p) {
  return [p](int64_t u) { run_unit<kBits, kOffsets, S>(*p, u); };
}

template <typename S>
std::function<void(int64_t)> body_for(std::shared_ptr<Product> p, int bits) {
  if (bits == 8) return body<8, false, S>(p);
  return p->offsets ? body<4, true, S>(p) : body<4, false, S>(p);
}

ffi::Error BlockProductsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer quants,
                             ffi::AnyBuffer scales, ffi::AnyBuffer offsets,
                             ffi::ResultBuffer<ffi::F32> out) {
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
  std::function<void(int64_t)> run;
  switch (scales.element_type()) {
    case ffi::DataType::F32:
      run = body_for<float>(product, bits);
      break;
    case ffi::DataType::F16:
      run = body_for<_Float16>(product, bits);
      break;
    default:
      return ffi::Error::InvalidArgument("block products: scales must be f16 or f32");
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
);
