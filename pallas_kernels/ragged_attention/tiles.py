"""The ragged attention kernels' tuned tile sizes, each with the measurement that chose it.

The host's plan (etjax/attention/plan.py) reads them to shape a step's passes: decode rows in
one-token query tiles, prompt chunks routed by length to tiles of 64, 128 or 512 queries, and
the cascade's shared tiles (etjax/attention/cascade.py). They were timed on the XLA kernel
(xla.py), the one every platform can run; the C++ kernel (cpp_kernels/ragged_pass.cc) takes
the same passes and the Triton kernel splits them further. The XLA kernel's own loop sizes
(`TILE_LOOP_MIN_QUERIES`, `TAIL_CHUNK`) stay in xla.py, which alone reads them.
"""

# The plan's tiling (etjax/attention/plan.py), chosen by timing the XLA backend on a 2-core
# CPU (SmolLM2's 9 heads, 3 KV heads, head_dim 64, pages of 16; medians of warm calls, per
# layer).
# - Decode: 16 items per loop trip, one-token tiles against key tiles of 4 pages. 8 rows of
#   8 pages took 0.32 ms (the padded gather it replaced: 0.30 ms), 32 rows of 128 pages 22 ms
#   (57 ms); larger trips waste more of the last one on short rows (chunk 64: 0.69 ms for
#   8 x 8). (2026-11-30)
# - Prefill, run by the tile loop (xla.py): the eight 512-token chunks of a 4K document took
#   164-172 ms in all with tiles of 64 queries x 4 pages, 152-155 ms with 128 x 8, 124-126
#   ms with 128 x 16 and 113 ms with 256 x 16 (the chunked item loop before it: 63 ms for
#   the last chunk alone). Wide tiles waste work on short chunks: eight
#   60-token prompts took 1.0-1.3 ms with 64 x 4, 4.0-4.2 ms with 128 x 16, 6.8-6.9 ms with
#   256 x 16. So chunks of up to 64 tokens (short prompts, a document's tail) get a pass of
#   their own. (2026-12-01)
# - Long chunks (over 256 tokens) get wider tiles still: on a 2-core Xeon with AMX, one
#   512-token chunk after 4K cached tokens (the whole forward pass) took 2,165 ms with tiles
#   of 128 x 16, 1,649 with 256 x 32 and 1,506 with 512 x 32 (fewer items, larger products,
#   each key tile gathered once per chunk), the same 630 ms at context 0; but a 100-token
#   chunk took 143 ms with 128 x 16 against 261 with 512 x 32 (the padded queries' work), and
#   a 250-token chunk 291 against 406: so chunks of 65 to 256 tokens keep 128 x 16. (2026-12-03)
CHUNK = 16
DECODE_KV_TILE = 4
SHORT_PREFILL_Q_TILE, SHORT_PREFILL_KV_TILE = 64, 4
PREFILL_Q_TILE, PREFILL_KV_TILE = 128, 16
LONG_PREFILL_MIN_TOKENS = 257
LONG_PREFILL_Q_TILE, LONG_PREFILL_KV_TILE = 512, 32

# Rows a shared tile stacks, and the fewest worth one. Timed on one layer's decode pass over
# a 2K-token shared prefix, SmolLM2's shapes, on a 2-core Xeon (benchmarks/cascade.py,
# docs/PERF.md "cascade"; cascade / plain): tiles of 8: 2 rows 0.96x, 3 rows 0.66x, 8 rows
# 0.38x, 16 rows 0.34x, 32 rows 0.34x; tiles of 16: 2 rows 1.02x, 3 rows 0.84x, 8 rows
# 0.43x, 16 rows 0.30x, 32 rows 0.27x. Two rows gain nothing (the stacked product's padding
# costs what the saved read saves); 16 wins where most is to win, the large groups.
SHARED_Q_TILE = 16
MIN_SHARED_ROWS = 3
