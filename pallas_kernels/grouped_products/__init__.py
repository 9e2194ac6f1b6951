"""Grouped products: each row times its own group's matrix, the routed experts' products.

    (rows [R, K] sorted by group, w [E, N, K] (output-major), group_sizes [E] int32)
      -> [R, N] in rows' dtype

group e takes the next group_sizes[e] rows; rows past their sum belong to no group and come
out zero. `xla`: `jax.lax.ragged_dot_general`, which JAX lowers to XLA's ragged dot on TPU and
GPU and, on XLA:CPU in JAX 0.10.2, densely (every row against every expert, masked: E times
the FLOPs of a token's k experts and a read of every expert's weights). `cpu`: the C++ kernel
(cpp_kernels/grouped_products.cc), which reads only the experts that have rows and runs each
row against its own; it takes any number of rows.

Experts kept in blocks (quants, scales, offsets stacked on a leading expert axis, each
expert's as pallas_kernels/block_products/formats.py says) have their own pair:
`grouped_blocks_xla` dequantizes them in the program (int8 per channel: multiplies the int8
values and scales each row's outputs by its expert's scales) and `grouped_blocks_cpu` runs the
same C++ kernel, which reads each expert's blocks once for all its rows.
"""

from pallas_kernels.grouped_products.xla import grouped_blocks_xla, grouped_products_xla

__all__ = ["grouped_blocks_xla", "grouped_products_xla"]
