// Block-sparse paged decode attention for CPUs (pallas_kernels/block_sparse, one signature for
// every backend): each (row, KV head) reads only its kept pages, where they lie in the pool,
// as an XLA FFI custom call. The XLA backend gathers the kept pages into a copy first, which
// made a pruned step slower than the dense one once dense decode read pages in place
// (ragged_pass.cc).
//
//   q [B, H, hd] f32 (not yet scaled), k_pages, v_pages [N, KVH, ps, hd] f32 | f16 | bf16,
//   page_table [B, P] i32, kept_blocks [B, S, K] i32 (S = 1: one selection for every KV
//   head), kept_counts [B, S] i32, lengths [B] i32; attribute scale (head_dim ** -0.5).
// Results: out [B, H, hd] f32 and block_mass [B, KVH, K] f32, the attention probability each
// kept block drew, averaged over the query heads of the KV head (0 past the count).

#include <functional>
#include <memory>
#include <vector>

#include "kernel_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace etjax_cpu;  // NOLINT: this file's own helpers

namespace {

struct Problem {
  const float* q;
  const void* k;
  const void* v;
  const int32_t* page_table;
  const int32_t* kept_blocks;
  const int32_t* kept_counts;
  const int32_t* lengths;
  int64_t num_heads, head_dim, num_pages, kv_heads, page_size, table_width, selections, kept;
  float scale;
  float* out;
  float* mass;
};

// Row b, KV head h: one unit, its results written straight to the outputs.
template <typename T>
void run_row_head(const Problem& p, int64_t unit) {
  const int64_t b = unit / p.kv_heads, h = unit % p.kv_heads;
  const int64_t hd = p.head_dim, ps = p.page_size, group = p.num_heads / p.kv_heads;
  const int64_t selection = b * p.selections + (p.selections == 1 ? 0 : h);
  const int64_t count = std::clamp<int64_t>(p.kept_counts[selection], 0, p.kept);
  const int64_t length = p.lengths[b];

  std::vector<float> queries(group * hd), acc(group * hd, 0.0f);
  std::vector<float> best(group, kMasked), norm(group, 0.0f), block_lse(group * p.kept, kMasked);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < hd; ++d)
      queries[g * hd + d] = p.q[(b * p.num_heads + h * group + g) * hd + d] * p.scale;

  const T* k_pool = static_cast<const T*>(p.k);
  const T* v_pool = static_cast<const T*>(p.v);
  std::vector<float> k_scratch(ps * hd), v_scratch(ps * hd), weights(ps);
  for (int64_t j = 0; j < count; ++j) {
    const int64_t column = p.kept_blocks[selection * p.kept + j];
    if (column < 0 || column >= p.table_width) continue;
    const int64_t page = p.page_table[b * p.table_width + column];
    const int64_t visible = std::min(ps, length - column * ps);  // keys before the length
    if (page < 0 || page >= p.num_pages || visible <= 0) continue;
    const int64_t offset = (page * p.kv_heads + h) * ps * hd;
    const float* keys = as_float<T>(k_pool + offset, ps * hd, k_scratch.data());
    const float* values = as_float<T>(v_pool + offset, ps * hd, v_scratch.data());
    for (int64_t g = 0; g < group; ++g) {
      const float* query = queries.data() + g * hd;
      if (visible == kLanes && hd % kLanes == 0) {
        store_lanes(weights.data(), dots_of_16_keys(query, keys, hd));
      } else {
        for (int64_t key = 0; key < visible; ++key) weights[key] = dot(query, keys + key * hd, hd);
      }
      float block_best = kMasked;
      for (int64_t key = 0; key < visible; ++key) block_best = std::max(block_best, weights[key]);
      const float new_best = std::max(best[g], block_best);
      const float rescale = exp_nonpositive(best[g] - new_best);
      float block_sum = 0.0f;
      for (int64_t key = 0; key < visible; ++key) {
        weights[key] = exp_nonpositive(weights[key] - new_best);
        block_sum += weights[key];
      }
      // The block's log-sum-exp (its mass once the total is known).
      block_lse[g * p.kept + j] = new_best + std::log(block_sum);
      add_weighted(acc.data() + g * hd, rescale, weights.data(), values, 0, visible, hd);
      norm[g] = norm[g] * rescale + block_sum;
      best[g] = new_best;
    }
  }

