"""Ragged paged attention: a flat batch of new tokens from many sequences, each attending
causally to its own sequence's pages, up to its own position.

The flat batch mixes decode tokens (one or a few per sequence) and prefill chunks (many). Every
token t belongs to one sequence and has an absolute position `q_positions[t]`; it sees the keys
of its sequence at positions <= its own. Keys and values live in a page pool
`[N, KVH, ps, hd]` (etjax/cache/kv_cache.py); the new tokens' keys are already written.

    reference: (q [T, H, hd], k_pages, v_pages, q_positions [T], token_seq [T],
                page_table [S, P]) -> out [T, H, hd]
    xla:       (q [T, H, hd], k_pages, v_pages, q_positions [T], passes) -> out [T, H, hd]

`reference` is the float32 truth: one dense masked softmax per token over its sequence's page
table. `xla` reads only the pages a token can see. Its work is described on the host by
`build_pass` (work_items.py) as a list of items, each one query tile of a sequence against one
tile of that sequence's pages; a `lax.fori_loop` with a dynamic trip count runs the real items
chunk by chunk and merges their partial softmaxes online, so the compiled program does not
depend on context lengths, only on the number of tokens and the item capacity. Tokens with
`token_seq < 0` (padding) get zeros. `pallas_gpu` (Triton), `pallas_tpu` (Mosaic, one pass,
run by xla.py in its loops' place) and `cpu` (the C++ kernel, cpp_kernels/ragged_pass.cc)
take xla's passes. `tiles.py` holds the tuned tile sizes the
host's plan shapes the passes with.
"""

from pallas_kernels.ragged_attention.reference import ragged_attention_reference
from pallas_kernels.ragged_attention.work_items import Segment, TilePass, build_pass
from pallas_kernels.ragged_attention.xla import ragged_attention_xla

__all__ = [
    "Segment",
    "TilePass",
    "build_pass",
    "ragged_attention_reference",
    "ragged_attention_xla",
]
