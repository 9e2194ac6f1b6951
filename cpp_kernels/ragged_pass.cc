// One pass of ragged paged attention, reading the KV pages where they lie: an XLA FFI custom
// call for CPUs. This file runs narrow tiles (a decode row, a few draft tokens, the rows of a
// cascade's shared tile); wide ones (prompt chunks) run wide_tiles.h's units.
//
// XLA:CPU has no gather that feeds a product, so its pass (xla.py) copies every trip's pages
// into product order first, at 5-18 GB/s, and that copy is most of a long-context decode step
// (docs/PERF.md, "step_floor"). Here each (tile, KV head) walks its items' pages in place: a
// page's [page_size, head_dim] tile of one KV head is contiguous in the pool, its keys are
// scored against the tile's queries (every query head of the group), and the values are
// folded into an online softmax, page by page. Pages no query of the tile can see yet (the
// rest of a burst's plan, keys outside a sliding window) are never read.
//
// The arguments are the XLA pass's (work_items.TilePass), so the two are interchangeable:
//   q [T, H, hd] f32 (not yet scaled), k_pages, v_pages [N, KVH, ps, hd] f32 | f16 | bf16,
//   q_positions [T] i32, tile_tokens [Nq, Qt] i32 (T or more: padding), item_tile [W] i32,
//   item_pages [W, Kt] i32, item_key_start [W] i32, num_items [] i32, window [] i32;
//   attributes softcap (0: none) and scale (head_dim ** -0.5).
// Results: out [Nq, Qt, H, hd] f32 and lse [Nq, Qt, H] f32 (-1e30 where a query saw nothing).
//
// Narrow tiles' work is split into units of (tile, KV head, up to kItemsPerUnit of the tile's
// items), taken from an atomic counter by the calling thread and by helpers on XLA's intra-op
// thread pool; each unit leaves a partial softmax, and the partials of a (tile, KV head) are
// merged by their maxima at the end. The caller never waits for a unit nobody has claimed, so
// a helper that starts late finds nothing left and returns.

#include <functional>
#include <memory>
#include <vector>

#include "kernel_math.h"
#include "ragged_pass.h"
#include "wide_tiles.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace etjax_cpu;  // NOLINT: this file's own helpers

namespace {

// Items of one tile a unit takes (an item is Kt pages): long rows split into several units,
// so one row over a long context still uses every thread.
constexpr int kItemsPerUnit = 8;

template <typename T>
void run_unit(Pass& pass, int64_t unit_index) {
  const Pass::Unit& unit = pass.units[unit_index];
  const int64_t hd = pass.head_dim, ps = pass.page_size, kt = pass.items_per_page_list;
  const int64_t group = pass.num_heads / pass.kv_heads, qt = pass.tile_size;
  const int64_t rows = qt * group;
  float* best = pass.best.data() + unit_index * rows;
  float* norm = pass.norm.data() + unit_index * rows;
  float* acc = pass.acc.data() + unit_index * rows * hd;
  std::fill(best, best + rows, kMasked);
  std::fill(norm, norm + rows, 0.0f);
  std::fill(acc, acc + rows * hd, 0.0f);

  // The tile's real tokens: their scaled queries and the key range each sees.
  const int32_t* tokens = pass.tile_tokens + unit.tile * qt;
  std::vector<float> queries(rows * hd);
  std::vector<int64_t> lowest(qt), highest(qt);
  int64_t tile_low = INT64_MAX, tile_high = -1;
  for (int64_t r = 0; r < qt; ++r) {
    const int32_t token = tokens[r];
    lowest[r] = 0;
    highest[r] = -1;  // sees nothing
    if (token < 0 || token >= pass.num_tokens) continue;
    const int64_t position = pass.q_positions[token];
    highest[r] = position;
    if (pass.window > 0) lowest[r] = std::max<int64_t>(position - pass.window + 1, 0);
    if (highest[r] < lowest[r]) continue;
    tile_low = std::min(tile_low, lowest[r]);
    tile_high = std::max(tile_high, highest[r]);
    for (int64_t g = 0; g < group; ++g) {
      const float* src = pass.q + (token * pass.num_heads + unit.kv_head * group + g) * hd;
      float* dst = queries.data() + (r * group + g) * hd;
      for (int64_t d = 0; d < hd; ++d) dst[d] = src[d] * pass.scale;
    }
  }
  if (tile_high < 0) return;

  const T* k_pool = static_cast<const T*>(pass.k);
  const T* v_pool = static_cast<const T*>(pass.v);
  std::vector<float> k_scratch(ps * hd), v_scratch(ps * hd), scores(ps);
  for (int32_t i = unit.item_begin; i < unit.item_end; ++i) {
    const int32_t item = pass.order[i];
    for (int64_t p = 0; p < kt; ++p) {
      const int64_t key0 = pass.item_key_start[item] + p * ps;
      if (key0 > tile_high || key0 + ps - 1 < tile_low) continue;  // no query sees this page
      const int64_t page = pass.item_pages[item * kt + p];
      if (page < 0 || page >= pass.num_pages) continue;
      const int64_t offset = (page * pass.kv_heads + unit.kv_head) * ps * hd;
      const float* keys = as_float<T>(k_pool + offset, ps * hd, k_scratch.data());
      const float* values = as_float<T>(v_pool + offset, ps * hd, v_scratch.data());
      for (int64_t r = 0; r < qt; ++r) {
        const int64_t from = std::max(lowest[r] - key0, int64_t{0});
        const int64_t to = std::min(highest[r] - key0 + 1, ps);  // exclusive
        if (from >= to) continue;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t row = r * group + g;
          const float* query = queries.data() + row * hd;
          dots(query, keys + from * hd, to - from, hd, scores.data() + from);
          float page_best = kMasked;
          for (int64_t j = from; j < to; ++j) {
            if (pass.softcap > 0.0f) scores[j] = pass.softcap * std::tanh(scores[j] / pass.softcap);
            page_best = std::max(page_best, scores[j]);
          }
          const float new_best = std::max(best[row], page_best);
          const float rescale = exp_nonpositive(best[row] - new_best);
          float total = 0.0f;
          for (int64_t j = from; j < to; ++j) {
            scores[j] = exp_nonpositive(scores[j] - new_best);
            total += scores[j];
          }
          add_weighted(acc + row * hd, rescale, scores.data(), values, from, to, hd);
          norm[row] = norm[row] * rescale + total;
          best[row] = new_best;
        }
      }
    }
  }
}

