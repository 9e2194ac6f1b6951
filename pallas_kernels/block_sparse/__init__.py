"""Block-sparse paged decode attention: attend each (sequence, KV head) to a chosen set of pages.

One signature, four backends (`reference`, `xla`, `pallas_tpu`, `pallas_gpu`):

    (q [B, H, hd], k_pages [N, KVH, ps, hd], v_pages [N, KVH, ps, hd], page_table [B, P],
     kept_blocks [B, KVH, K], kept_counts [B, KVH], lengths [B])
      -> (out [B, H, hd], block_mass [B, KVH, K])

`kept_blocks[b, h, :kept_counts[b, h]]` are the logical blocks (page-table columns) sequence b
attends with KV head h; keys at positions >= lengths[b] are masked; the softmax runs over the
kept keys only. A selection shared by all KV heads may be passed as kept_blocks [B, 1, K] and
kept_counts [B, 1]; the XLA backend then gathers whole pages, all heads at once.
`block_mass[b, h, j]` is the attention probability on kept block j, averaged over the query
heads that share KV head h (0 for j >= kept_counts). Dense attention is every block kept.
Entries of kept_blocks beyond kept_counts must still be valid column indices.
"""

from pallas_kernels.block_sparse.reference import block_sparse_attention_reference
from pallas_kernels.block_sparse.xla import block_sparse_attention_xla

__all__ = ["block_sparse_attention_reference", "block_sparse_attention_xla"]
