// Wide query tiles (prompt chunks) on the CPU kernel: the causal attention of a chunk as
// register-blocked products with the softmax folded in page by page.
//
// XLA's tile loop (xla.py) runs a chunk's item as two matrix products with the softmax's
// passes between them over a [KVH, Qt * G, Kt * ps] score tensor: about 9 MB for a 512-token
// item of SmolLM2, written and read back from memory several times by single-threaded
// element-wise loops, and on the chunk's own key tile (its diagonal) every score is computed
// and half of them masked. Here a unit is one KV head's rows (query heads of the group) for a
// block of a tile's tokens, and it walks the tile's pages: a page's scores for all the rows
// stay in a few KB of scratch, its softmax update and values are folded in at once, and a
// page no row of the block sees (the rest of the diagonal) is never touched.
//
// Layout: rows (token, query head of the group) are the vector lanes. Queries are transposed
// once per unit into [hd][rows]; keys and values are read as the pool stores them, each of
// their floats broadcast against two registers' rows (32 with AVX-512, 16 with AVX2). So no
// page is ever transposed, and the softmax over a page's keys is element-wise across lanes,
// without horizontal reductions.

#ifndef ETJAX_PALLAS_KERNELS_CPU_WIDE_TILES_H_
#define ETJAX_PALLAS_KERNELS_CPU_WIDE_TILES_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernel_math.h"
#include "ragged_pass.h"

