// Block-sparse paged decode attention for CPUs (pallas_kernels/block_sparse, one signature for
// every backend): each (row, KV head) reads only its kept pages, where they lie in the pool,
// as an XLA FFI custom call. The XLA backend gathers the kept pages into a copy first, which
// made a pruned step slower than the dense one once dense decode read pages in place
// (ragged_pass.cc).
//
//   q [B, H, hd] f32 (not yet scaled), k_pages, v_pages [N, KVH, ps, hd] f32 | f16 | bf16,
//   page_table [B, P] i32, kept_blocks [B, S, K] i32 (S = 1: one selection for every KV
//   head), kept_counts [B, S] i32, lengths [B] i32, leaders [B] i32, shared_counts [B] i32;
//   attribute scale (head_dim ** -0.5).
// Rows sharing a prefix may be grouped: a row whose leaders entry names another row that leads
// itself is computed with it, and the first shared_counts[leader] kept entries of every row of
// the group must be the same pages; those are read once for the whole group. leaders[b] = b,
// shared_counts[b] = 0 is the plain row. The results do not depend on the grouping.
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
  const int32_t* leaders;
  const int32_t* shared_counts;
  int64_t batch, num_heads, head_dim, num_pages, kv_heads, page_size, table_width, selections,
      kept;
  float scale;
  float* out;
  float* mass;
};

// One row's online softmax for one KV head: its query heads' running maxima, sums and
// weighted values, and each kept block's log-sum-exp (its mass once the total is known).
struct RowState {
  int64_t row, selection, count, length;
  std::vector<float> queries, acc, best, norm, block_lse;

  RowState(const Problem& p, int64_t b, int64_t h)
      : row(b), selection(b * p.selections + (p.selections == 1 ? 0 : h)) {
    const int64_t group = p.num_heads / p.kv_heads, hd = p.head_dim;
    count = std::clamp<int64_t>(p.kept_counts[selection], 0, p.kept);
    length = p.lengths[b];
    queries.resize(group * hd);
    acc.assign(group * hd, 0.0f);
    best.assign(group, kMasked);
    norm.assign(group, 0.0f);
    block_lse.assign(group * p.kept, kMasked);
    for (int64_t g = 0; g < group; ++g)
      for (int64_t d = 0; d < hd; ++d)
        queries[g * hd + d] = p.q[(b * p.num_heads + h * group + g) * hd + d] * p.scale;
  }
};

// Kept entry j of `state`'s row: the column's keys and values (converted to f32 in the
// scratch buffers where stored narrower) and how many of them lie before the row's length;
// visible <= 0 when the entry reads nothing.
template <typename T>
int64_t load_block(const Problem& p, const RowState& state, int64_t h, int64_t j,
                   const float** keys, const float** values, float* k_scratch, float* v_scratch) {
  const int64_t column = p.kept_blocks[state.selection * p.kept + j];
  if (column < 0 || column >= p.table_width) return 0;
  const int64_t page = p.page_table[state.row * p.table_width + column];
  const int64_t ps = p.page_size, hd = p.head_dim;
  const int64_t visible = std::min(ps, state.length - column * ps);  // keys before the length
  if (page < 0 || page >= p.num_pages || visible <= 0) return 0;
  const int64_t offset = (page * p.kv_heads + h) * ps * hd;
  *keys = as_float<T>(static_cast<const T*>(p.k) + offset, ps * hd, k_scratch);
  *values = as_float<T>(static_cast<const T*>(p.v) + offset, ps * hd, v_scratch);
  return visible;
}

// Folds kept block j (its `visible` keys and values) into every query head of `state`.
void absorb(const Problem& p, RowState& state, int64_t j, const float* keys, const float* values,
            int64_t visible, float* weights) {
  const int64_t hd = p.head_dim, group = p.num_heads / p.kv_heads;
  for (int64_t g = 0; g < group; ++g) {
    const float* query = state.queries.data() + g * hd;
    dots(query, keys, visible, hd, weights);
    float block_best = kMasked;
    for (int64_t key = 0; key < visible; ++key) block_best = std::max(block_best, weights[key]);
    const float new_best = std::max(state.best[g], block_best);
    const float rescale = exp_nonpositive(state.best[g] - new_best);
    float block_sum = 0.0f;
    for (int64_t key = 0; key < visible; ++key) {
      weights[key] = exp_nonpositive(weights[key] - new_best);
      block_sum += weights[key];
    }
    state.block_lse[g * p.kept + j] = new_best + std::log(block_sum);
    add_weighted(state.acc.data() + g * hd, rescale, weights, values, 0, visible, hd);
    state.norm[g] = state.norm[g] * rescale + block_sum;
    state.best[g] = new_best;
  }
}

