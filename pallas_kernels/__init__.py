"""etjax's kernels, by op: every implementation of an op beside the others, one signature
documented once in the op's package docstring.

- `ragged_attention/`: dense attention of a flat ragged batch over the paged KV cache
  (reference, XLA, Pallas GPU, C++ CPU; the host's work items; `tiles.py`, the tiling).
- `block_sparse/`: decode attention over chosen pages (reference, XLA, Pallas TPU, Pallas
  GPU, C++ CPU).
- `page_scores/`: the pages' Quest bounds pruned decode ranks them by (reference, XLA, C++).
- `block_selection/`: the kept blocks of pruned decode (XLA, C++).
- `row_products/`, `grouped_products/`: a projection of a few rows and the routed experts'
  grouped product (XLA, C++).

`cpu.py` in each is the wrapper of a C++ kernel (cpp_kernels/, XLA FFI calls). Self-contained:
every kernel takes arrays and ints, and nothing here imports etjax, so the kernels can be
tested and reused on their own; etjax chooses among them (etjax/attention/backend.py,
etjax/model/products.py).
"""
