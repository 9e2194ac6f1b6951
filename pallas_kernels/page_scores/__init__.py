"""Page scores for pruned decode: the Quest bound of every page a row holds.

For a page holding keys k_1..k_n of one KV head, the cache keeps the elementwise min and max
over its slots (etjax/pruning/block_scores.py keeps them current). For any query q, every key
in the page satisfies

    q . k = sum_d q_d k_d <= sum_d max(q_d * kmin_d, q_d * kmax_d)

so the right-hand side bounds the largest attention logit the page can produce: a page whose
bound is low cannot hold much attention mass. With grouped-query attention the score of a KV
head is the largest bound over the query heads that share it, and a selection shared by the
KV heads scores a page by the largest bound over all its heads.

One signature for the scorers (`xla`, `cpu`):

    (q [B, H, hd], k_min [N, KVH, hd], k_max [N, KVH, hd], page_table [B, P],
     num_blocks [B], shared: bool) -> scores [B, 1 if shared else KVH, P] float32

the scaled bound (q.k * hd**-0.5) of each of a row's first num_blocks pages, -inf past them.
`reference.block_upper_bounds` is the bound itself over a whole page table.
"""

from pallas_kernels.page_scores.reference import block_upper_bounds
from pallas_kernels.page_scores.xla import score_pages_xla

__all__ = ["block_upper_bounds", "score_pages_xla"]