namespace etjax_cpu {

// The narrowest query tile that runs here: prompt chunks' tiles (64 tokens and up). A
// cascade's shared tile (16 decode rows of several sequences) stays narrow, whose units split
// the shared prefix's items, so even one such tile keeps every thread busy.
constexpr int64_t kWideTileMin = 32;
// Tokens of one unit: with G query heads per KV head, 32 * G rows. A 512-token chunk is then
// 16 units per KV head, enough to keep the threads busy to the end of a causal chunk.
constexpr int64_t kBlockTokens = 32;
// Rows of the micro-kernels: two registers' lanes.
constexpr int64_t kRowStep = 2 * kLanes;
// Keys of the score micro-kernel and head dims of the values one, so each holds step x 2
// accumulators beside its two registers of queries (or weights): with AVX-512's 32
// registers, 8 (10 registers loaded for 16 multiply-adds); with AVX2's 16, 4 (6 for 8):
// a standalone copy of the score kernel ran 1.13x faster with 4 than with 8, whose
// accumulators spill there (Zen 3 EPYC).
constexpr int64_t kKeyStep = kLanes >= 16 ? 8 : 4;
constexpr int64_t kDimStep = kKeyStep;

inline bool runs_wide(const Pass& pass) {
  return pass.tile_size >= kWideTileMin && pass.head_dim % kLanes == 0 &&
         pass.page_size % kKeyStep == 0;
}

// scores_t[j][r] = keys[j] . queries[r] for kKeyStep keys (rows `hd` apart) and kRowStep rows,
// the queries transposed (queries_t[d][r], rows `stride` apart).
inline void score_keys(const float* keys, int64_t hd, const float* queries_t, int64_t stride,
                       float* scores_t) {
  Lanes acc[kKeyStep][2] = {};
  for (int64_t d = 0; d < hd; ++d) {
    const Lanes q0 = load_lanes(queries_t + d * stride);
    const Lanes q1 = load_lanes(queries_t + d * stride + kLanes);
    for (int64_t j = 0; j < kKeyStep; ++j) {
      const float key = keys[j * hd + d];
      acc[j][0] += key * q0;
      acc[j][1] += key * q1;
    }
  }
  for (int64_t j = 0; j < kKeyStep; ++j) {
    store_lanes(scores_t + j * stride, acc[j][0]);
    store_lanes(scores_t + j * stride + kLanes, acc[j][1]);
  }
}

// acc_t[d][r] = acc_t[d][r] * rescale[r] + sum over keys j of values[j][d] * weights_t[j][r],
// for kDimStep dims (`values` and `acc_t` start at the first) and kRowStep rows (`stride`
// apart).
inline void add_values(float* acc_t, const float* rescale, const float* weights_t,
                       int64_t stride, const float* values, int64_t hd, int64_t keys) {
  const Lanes scale0 = load_lanes(rescale), scale1 = load_lanes(rescale + kLanes);
  Lanes acc[kDimStep][2];
  for (int64_t e = 0; e < kDimStep; ++e) {
    acc[e][0] = load_lanes(acc_t + e * stride) * scale0;
    acc[e][1] = load_lanes(acc_t + e * stride + kLanes) * scale1;
  }
  for (int64_t j = 0; j < keys; ++j) {
    const Lanes w0 = load_lanes(weights_t + j * stride);
    const Lanes w1 = load_lanes(weights_t + j * stride + kLanes);
    for (int64_t e = 0; e < kDimStep; ++e) {
      const float value = values[j * hd + e];
      acc[e][0] += value * w0;
      acc[e][1] += value * w1;
    }
  }
  for (int64_t e = 0; e < kDimStep; ++e) {
    store_lanes(acc_t + e * stride, acc[e][0]);
    store_lanes(acc_t + e * stride + kLanes, acc[e][1]);
  }
}

// One unit (Pass::RowBlock) of a wide pass: its rows' final outputs into out [Nq, Qt, H, hd]
// and log-sum-exps into lse [Nq, Qt, H] (left as they are for rows that see no key).
template <typename T>
void run_row_block(const Pass& pass, int64_t index, float* out, float* lse) {
  const Pass::RowBlock& block = pass.row_blocks[index];
  const int64_t hd = pass.head_dim, ps = pass.page_size, kt = pass.items_per_page_list;
  const int64_t group = pass.num_heads / pass.kv_heads, qt = pass.tile_size;
  const int64_t tokens = block.token_end - block.token_begin;
  const int64_t rows = tokens * group;
  const int64_t stride = (rows + kRowStep - 1) / kRowStep * kRowStep;

  // Each real row's key range [lowest, highest]; padding rows (tokens of no sequence, and the
  // lanes past `rows`) compute on zero queries, are never masked and never written out.
  const int32_t* tile_tokens = pass.tile_tokens + block.tile * qt + block.token_begin;
  std::vector<int64_t> lowest(rows, 0), highest(rows, -1);
  std::vector<float> queries_t(hd * stride, 0.0f);
  int64_t block_low = INT64_MAX, block_high = -1, latest_low = -1, earliest_high = INT64_MAX;
  for (int64_t t = 0; t < tokens; ++t) {
    const int32_t token = tile_tokens[t];
    if (token < 0 || token >= pass.num_tokens) continue;
    const int64_t position = pass.q_positions[token];
    const int64_t low = pass.window > 0 ? std::max<int64_t>(position - pass.window + 1, 0) : 0;
    if (position < low) continue;
    block_low = std::min(block_low, low);
    block_high = std::max(block_high, position);
    latest_low = std::max(latest_low, low);
    earliest_high = std::min(earliest_high, position);
    for (int64_t g = 0; g < group; ++g) {
      const int64_t row = t * group + g;
      lowest[row] = low;
      highest[row] = position;
      const float* query = pass.q + (token * pass.num_heads + block.kv_head * group + g) * hd;
      for (int64_t d = 0; d < hd; ++d) queries_t[d * stride + row] = query[d] * pass.scale;
    }
  }
  if (block_high < 0) return;

  std::vector<float> best(stride, kMasked), norm(stride, 0.0f), acc_t(hd * stride, 0.0f);
  std::vector<float> scores_t(ps * stride), rescale(stride), page_max(stride);
  std::vector<float> k_scratch(ps * hd), v_scratch(ps * hd);
  const T* k_pool = static_cast<const T*>(pass.k);
  const T* v_pool = static_cast<const T*>(pass.v);
  for (int32_t i = pass.first[block.tile]; i < pass.first[block.tile + 1]; ++i) {
    const int32_t item = pass.order[i];
    for (int64_t p = 0; p < kt; ++p) {
      const int64_t key0 = pass.item_key_start[item] + p * ps;
      if (key0 > block_high || key0 + ps - 1 < block_low) continue;  // no row sees the page
      const int64_t page = pass.item_pages[item * kt + p];
      if (page < 0 || page >= pass.num_pages) continue;
      const int64_t offset = (page * pass.kv_heads + block.kv_head) * ps * hd;
      const float* keys = as_float<T>(k_pool + offset, ps * hd, k_scratch.data());
      const float* values = as_float<T>(v_pool + offset, ps * hd, v_scratch.data());

      for (int64_t j = 0; j < ps; j += kKeyStep)
        for (int64_t r = 0; r < stride; r += kRowStep)
          score_keys(keys + j * hd, hd, queries_t.data() + r, stride,
                     scores_t.data() + j * stride + r);
      const bool whole = latest_low <= key0 && key0 + ps - 1 <= earliest_high;
      if (!whole || pass.softcap > 0.0f) {
        for (int64_t j = 0; j < ps; ++j) {
          float* row_scores = scores_t.data() + j * stride;
          if (pass.softcap > 0.0f)
            for (int64_t r = 0; r < stride; ++r)
              row_scores[r] = pass.softcap * std::tanh(row_scores[r] / pass.softcap);
          if (!whole)
            for (int64_t r = 0; r < rows; ++r)
              if (key0 + j < lowest[r] || key0 + j > highest[r]) row_scores[r] = kMasked;
        }
      }

      // The online softmax over the page's keys, lane by lane.
      std::copy(best.begin(), best.end(), page_max.begin());
      for (int64_t j = 0; j < ps; ++j) {
        const float* row_scores = scores_t.data() + j * stride;
        for (int64_t r = 0; r < stride; ++r) page_max[r] = std::max(page_max[r], row_scores[r]);
      }
      for (int64_t r = 0; r < stride; ++r) {
        rescale[r] = exp_nonpositive(best[r] - page_max[r]);
        best[r] = page_max[r];
        norm[r] *= rescale[r];
      }
      for (int64_t j = 0; j < ps; ++j) {
        float* row_scores = scores_t.data() + j * stride;
        for (int64_t r = 0; r < stride; ++r)
          row_scores[r] = exp_nonpositive(row_scores[r] - page_max[r]);
        // A masked key weighs nothing, also for a row that has seen no key yet (whose
        // maximum is still the mask's value).
        if (!whole)
          for (int64_t r = 0; r < rows; ++r)
            if (key0 + j < lowest[r] || key0 + j > highest[r]) row_scores[r] = 0.0f;
        for (int64_t r = 0; r < stride; ++r) norm[r] += row_scores[r];
      }
      for (int64_t d = 0; d < hd; d += kDimStep)
        for (int64_t r = 0; r < stride; r += kRowStep)
          add_values(acc_t.data() + d * stride + r, rescale.data() + r,
                     scores_t.data() + r, stride, values + d, hd, ps);
    }
  }

  for (int64_t row = 0; row < rows; ++row) {
    if (highest[row] < lowest[row] || norm[row] <= 0.0f) continue;
    const int64_t t = row / group, head = block.kv_head * group + row % group;
    const int64_t slot = (block.tile * qt + block.token_begin + t) * pass.num_heads + head;
    float* dst = out + slot * hd;
    for (int64_t d = 0; d < hd; ++d) dst[d] = acc_t[d * stride + row] / norm[row];
    lse[slot] = best[row] + std::log(norm[row]);
  }
}

// A wide pass's units: each tile's blocks of kBlockTokens tokens for every KV head, the
// tile's last blocks first (under the causal mask they see the most keys, so the threads
// finish together).
inline void plan_row_blocks(Pass& pass) {
  for (int32_t j = 0; j < pass.tiles; ++j) {
    if (pass.first[j] == pass.first[j + 1]) continue;
    for (int64_t begin = (pass.tile_size - 1) / kBlockTokens * kBlockTokens; begin >= 0;
         begin -= kBlockTokens)
      for (int32_t h = 0; h < pass.kv_heads; ++h)
        pass.row_blocks.push_back(
            {j, h, static_cast<int32_t>(begin),
             static_cast<int32_t>(std::min<int64_t>(begin + kBlockTokens, pass.tile_size))});
  }
}

}  // namespace etjax_cpu

#endif  // ETJAX_PALLAS_KERNELS_CPU_WIDE_TILES_H_
