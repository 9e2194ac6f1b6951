// The kept blocks of pruned decode on CPUs (pallas_kernels/block_selection's `select_blocks_xla`,
// whose rule this follows exactly): per row and selection (one per KV head, or one for all),
// the sinks and the recent window first, then blocks that drew at least the mass threshold
// when last read, then the highest page scores; ties go to the lower block, as `lax.top_k`
// breaks them. XLA:CPU's top-k sorts each row's whole table; here a partial sort takes the
// few kept.
//
//   scores [B, S, P] f32, num_blocks [B] i32, budget [B] i32, sink_blocks, recent_blocks [] i32,
//   mass_threshold [] f32, last_mass [B, S, P] f32 (read only when the attribute ranks_by_mass
//   is 1); attribute max_kept.
// Results: kept [B, S, max_kept] i32 (the first counts valid, the rest repeat the first) and
//   counts [B, S] i32 = min(budget, num_blocks, max_kept).

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <vector>

#include "kernel_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace etjax_cpu;  // NOLINT: this file's own helpers

namespace {

// Added to the score of a recently hot block (block_selection/xla.py's RECENTLY_HOT).
constexpr float kRecentlyHot = 1e6f;

struct Problem {
  const float* scores;
  const int32_t* num_blocks;
  const int32_t* budget;
  const float* last_mass;  // null: rank by the scores alone
  int64_t selections, width, max_kept, sink_blocks, recent_blocks;
  float mass_threshold;
  int32_t* kept;
  int32_t* counts;
};

void select_row(const Problem& p, int64_t unit) {
  const int64_t b = unit / p.selections;
  const int64_t n = p.num_blocks[b], width = p.width;
  const float* scores = p.scores + unit * width;
  const float* mass = p.last_mass == nullptr ? nullptr : p.last_mass + unit * width;
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> ranked(width);
  for (int64_t block = 0; block < width; ++block) {
    const bool forced =
        block < p.sink_blocks || (block >= n - p.recent_blocks && block < n);
    float score = scores[block];
    if (mass != nullptr && mass[block] >= p.mass_threshold) score += kRecentlyHot;
    ranked[block] = forced ? inf : (block < n ? score : -inf);
  }
  const int64_t count = std::max<int64_t>(
      0, std::min({static_cast<int64_t>(p.budget[b]), n, p.max_kept}));
  p.counts[unit] = static_cast<int32_t>(count);
  // Only the kept blocks are ordered (and the best one, which pads the table), not the table.
  const int64_t ordered = std::max<int64_t>(1, std::min(count, width));
  std::vector<int32_t> order(width);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + ordered, order.end(),
                    [&](int32_t a, int32_t c) {
                      return ranked[a] > ranked[c] || (ranked[a] == ranked[c] && a < c);
                    });
  int32_t* kept = p.kept + unit * p.max_kept;
  for (int64_t slot = 0; slot < p.max_kept; ++slot)
    kept[slot] = order[slot < count && slot < width ? slot : 0];
}

ffi::Error SelectBlocksImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> scores,
                            ffi::Buffer<ffi::S32> num_blocks, ffi::Buffer<ffi::S32> budget,
                            ffi::Buffer<ffi::S32> sink_blocks, ffi::Buffer<ffi::S32> recent_blocks,
                            ffi::Buffer<ffi::F32> mass_threshold, ffi::Buffer<ffi::F32> last_mass,
                            int32_t ranks_by_mass, int32_t max_kept,
                            ffi::ResultBuffer<ffi::S32> kept, ffi::ResultBuffer<ffi::S32> counts) {
  const auto dims = scores.dimensions();
  if (dims.size() != 3 || max_kept < 1)
    return ffi::Error::InvalidArgument("block selection: scores must be [B, S, P], max_kept >= 1");
  auto problem = std::make_shared<Problem>();
  Problem& p = *problem;
  p.selections = dims[1];
  p.width = dims[2];
  p.max_kept = max_kept;
  p.scores = scores.typed_data();
  p.num_blocks = num_blocks.typed_data();
  p.budget = budget.typed_data();
  p.sink_blocks = sink_blocks.typed_data()[0];
  p.recent_blocks = recent_blocks.typed_data()[0];
  p.mass_threshold = mass_threshold.typed_data()[0];
  if (ranks_by_mass) {
    if (last_mass.element_count() != scores.element_count())
      return ffi::Error::InvalidArgument("block selection: last_mass must be shaped as scores");
    p.last_mass = last_mass.typed_data();
  } else {
    p.last_mass = nullptr;
  }
  p.kept = kept->typed_data();
  p.counts = counts->typed_data();
  auto run = std::make_shared<std::function<void(int64_t)>>(
      [problem](int64_t unit) { select_row(*problem, unit); });
  run_units(run, dims[0] * p.selections, pool);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EtjaxSelectBlocksCpu, SelectBlocksImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scores
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_blocks
                                  .Arg<ffi::Buffer<ffi::S32>>()  // budget
                                  .Arg<ffi::Buffer<ffi::S32>>()  // sink_blocks
                                  .Arg<ffi::Buffer<ffi::S32>>()  // recent_blocks
                                  .Arg<ffi::Buffer<ffi::F32>>()  // mass_threshold
                                  .Arg<ffi::Buffer<ffi::F32>>()  // last_mass
                                  .Attr<int32_t>("ranks_by_mass")
                                  .Attr<int32_t>("max_kept")
                                  .Ret<ffi::Buffer<ffi::S32>>()  // kept
                                  .Ret<ffi::Buffer<ffi::S32>>()  // counts
);
