"""Grouped products: each row times its own group's matrix, the routed experts' products.

    (rows [R, K] sorted by group, w [E, N, K] (output-major), group_sizes [E] int32)
      -> [R, N] in rows' dtype

group e takes the next group_sizes[e] rows; rows past their sum belong to no group and come
out zero. `xla`: `jax.lax.ragged_dot_general`, which JAX lowers to XLA's ragged dot on TPU and
GPU and, on XLA:CPU in JAX 0.10.2, densely (every row against every expert, masked: E times
the FLOPs of a token's k experts and a read of every expert's weights). `cpu`: the C++ kernel
(cpp_kernels/grouped_products.cc), which reads only the experts that have rows and runs each
row against its own; it takes any number of rows.
"""

from pallas_kernels.grouped_products.xla import grouped_products_xla

__all__ = ["grouped_products_xla"]
