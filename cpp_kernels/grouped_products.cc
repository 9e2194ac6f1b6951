// The routed experts' grouped product, out[r] = x[r] @ w[g(r)].T: an XLA FFI custom call for
// CPUs that multiplies each row by its own group's matrix only (etjax/model/experts.py).
//
// XLA:CPU has no grouped matrix product in JAX 0.10.2: `jax.lax.ragged_dot_general` expands
// the rows to every group, masks the rows of other groups and runs a dense product, E times
// the FLOPs a token's k experts need, reading every expert's weights. Here a unit is a block
// of one group's outputs: each 4 weight rows of that group are read from memory once and
// multiplied against every one of the group's rows while they sit in L1 (row_blocks.h, the
// row products' micro-kernel; 16-bit weights widened in registers as they are loaded, or once
// per block for a group of many rows); groups without rows are never read.
//
// Experts kept in blocks (etjax/model/quantized.py, weights="stored" or "int8") run the
// block products' engine (block_rows.h) on each group's own weight: its blocks read once for
// all the group's rows and dequantized in registers, exactly as a projection's are.
//
//   x [R, K] f32 sorted by group, group_sizes [E] s32 -> out [R, N] f32, and the weights
//   either floats: w [E, N, K] f32 | f16 | bf16 (output-major, as the model keeps its
//     experts), scales and offsets empty; K a multiple of 16, N of 4;
//   or blocks (pallas_kernels/block_products/formats.py, each expert's as a projection's):
//     w s8 [E, N, K] | u8 [E, N, K / 2], scales f16 | f32 [E, N, K / block], offsets of
//     their type and shape or empty; K a multiple of 32, the block of the lanes (32 for 4
//     bits), N of 4.
//
// Group e takes the group_sizes[e] rows after those of groups 0..e-1; rows past the sum are
// in no group and come out zero (ragged_dot's result for them). Each output is one float32
// sum over K in a fixed order, the same for a row whatever rows share its group (for blocks:
// up to 32 rows in its group, as block_products.cc says).

#include <functional>
#include <memory>
#include <vector>

// As in block_products.cc, whose engine block_rows.h holds: without associative math, or GCC
// would neither inline it here nor keep its sums in one order.
#pragma GCC optimize("no-associative-math")

#include "block_rows.h"
#include "kernel_math.h"
#include "row_blocks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace etjax_cpu;  // NOLINT: this file's own helpers