  float* mass = p.mass + (b * p.kv_heads + h) * p.kept;
  std::fill(mass, mass + p.kept, 0.0f);
  for (int64_t g = 0; g < group; ++g) {
    float* out = p.out + (b * p.num_heads + h * group + g) * hd;
    if (norm[g] <= 0.0f) {
      std::fill(out, out + hd, 0.0f);
      continue;
    }
    for (int64_t d = 0; d < hd; ++d) out[d] = acc[g * hd + d] / norm[g];
    const float total = best[g] + std::log(norm[g]);
    for (int64_t j = 0; j < count; ++j)
      mass[j] += std::exp(block_lse[g * p.kept + j] - total) / static_cast<float>(group);
  }
}

ffi::Error BlockSparseImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                           ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> page_table,
                           ffi::Buffer<ffi::S32> kept_blocks, ffi::Buffer<ffi::S32> kept_counts,
                           ffi::Buffer<ffi::S32> lengths, float scale,
                           ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> mass) {
  const auto q_dims = q.dimensions(), k_dims = k_pages.dimensions();
  const auto table_dims = page_table.dimensions(), kept_dims = kept_blocks.dimensions();
  if (q_dims.size() != 3 || k_dims.size() != 4 || table_dims.size() != 2 ||
      kept_dims.size() != 3)
    return ffi::Error::InvalidArgument("block-sparse attention: unexpected ranks");
  if (k_pages.element_type() != v_pages.element_type())
    return ffi::Error::InvalidArgument("block-sparse attention: keys and values differ in dtype");
  auto problem = std::make_shared<Problem>();
  Problem& p = *problem;
  p.num_heads = q_dims[1];
  p.head_dim = q_dims[2];
  p.num_pages = k_dims[0];
  p.kv_heads = k_dims[1];
  p.page_size = k_dims[2];
  p.table_width = table_dims[1];
  p.selections = kept_dims[1];
  p.kept = kept_dims[2];
  if (k_dims[3] != p.head_dim || p.num_heads % p.kv_heads ||
      (p.selections != 1 && p.selections != p.kv_heads))
    return ffi::Error::InvalidArgument("block-sparse attention: head shapes do not match");
  p.q = q.typed_data();
  p.k = k_pages.untyped_data();
  p.v = v_pages.untyped_data();
  p.page_table = page_table.typed_data();
  p.kept_blocks = kept_blocks.typed_data();
  p.kept_counts = kept_counts.typed_data();
  p.lengths = lengths.typed_data();
  p.scale = scale;
  p.out = out->typed_data();
  p.mass = mass->typed_data();

  const int64_t units = q_dims[0] * p.kv_heads;
  std::function<void(int64_t)> body;
  switch (k_pages.element_type()) {
    case ffi::DataType::F32:
      body = [problem](int64_t u) { run_row_head<float>(*problem, u); };
      break;
    case ffi::DataType::F16:
      body = [problem](int64_t u) { run_row_head<_Float16>(*problem, u); };
      break;
    case ffi::DataType::BF16:
      body = [problem](int64_t u) { run_row_head<BFloat16>(*problem, u); };
      break;
    default:
      return ffi::Error::InvalidArgument("block-sparse attention: keys must be f32, f16 or bf16");
  }
  run_units(std::make_shared<std::function<void(int64_t)>>(std::move(body)), units, pool);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EtjaxBlockSparseCpu, BlockSparseImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k_pages
                                  .Arg<ffi::AnyBuffer>()         // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_table
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kept_blocks
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kept_counts
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lengths
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // block_mass
);
