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
//   x [R, K] f32 sorted by group, w [E, N, K] f32 | f16 | bf16 (output-major, as the model
//   keeps its experts), group_sizes [E] s32 -> out [R, N] f32; K a multiple of 16, N of 4.
//
// Group e takes the group_sizes[e] rows after those of groups 0..e-1; rows past the sum are
// in no group and come out zero (ragged_dot's result for them). Each output is one float32
// sum over K in a fixed order, the same for a row whatever rows share its group.

#include <functional>
#include <memory>
#include <vector>

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
void run_unit(const Grouped& p, int64_t unit) {
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

ffi::Error GroupedProductsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                               ffi::Buffer<ffi::S32> group_sizes,
                               ffi::ResultBuffer<ffi::F32> out) {
  const auto x_dims = x.dimensions(), w_dims = w.dimensions();
  const auto s_dims = group_sizes.dimensions();
  if (x_dims.size() != 2 || w_dims.size() != 3 || s_dims.size() != 1 ||
      x_dims[1] != w_dims[2] || s_dims[0] != w_dims[0])
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
  // The sizes are read where they lie (a CPU buffer); a negative size counts as empty and
  // rows past R are never read, whatever the sizes sum to.
  const int32_t* sizes = group_sizes.typed_data();
  int64_t start = 0;
  for (int64_t e = 0; e < s_dims[0] && start < total; ++e) {
    const int64_t rows = std::min<int64_t>(std::max(sizes[e], 0), total - start);
    if (rows == 0) continue;
    p->group.push_back(e);
    p->first.push_back(start);
    p->rows.push_back(rows);
    start += rows;
  }
  std::memset(p->out + start * outs, 0, (total - start) * outs * sizeof(float));
  const int64_t units = static_cast<int64_t>(p->group.size()) * p->units_per_group;
  if (units == 0) return ffi::Error::Success();
  std::function<void(int64_t)> body;
  switch (w.element_type()) {
    case ffi::DataType::F32:
      body = [p](int64_t u) { run_unit<float>(*p, u); };
      break;
    case ffi::DataType::F16:
      body = [p](int64_t u) { run_unit<_Float16>(*p, u); };
      break;
    case ffi::DataType::BF16:
      body = [p](int64_t u) { run_unit<BFloat16>(*p, u); };
      break;
    default:
      return ffi::Error::InvalidArgument("grouped products: weights must be f32, f16 or bf16");
  }
  run_units(std::make_shared<std::function<void(int64_t)>>(std::move(body)), units, pool);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EtjaxGroupedProductsCpu, GroupedProductsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::AnyBuffer>()         // w
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
);