// Folds the units of each (tile, KV head) into the outputs.
void merge_units(const Pass& pass, float* out, float* lse) {
  const int64_t hd = pass.head_dim, qt = pass.tile_size;
  const int64_t group = pass.num_heads / pass.kv_heads, rows = qt * group;
  size_t u = 0;
  std::vector<float> total(hd);
  while (u < pass.units.size()) {
    size_t end = u;
    while (end < pass.units.size() && pass.units[end].tile == pass.units[u].tile &&
           pass.units[end].kv_head == pass.units[u].kv_head)
      ++end;
    const int64_t tile = pass.units[u].tile, kv_head = pass.units[u].kv_head;
    for (int64_t row = 0; row < rows; ++row) {
      float top = kMasked;
      for (size_t w = u; w < end; ++w) top = std::max(top, pass.best[w * rows + row]);
      float weight_sum = 0.0f;
      std::fill(total.begin(), total.end(), 0.0f);
      for (size_t w = u; w < end; ++w) {
        if (pass.norm[w * rows + row] <= 0.0f) continue;
        const float scale = std::exp(pass.best[w * rows + row] - top);
        weight_sum += pass.norm[w * rows + row] * scale;
        const float* part = pass.acc.data() + (w * rows + row) * hd;
        for (int64_t d = 0; d < hd; ++d) total[d] += scale * part[d];
      }
      const int64_t r = row / group, head = kv_head * group + row % group;
      const int64_t slot = (tile * qt + r) * pass.num_heads + head;
      float* dst = out + slot * hd;
      if (weight_sum > 0.0f) {
        for (int64_t d = 0; d < hd; ++d) dst[d] = total[d] / weight_sum;
        lse[slot] = top + std::log(weight_sum);
      }
    }
    u = end;
  }
}

// Runs the pass's units: a wide pass's row blocks write their rows' outputs in place, a
// narrow pass's units leave partials for merge_units.
template <typename T>
void run_all(std::shared_ptr<Pass> pass, ffi::ThreadPool& pool, float* out, float* lse) {
  if (!pass->row_blocks.empty()) {
    auto run = std::make_shared<std::function<void(int64_t)>>(
        [pass, out, lse](int64_t block) { run_row_block<T>(*pass, block, out, lse); });
    run_units(run, static_cast<int64_t>(pass->row_blocks.size()), pool);
    return;
  }
  auto run = std::make_shared<std::function<void(int64_t)>>(
      [pass](int64_t unit) { run_unit<T>(*pass, unit); });
  run_units(run, static_cast<int64_t>(pass->units.size()), pool);
}

