"""Block selection for pruned decode: the blocks each (row, selection) keeps, from the pages'
scores, a budget and the blocks' last attention mass.

One signature for both implementations (`xla`, `cpu`), every argument explicit:

    (scores [B, S, P] float32, num_blocks [B], budget [B], sink_blocks, recent_blocks,
     mass_threshold, max_kept: static int, last_mass [B, S, P] | None)
      -> (kept_blocks [B, S, max_kept] int32, kept_counts [B, S] int32)

S is KVH (a selection per KV head) or 1 (one shared by the heads). The rule: the first
`sink_blocks` blocks and the last `recent_blocks` a row holds always, then blocks whose
`last_mass` reached `mass_threshold` (None: the scores alone rank), then the highest scores,
ties to the lower block; kept_counts = min(budget, num_blocks, max_kept). Entries past the
count repeat a kept id, so every entry is a valid page-table column.
"""

from pallas_kernels.block_selection.xla import select_blocks_xla

__all__ = ["select_blocks_xla"]
