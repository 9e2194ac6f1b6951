"""Block products: float rows times quantized weights kept in blocks, x [..., in] times
w [out, in] (output-major, as etjax stores every projection) -> [..., out], where w is
`quants`, `scales` and `offsets` (formats.py: 8-bit and 4-bit blocks, the GGUF formats they
are read from, and int8 per output channel).

    xla: (x, quants, scales, offsets, block, bits, out_dtype) -> [..., out] in out_dtype
         the weight dequantized in the program, then XLA's product; any shape, any platform
    cpu: (x [..., in] float32, quants, scales, offsets, block, bits) -> [..., out] float32
         the C++ kernel, for the shapes `block_products_cpu_takes` accepts
    reference: the same in NumPy float64 (block_products_reference), the tests' truth

and the same product with the rows rounded to int8 per block of 32 (weights="stored-int8-
rows", llama.cpp's arithmetic), on weights interleaved 16 outputs at a time (formats.py):
`int8_rows_cpu` (cpp_kernels/int8_rows.cc, AVX-512 VNNI), `int8_rows_xla` (on the weight
deinterleaved, `deinterleave_xla`) and `int8_rows_reference`, with `int8_rows_bound`, how far
the rows' rounding may move a product.

A decode step is the read of every weight of the model, and 4-bit blocks are 6.4 times fewer
bytes than float32. The C++ kernel (cpp_kernels/block_products.cc) reads each block once for
all the rows of a step and dequantizes it in registers, as the row-products kernel reads float
weights; past 32 rows it multiplies dequantized panels in register tiles. Its rows stay
float32; rounded to int8 they cost 1.8-2.6x less CPU time but only on the interleaved layout,
where one register's lanes are 16 outputs (on the plain one, every output paid its own
conversion and scaling a block, and int8 rows gained nothing). On a CPU the float32-rows
kernel beats XLA's float32 product on the same weights dequantized ahead at every row count
measured, and XLA dequantizing in the program, this package's fallback, by far more
(docs/PERF.md, "Block products").
"""

from pallas_kernels.block_products.formats import BlockArrays, BlockFormat
from pallas_kernels.block_products.xla import block_products_xla, dequantize_xla

__all__ = ["BlockArrays", "BlockFormat", "block_products_xla", "dequantize_xla"]
