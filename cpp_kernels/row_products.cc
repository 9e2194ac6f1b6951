// A projection of a few rows, out = x @ w.T with w stored output-major [N, K] as the model
// keeps it: an XLA FFI custom call for CPUs that reads each weight once for all the rows.
//
// A decode step multiplies 1-32 rows by every weight of the model. At one row XLA:CPU's
// product (YNNPACK) streams the weights at the machine's bandwidth; at 8 rows it packs
// the weight into its own layout first, which reads and writes it again, and streams at
// half the speed (docs/PERF.md, "step_floor": a batch-8 step's products cost twice a
// batch-1 step's; SmolLM2's LM head, [49152, 576], 5 ms for one row and 14 for eight).
// Here a unit is a block of outputs: each group of 4 weight rows is read from memory once,
// and every block of up to kRowBlock input rows (4 with AVX-512, 2 with AVX2) is multiplied
// against it while it sits in L1, a register's lanes at a time (row_blocks.h). So the cost is
// the weights' read up to a few dozen rows; wider products (prompt chunks) stay with XLA,
// whose blocked products are compute-bound there.
//
//   x [M, K] f32, w [N, K] f32 | f16 | bf16 -> out [M, N] f32; K a multiple of 16.
//
// Each output is one float32 sum over K in a fixed order (kLanes lanes, then the lanes
// added pairwise), the same for a row whatever M is, so a row's product does not depend on the
// rows beside it or on how many there are.

#include <functional>
#include <memory>

#include "kernel_math.h"
#include "row_blocks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace etjax_cpu;  // NOLINT: this file's own helpers

namespace {

// Output groups of a unit: enough per unit that the atomic counter is not the cost, few
// enough that small projections (N = 192) still give every thread work.
constexpr int64_t kGroupsPerUnit = 8;

struct Product {
  const float* x;
  const void* w;
  float* out;
  int64_t rows, in, outs;
};

// One unit: output groups [first, last). 16-bit weights are widened as the micro-kernel
// loads them (row_blocks.h).
template <typename W>
void run_unit(const Product& p, int64_t unit) {
  const int64_t groups = p.outs / kOutStep;
  const int64_t first = unit * kGroupsPerUnit, last = std::min(groups, first + kGroupsPerUnit);
  for (int64_t g = first; g < last; ++g) {
    const W* w = static_cast<const W*>(p.w) + g * kOutStep * p.in;
    all_rows_by_group(p.x, p.rows, w, p.in, p.out + g * kOutStep, p.outs);
  }
}

ffi::Error RowProductsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                           ffi::ResultBuffer<ffi::F32> out) {
  const auto x_dims = x.dimensions(), w_dims = w.dimensions();
  if (x_dims.size() != 2 || w_dims.size() != 2 || x_dims[1] != w_dims[1])
    return ffi::Error::InvalidArgument("row products: expected x [M, K] and w [N, K]");
  auto product = std::make_shared<Product>(
      Product{x.typed_data(), w.untyped_data(), out->typed_data(), x_dims[0], x_dims[1],
              w_dims[0]});
  if (product->in % 16 || product->outs % kOutStep)
    return ffi::Error::InvalidArgument("row products: K must be a multiple of 16, N of 4");
  const int64_t groups = product->outs / kOutStep;
  const int64_t units = (groups + kGroupsPerUnit - 1) / kGroupsPerUnit;
  std::function<void(int64_t)> body;
  switch (w.element_type()) {
    case ffi::DataType::F32:
      body = [product](int64_t u) { run_unit<float>(*product, u); };
      break;
    case ffi::DataType::F16:
      body = [product](int64_t u) { run_unit<_Float16>(*product, u); };
      break;
    case ffi::DataType::BF16:
      body = [product](int64_t u) { run_unit<BFloat16>(*product, u); };
      break;
    default:
      return ffi::Error::InvalidArgument("row products: weights must be f32, f16 or bf16");
  }
  run_units(std::make_shared<std::function<void(int64_t)>>(std::move(body)), units, pool);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EtjaxRowProductsCpu, RowProductsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::AnyBuffer>()         // w
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
);
