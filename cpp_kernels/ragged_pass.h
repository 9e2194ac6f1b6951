// A ragged pass as the CPU kernel reads it (ragged_pass.cc's header lists the arguments), and
// how its work is split: narrow tiles by items, wide tiles by query rows (wide_tiles.h).

#ifndef ETJAX_PALLAS_KERNELS_CPU_RAGGED_PASS_H_
#define ETJAX_PALLAS_KERNELS_CPU_RAGGED_PASS_H_

#include <cstdint>
#include <vector>

namespace etjax_cpu {

constexpr int kMaxHeadDim = 512;

struct Pass {
  const float* q;
  const void* k;
  const void* v;
  const int32_t* q_positions;
  const int32_t* tile_tokens;
  const int32_t* item_pages;
  const int32_t* item_key_start;
  int64_t num_tokens, num_heads, head_dim;
  int64_t num_pages, kv_heads, page_size;
  int64_t tiles, tile_size, items_per_page_list;  // Nq, Qt, Kt
  int32_t window;
  float softcap, scale;
  // The real items of tile j are order[first[j] .. first[j + 1]).
  std::vector<int32_t> order, first;
  // Narrow tiles' units: (tile, KV head, items [item_begin, item_end) of `order`).
  struct Unit {
    int32_t tile, kv_head, item_begin, item_end;
  };
  std::vector<Unit> units;
  // Partial softmax of each unit: Qt * G rows of (max, normaliser, accumulator [hd]).
  std::vector<float> best, norm, acc;
  // Wide tiles' units: (tile, KV head, the tile's tokens [token_begin, token_end)), each
  // over all of the tile's items, so their rows' outputs are final.
  struct RowBlock {
    int32_t tile, kv_head, token_begin, token_end;
  };
  std::vector<RowBlock> row_blocks;
};

}  // namespace etjax_cpu

#endif  // ETJAX_PALLAS_KERNELS_CPU_RAGGED_PASS_H_