// Writes a finished row's outputs and its kept blocks' mass for KV head h.
void finish(const Problem& p, const RowState& state, int64_t h) {
  const int64_t hd = p.head_dim, group = p.num_heads / p.kv_heads, b = state.row;
  float* mass = p.mass + (b * p.kv_heads + h) * p.kept;
  std::fill(mass, mass + p.kept, 0.0f);
  for (int64_t g = 0; g < group; ++g) {
    float* out = p.out + (b * p.num_heads + h * group + g) * hd;
    if (state.norm[g] <= 0.0f) {
      std::fill(out, out + hd, 0.0f);
      continue;
    }
    for (int64_t d = 0; d < hd; ++d) out[d] = state.acc[g * hd + d] / state.norm[g];
    const float total = state.best[g] + std::log(state.norm[g]);
    for (int64_t j = 0; j < state.count; ++j)
      mass[j] += std::exp(state.block_lse[g * p.kept + j] - total) / static_cast<float>(group);
  }
}

// The row that computes row r: its leader when that names a row leading itself, else r.
int64_t leader_of(const Problem& p, int64_t r) {
  const int64_t l = p.leaders[r];
  return (l >= 0 && l < p.batch && p.leaders[l] == l) ? l : r;
}

// Leader row b, KV head h: one unit for b and every row it leads. The first shared_counts[b]
// kept entries are the same pages for all of them (the caller's promise: rows sharing a
// prefix, one selection over it), so each such page is read once and folded into every
// member's softmax while it sits in L1; then each member reads its own entries. A row that
// leads only itself is the plain per-row unit.
template <typename T>
void run_group_head(const Problem& p, int64_t unit) {
  const int64_t b = unit / p.kv_heads, h = unit % p.kv_heads;
  if (leader_of(p, b) != b) return;  // its leader's unit computes it
  std::vector<RowState> members;
  for (int64_t r = 0; r < p.batch; ++r)
    if (leader_of(p, r) == b) members.emplace_back(p, r, h);
  const int64_t ps = p.page_size, hd = p.head_dim;
  std::vector<float> k_scratch(ps * hd), v_scratch(ps * hd), weights(ps);
  const float *keys = nullptr, *values = nullptr;
  int64_t shared = std::max<int64_t>(p.shared_counts[b], 0);
  for (const RowState& m : members) shared = std::min(shared, m.count);
  const RowState& first = members.front();  // b itself
  for (int64_t j = 0; j < shared; ++j) {
    if (load_block<T>(p, first, h, j, &keys, &values, k_scratch.data(), v_scratch.data()) <= 0)
      continue;
    const int64_t column = p.kept_blocks[first.selection * p.kept + j];
    for (RowState& m : members) {
      const int64_t visible = std::min(ps, m.length - column * ps);
      if (visible > 0) absorb(p, m, j, keys, values, visible, weights.data());
    }
  }
  for (RowState& m : members) {
    for (int64_t j = shared; j < m.count; ++j) {
      const int64_t visible =
          load_block<T>(p, m, h, j, &keys, &values, k_scratch.data(), v_scratch.data());
      if (visible > 0) absorb(p, m, j, keys, values, visible, weights.data());
    }
    finish(p, m, h);
  }
}

ffi::Error BlockSparseImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                           ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> page_table,
                           ffi::Buffer<ffi::S32> kept_blocks, ffi::Buffer<ffi::S32> kept_counts,
                           ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> leaders,
                           ffi::Buffer<ffi::S32> shared_counts, float scale,
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
  p.leaders = leaders.typed_data();
  p.shared_counts = shared_counts.typed_data();
  p.batch = q_dims[0];
  if (leaders.element_count() != p.batch || shared_counts.element_count() != p.batch)
    return ffi::Error::InvalidArgument("block-sparse attention: leaders, shared_counts: [B]");
  p.scale = scale;
  p.out = out->typed_data();
  p.mass = mass->typed_data();

  const int64_t units = q_dims[0] * p.kv_heads;
  std::function<void(int64_t)> body;
  switch (k_pages.element_type()) {
    case ffi::DataType::F32:
      body = [problem](int64_t u) { run_group_head<float>(*problem, u); };
      break;
    case ffi::DataType::F16:
      body = [problem](int64_t u) { run_group_head<_Float16>(*problem, u); };
      break;
    case ffi::DataType::BF16:
      body = [problem](int64_t u) { run_group_head<BFloat16>(*problem, u); };
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
                                  .Arg<ffi::Buffer<ffi::S32>>()  // leaders
                                  .Arg<ffi::Buffer<ffi::S32>>()  // shared_counts
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // block_mass
);
