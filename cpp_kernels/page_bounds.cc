// Quest page bounds for pruned decode on CPUs (pallas_kernels/page_scores: reference.py's
// `block_upper_bounds`, looped over a row's pages as xla.py's `score_pages_xla` loops):
// for each row, KV head and page of the row, the largest scaled q.k that the page's
// per-dimension key bounds allow, the maximum over the query heads of the group (and over the
// KV heads when one selection serves them all). The XLA loop gathers every page's bounds into
// a copy first; here they are read where they lie.
//
//   q [B, H, hd] f32 (not yet scaled), k_min, k_max [N, KVH, hd] f32, page_table [B, P] i32,
//   num_blocks [B] i32; attributes scale (head_dim ** -0.5), shared (1: one score per page
//   for every KV head).
// Result: scores [B, S, P] f32, S = 1 when shared else KVH; -inf past a row's num_blocks.

#include <cmath>
#include <functional>
#include <limits>
#include <memory>

#include "kernel_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace etjax_cpu;  // NOLINT: this file's own helpers

namespace {

// Pages of one row a unit scores: long rows split across threads.
constexpr int64_t kPagesPerUnit = 64;

struct Problem {
  const float* q;
  const float* k_min;
  const float* k_max;
  const int32_t* page_table;
  const int32_t* num_blocks;
  int64_t rows, num_heads, head_dim, num_pages, kv_heads, table_width, units_per_row;
  float scale;
  bool shared;
  float* scores;
};

void score_pages(const Problem& p, int64_t unit) {
  const int64_t b = unit / p.units_per_row, first = (unit % p.units_per_row) * kPagesPerUnit;
  const int64_t hd = p.head_dim, group = p.num_heads / p.kv_heads;
  const int64_t selections = p.shared ? 1 : p.kv_heads;
  const int64_t blocks = std::clamp<int64_t>(p.num_blocks[b], 0, p.table_width);
  const int64_t last = std::min(first + kPagesPerUnit, p.table_width);
  const float* q = p.q + b * p.num_heads * hd;
  for (int64_t column = first; column < last; ++column) {
    const int64_t page = p.page_table[b * p.table_width + column];
    const bool scored = column < blocks && page >= 0 && page < p.num_pages;
    float shared_best = -std::numeric_limits<float>::infinity();
    for (int64_t h = 0; h < p.kv_heads; ++h) {
      float best = -std::numeric_limits<float>::infinity();
      if (scored) {
        const float* lo = p.k_min + (page * p.kv_heads + h) * hd;
        const float* hi = p.k_max + (page * p.kv_heads + h) * hd;
        for (int64_t g = 0; g < group; ++g) {
          const float* query = q + (h * group + g) * hd;
          float bound = 0.0f;
          for (int64_t d = 0; d < hd; ++d)
            bound += std::max(query[d] * lo[d], query[d] * hi[d]);
          best = std::max(best, bound * p.scale);
        }
      }
      if (p.shared) {
        shared_best = std::max(shared_best, best);
      } else {
        p.scores[(b * selections + h) * p.table_width + column] = best;
      }
    }
    if (p.shared) p.scores[b * p.table_width + column] = shared_best;
  }
}

ffi::Error PageBoundsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                          ffi::Buffer<ffi::F32> k_min, ffi::Buffer<ffi::F32> k_max,
                          ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> num_blocks,
                          float scale, int32_t shared, ffi::ResultBuffer<ffi::F32> scores) {
  const auto q_dims = q.dimensions(), bound_dims = k_min.dimensions();
  const auto table_dims = page_table.dimensions();
  if (q_dims.size() != 3 || bound_dims.size() != 3 || table_dims.size() != 2)
    return ffi::Error::InvalidArgument("page bounds: unexpected ranks");
  auto problem = std::make_shared<Problem>();
  Problem& p = *problem;
  p.rows = q_dims[0];
  p.num_heads = q_dims[1];
  p.head_dim = q_dims[2];
  p.num_pages = bound_dims[0];
  p.kv_heads = bound_dims[1];
  p.table_width = table_dims[1];
  if (bound_dims[2] != p.head_dim || p.num_heads % p.kv_heads)
    return ffi::Error::InvalidArgument("page bounds: head shapes do not match");
  p.q = q.typed_data();
  p.k_min = k_min.typed_data();
  p.k_max = k_max.typed_data();
  p.page_table = page_table.typed_data();
  p.num_blocks = num_blocks.typed_data();
  p.scale = scale;
  p.shared = shared != 0;
  p.scores = scores->typed_data();
  p.units_per_row = std::max<int64_t>(1, (p.table_width + kPagesPerUnit - 1) / kPagesPerUnit);
  auto run = std::make_shared<std::function<void(int64_t)>>(
      [problem](int64_t unit) { score_pages(*problem, unit); });
  run_units(run, p.rows * p.units_per_row, pool);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EtjaxPageBoundsCpu, PageBoundsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_min
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_max
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_table
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_blocks
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("shared")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // scores
);
