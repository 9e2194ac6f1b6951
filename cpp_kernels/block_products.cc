// Products of float32 rows by quantized weights, out = x @ w.T with w [N, K] kept in blocks
// (pallas_kernels/block_products/formats.py): an XLA FFI custom call for CPUs that reads each
// weight block once for all the rows of a step and dequantizes it in registers.
//
// A decode step is the read of every weight of the model; kept in 4 or 8 bits the read is
// 6.4 or 3.8 times smaller than in float32. The kernel is row_products.cc's with the
// weights dequantized as they are loaded: each group of 4 weight rows kLanes values at a
// time (8 bits: bytes to int32 lanes to float32, times the block's scale; 4 bits: a permute
// of nibbles into the block's table of its 16 values) and multiplied against a block of up
// to kRowBlock input rows (row_blocks.h). With AVX-512, up to 8 rows (a batch-8 decode
// step) take the group's weight rows two at a time against all the rows, each weight
// dequantized once in registers (rows_by_pair). With more rows the group is
// dequantized once into an L1 scratch and every block of rows multiplied against that, so
// the dequantization is paid once per weight, not once per block of rows; past kPanelRows
// (prompt chunks) 32 outputs at a time are dequantized, laid out input-major and multiplied
// in a matrix product's register tiles, which beat XLA's float32 product there. All of it is
// block_rows.h's (which the grouped products' kernel shares); this file is its FFI handler.
//
//   x [M, K] f32, quants s8 [N, K] (8 bits) | u8 [N, K / 2] (4 bits, GGUF's nibble order),
//   scales f16 | f32 [N, K / block], offsets of the same type and shape, or empty (8 bits:
//   none; 4 bits: the value is scale * (q - 8)) -> out [M, N] f32. K a multiple of 32, block
//   of kLanes (32 for 4 bits), N of 4.
//
// A weight is scale * q + offset rounded once to float32 (a fused multiply-add) whichever
// path computed it, and up to kPanelRows rows each output is one float32 sum over K in
// row_blocks.h's fixed order, so a row's product does not depend on the rows beside it or on
// how many there are (past it, on the tiles' order: as XLA's products do).

#include <functional>
#include <memory>
#include <vector>

// The library is built with -fassociative-math (build.py), which lets GCC regroup the two
// registers of 4-bit values added into one accumulator; then a row's sums would differ
// between the paths. The sums here are written in vector lanes already and need no licence.
#pragma GCC optimize("no-associative-math")

#include "block_rows.h"
#include "kernel_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace etjax_cpu;  // NOLINT: this file's own helpers

namespace {

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
  if (scales.element_type() != ffi::DataType::F32 && scales.element_type() != ffi::DataType::F16)
    return ffi::Error::InvalidArgument("block products: scales must be f16 or f32");
  const bool f16 = scales.element_type() == ffi::DataType::F16;
  const UnitRunner runner = unit_runner(bits, has_offsets, f16);
  std::function<void(int64_t)> run = [product, runner](int64_t u) { runner(*product, u); };
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