namespace {

// Blocks of 4 weight rows per unit, as in row_products.cc: 32 outputs of one group.
constexpr int64_t kBlocksPerUnit = 8;

struct Grouped {
  const float* x;
  const void* w;
  float* out;
  int64_t in, outs, units_per_group;
  // The groups with rows: their index, first row and row count.
  std::vector<int64_t> group, first, rows;
};

// A group of more rows than this widens its 16-bit weights once, a block at a time into a
// float32 scratch that stays in L1, rather than in registers once per 4 rows: at 64 rows a
// group (a prompt chunk's) ran 4-6% faster so, at 32 rows 4-5% slower, and at the 1-2 rows
// of a decode step's groups 1.6x slower (single thread, 8 experts of D 1024, M 512, and
// Qwen3-30B-A3B's layer; 2026-12-05).
constexpr int64_t kWidenOnceRows = 32;

// One unit: blocks [first, last) of the outputs of the unit / units_per_group'th group with
// rows.
template <typename W>
void run_float_unit(const Grouped& p, int64_t unit) {
  const int64_t g = unit / p.units_per_group, chunk = unit % p.units_per_group;
  const int64_t blocks = p.outs / kOutStep;
  const int64_t first = chunk * kBlocksPerUnit, last = std::min(blocks, first + kBlocksPerUnit);
  const W* weights = static_cast<const W*>(p.w) + p.group[g] * p.outs * p.in;
  const float* x = p.x + p.first[g] * p.in;
  float* out = p.out + p.first[g] * p.outs;
  const bool widen_once = !std::is_same_v<W, float> && p.rows[g] > kWidenOnceRows;
  std::vector<float> scratch(widen_once ? kOutStep * p.in : 0);
  for (int64_t b = first; b < last; ++b) {
    const W* w = weights + b * kOutStep * p.in;
    if (widen_once)
      all_rows_by_group(x, p.rows[g], as_float(w, kOutStep * p.in, scratch.data()), p.in,
                        out + b * kOutStep, p.outs);
    else
      all_rows_by_group(x, p.rows[g], w, p.in, out + b * kOutStep, p.outs);
  }
}

// One unit of experts kept in blocks: run_unit's `chunk`'th 32 outputs of the group's own
// weight, against the group's rows (block_rows.h).
struct GroupedBlocks {
  Product base;  // x, out, the sizes; the weight arrays of expert 0
  UnitRunner runner;
  int64_t units_per_group, quant_bytes, scale_bytes;  // bytes of one expert's arrays
  std::vector<int64_t> group, first, rows;
};

void run_block_unit(const GroupedBlocks& p, int64_t unit) {
  const int64_t g = unit / p.units_per_group, e = p.group[g];
  Product one = p.base;
  one.x += p.first[g] * one.in;
  one.out += p.first[g] * one.outs;
  one.rows = p.rows[g];
  one.quants = static_cast<const uint8_t*>(one.quants) + e * p.quant_bytes;
  one.scales = static_cast<const uint8_t*>(one.scales) + e * p.scale_bytes;
  if (one.offsets) one.offsets = static_cast<const uint8_t*>(one.offsets) + e * p.scale_bytes;
  p.runner(one, unit % p.units_per_group);
}

// The groups with rows (index, first row, row count) of `total` rows; returns the rows in
// groups. The sizes are read where they lie (a CPU buffer); a negative size counts as empty
// and rows past R are never read, whatever the sizes sum to.
int64_t groups_with_rows(const int32_t* sizes, int64_t count, int64_t total,
                         std::vector<int64_t>& group, std::vector<int64_t>& first,
                         std::vector<int64_t>& rows) {
  int64_t start = 0;
  for (int64_t e = 0; e < count && start < total; ++e) {
    const int64_t n = std::min<int64_t>(std::max(sizes[e], 0), total - start);
    if (n == 0) continue;
    group.push_back(e);
    first.push_back(start);
    rows.push_back(n);
    start += n;
  }
  return start;
}

ffi::Error FloatGroups(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                       ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> out) {
  const auto x_dims = x.dimensions(), w_dims = w.dimensions();
  if (x_dims[1] != w_dims[2])
    return ffi::Error::InvalidArgument(
        "grouped products: expected x [R, K], w [E, N, K] and group_sizes [E]");
  const int64_t total = x_dims[0], in = x_dims[1], outs = w_dims[1];
  if (in % 16 || outs % kOutStep)
    return ffi::Error::InvalidArgument("grouped products: K must be a multiple of 16, N of 4");
  auto p = std::make_shared<Grouped>();
  p->x = x.typed_data();
  p->w = w.untyped_data();
  p->out = out->typed_data();
  p->in = in;
  p->outs = outs;
  p->units_per_group = (outs / kOutStep + kBlocksPerUnit - 1) / kBlocksPerUnit;
  const int64_t start =
      groups_with_rows(group_sizes.typed_data(), w_dims[0], total, p->group, p->first, p->rows);
  std::memset(p->out + start * outs, 0, (total - start) * outs * sizeof(float));
  const int64_t units = static_cast<int64_t>(p->group.size()) * p->units_per_group;
  if (units == 0) return ffi::Error::Success();
  std::function<void(int64_t)> body;
  switch (w.element_type()) {
    case ffi::DataType::F32:
      body = [p](int64_t u) { run_float_unit<float>(*p, u); };
      break;
    case ffi::DataType::F16:
      body = [p](int64_t u) { run_float_unit<_Float16>(*p, u); };
      break;
    case ffi::DataType::BF16:
      body = [p](int64_t u) { run_float_unit<BFloat16>(*p, u); };
      break;
    default:
      return ffi::Error::InvalidArgument(
          "grouped products: weights must be f32, f16 or bf16, or s8 or u8 blocks");
  }
  run_units(std::make_shared<std::function<void(int64_t)>>(std::move(body)), units, pool);
  return ffi::Error::Success();
}

ffi::Error BlockGroups(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer quants,
                       ffi::AnyBuffer scales, ffi::AnyBuffer offsets,
                       ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> out) {
  const auto x_dims = x.dimensions(), q_dims = quants.dimensions(), s_dims = scales.dimensions();
  const int bits = quants.element_type() == ffi::DataType::S8 ? 8 : 4;
  const int64_t total = x_dims[0], in = x_dims[1], outs = q_dims[1];
  if (s_dims.size() != 3 || q_dims[2] * (bits == 4 ? 2 : 1) != in || s_dims[0] != q_dims[0] ||
      s_dims[1] != outs || s_dims[2] <= 0 || in % s_dims[2])
    return ffi::Error::InvalidArgument(
        "grouped products: blocks must be quants [E, N, K or K / 2] and scales [E, N, blocks]");
  const int64_t block = in / s_dims[2];
  if (in % kNibbleBlock || block % (bits == 4 ? kNibbleBlock : kLanes) || outs % kOutStep)
    return ffi::Error::InvalidArgument(
        "grouped products: K must be a multiple of 32, the block of the lanes, N of 4");
  if (scales.element_type() != ffi::DataType::F32 && scales.element_type() != ffi::DataType::F16)
    return ffi::Error::InvalidArgument("grouped products: scales must be f16 or f32");
  const bool has_offsets = offsets.element_count() > 0;
  if (has_offsets && (bits != 4 || offsets.element_type() != scales.element_type() ||
                      offsets.element_count() != scales.element_count()))
    return ffi::Error::InvalidArgument("grouped products: offsets must match the 4-bit scales");
  const bool f16 = scales.element_type() == ffi::DataType::F16;
  auto p = std::make_shared<GroupedBlocks>();
  p->base = Product{x.typed_data(), quants.untyped_data(), scales.untyped_data(),
                    has_offsets ? offsets.untyped_data() : nullptr, out->typed_data(), 0, in,
                    outs, block};
  p->runner = unit_runner(bits, has_offsets, f16);
  p->units_per_group = (outs / kOutStep + kGroupsPerUnit - 1) / kGroupsPerUnit;
  p->quant_bytes = outs * q_dims[2];
  p->scale_bytes = outs * s_dims[2] * (f16 ? 2 : 4);
  const int64_t start =
      groups_with_rows(group_sizes.typed_data(), q_dims[0], total, p->group, p->first, p->rows);
  std::memset(p->base.out + start * outs, 0, (total - start) * outs * sizeof(float));
  const int64_t units = static_cast<int64_t>(p->group.size()) * p->units_per_group;
  if (units == 0) return ffi::Error::Success();
  run_units(std::make_shared<std::function<void(int64_t)>>(
                [p](int64_t u) { run_block_unit(*p, u); }),
            units, pool);
  return ffi::Error::Success();
}

ffi::Error GroupedProductsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                               ffi::AnyBuffer scales, ffi::AnyBuffer offsets,
                               ffi::Buffer<ffi::S32> group_sizes,
                               ffi::ResultBuffer<ffi::F32> out) {
  const auto x_dims = x.dimensions(), w_dims = w.dimensions();
  const auto s_dims = group_sizes.dimensions();
  if (x_dims.size() != 2 || w_dims.size() != 3 || s_dims.size() != 1 || s_dims[0] != w_dims[0])
    return ffi::Error::InvalidArgument(
        "grouped products: expected x [R, K], w [E, N, K] and group_sizes [E]");
  const bool blocks =
      w.element_type() == ffi::DataType::S8 || w.element_type() == ffi::DataType::U8;
  if (!blocks && scales.element_count() > 0)
    return ffi::Error::InvalidArgument("grouped products: float weights take no scales");
  if (blocks) return BlockGroups(pool, x, w, scales, offsets, group_sizes, out);
  return FloatGroups(pool, x, w, group_sizes, out);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EtjaxGroupedProductsCpu, GroupedProductsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::AnyBuffer>()         // w, or quants
                                  .Arg<ffi::AnyBuffer>()         // scales, or empty
                                  .Arg<ffi::AnyBuffer>()         // offsets, or empty
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
);
