"""Row products: a projection of a few rows, x [..., in] times w [out, in] (output-major, as
etjax stores every projection) -> [..., out].

    xla: (x, w, out_dtype) -> [..., out] in out_dtype    XLA's product, any shape
    cpu: (rows [R, in] float32, w [out, in]) -> [R, out] float32    the C++ kernel,
         for the shapes `row_products_cpu_takes` accepts

A decode step multiplies its 1-32 rows by every weight of the model, so on a CPU the step is
the weights' read. XLA:CPU streams them at the machine's bandwidth for one row and packs them
into its own layout first for more (docs/PERF.md, "Row products"): a batch-8 step's products
cost about twice a batch-1 step's. The C++ kernel (cpp_kernels/row_products.cc) reads each
weight once for all the rows, and its cost stays the read up to a few dozen rows.
"""

from pallas_kernels.row_products.xla import row_products_xla

__all__ = ["row_products_xla"]