ffi::Error RaggedPassImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                          ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> q_positions,
                          ffi::Buffer<ffi::S32> tile_tokens, ffi::Buffer<ffi::S32> item_tile,
                          ffi::Buffer<ffi::S32> item_pages, ffi::Buffer<ffi::S32> item_key_start,
                          ffi::Buffer<ffi::S32> num_items, ffi::Buffer<ffi::S32> window,
                          float softcap, float scale, ffi::ResultBuffer<ffi::F32> out,
                          ffi::ResultBuffer<ffi::F32> lse) {
  auto pass = std::make_shared<Pass>();
  const auto q_dims = q.dimensions(), k_dims = k_pages.dimensions();
  const auto tile_dims = tile_tokens.dimensions(), page_dims = item_pages.dimensions();
  if (q_dims.size() != 3 || k_dims.size() != 4 || tile_dims.size() != 2 || page_dims.size() != 2)
    return ffi::Error::InvalidArgument("ragged pass: unexpected ranks");
  if (k_pages.element_type() != v_pages.element_type())
    return ffi::Error::InvalidArgument("ragged pass: keys and values differ in dtype");
  pass->num_tokens = q_dims[0];
  pass->num_heads = q_dims[1];
  pass->head_dim = q_dims[2];
  pass->num_pages = k_dims[0];
  pass->kv_heads = k_dims[1];
  pass->page_size = k_dims[2];
  pass->tiles = tile_dims[0];
  pass->tile_size = tile_dims[1];
  pass->items_per_page_list = page_dims[1];
  if (k_dims[3] != pass->head_dim || pass->head_dim > kMaxHeadDim ||
      pass->num_heads % pass->kv_heads)
    return ffi::Error::InvalidArgument("ragged pass: head shapes do not match");
  pass->q = q.typed_data();
  pass->k = k_pages.untyped_data();
  pass->v = v_pages.untyped_data();
  pass->q_positions = q_positions.typed_data();
  pass->tile_tokens = tile_tokens.typed_data();
  pass->item_pages = item_pages.typed_data();
  pass->item_key_start = item_key_start.typed_data();
  pass->window = window.typed_data()[0];
  pass->softcap = softcap;
  pass->scale = scale;

  // Real items grouped by tile (build_pass lists a tile's items together; this does not
  // rely on it).
  const int64_t capacity = page_dims[0];
  const int64_t real = std::clamp<int64_t>(num_items.typed_data()[0], 0, capacity);
  const int32_t* tile_of = item_tile.typed_data();
  pass->first.assign(pass->tiles + 1, 0);
  for (int64_t i = 0; i < real; ++i) {
    if (tile_of[i] < 0 || tile_of[i] >= pass->tiles)
      return ffi::Error::InvalidArgument("ragged pass: an item names a tile out of range");
    ++pass->first[tile_of[i] + 1];
  }
  for (int64_t j = 0; j < pass->tiles; ++j) pass->first[j + 1] += pass->first[j];
  pass->order.resize(real);
  std::vector<int32_t> fill(pass->first.begin(), pass->first.end() - 1);
  for (int64_t i = 0; i < real; ++i) pass->order[fill[tile_of[i]]++] = static_cast<int32_t>(i);
  float* out_data = out->typed_data();
  float* lse_data = lse->typed_data();
  std::fill(out_data, out_data + out->element_count(), 0.0f);
  std::fill(lse_data, lse_data + lse->element_count(), kMasked);
  const bool wide = runs_wide(*pass);
  if (wide) {
    plan_row_blocks(*pass);
  } else {
    for (int32_t j = 0; j < pass->tiles; ++j)
      for (int32_t h = 0; h < pass->kv_heads; ++h)
        for (int32_t b = pass->first[j]; b < pass->first[j + 1]; b += kItemsPerUnit)
          pass->units.push_back({j, h, b, std::min(b + kItemsPerUnit, pass->first[j + 1])});
    const int64_t rows = pass->tile_size * (pass->num_heads / pass->kv_heads);
    pass->best.resize(pass->units.size() * rows);
    pass->norm.resize(pass->units.size() * rows);
    pass->acc.resize(pass->units.size() * rows * pass->head_dim);
  }
  switch (k_pages.element_type()) {
    case ffi::DataType::F32:
      run_all<float>(pass, pool, out_data, lse_data);
      break;
    case ffi::DataType::F16:
      run_all<_Float16>(pass, pool, out_data, lse_data);
      break;
    case ffi::DataType::BF16:
      run_all<BFloat16>(pass, pool, out_data, lse_data);
      break;
    default:
      return ffi::Error::InvalidArgument("ragged pass: keys must be f32, f16 or bf16");
  }
  if (!wide) merge_units(*pass, out_data, lse_data);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EtjaxRaggedPassCpu, RaggedPassImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k_pages
                                  .Arg<ffi::AnyBuffer>()         // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_positions
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tile_tokens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // item_tile
                                  .Arg<ffi::Buffer<ffi::S32>>()  // item_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // item_key_start
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_items
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window
                                  .Attr<float>("softcap")
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse
);
