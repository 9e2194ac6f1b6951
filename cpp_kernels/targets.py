"""The library's XLA FFI targets, each defined once: the name XLA calls it by, the C handler
symbol the library exports for it (`XLA_FFI_DEFINE_HANDLER_SYMBOL` in its source) and that
source. build.py compiles the sources and registers every target; the Python wrappers, beside
the other implementations of their op in pallas_kernels/<op>/cpu.py, call them by these
constants, never by a spelled-out name.
"""

from __future__ import annotations

from typing import NamedTuple


class Target(NamedTuple):
    """One FFI target of the library."""

    name: str  # the target name registered with XLA and passed to jax.ffi.ffi_call
    symbol: str  # the handler the compiled library exports
    source: str  # the .cc file (in this folder) that defines the handler


RAGGED_PASS = Target("etjax_ragged_pass_cpu", "EtjaxRaggedPassCpu", "ragged_pass.cc")
BLOCK_SPARSE = Target("etjax_block_sparse_cpu", "EtjaxBlockSparseCpu", "block_sparse.cc")
PAGE_BOUNDS = Target("etjax_page_bounds_cpu", "EtjaxPageBoundsCpu", "page_bounds.cc")
SELECT_BLOCKS = Target("etjax_select_blocks_cpu", "EtjaxSelectBlocksCpu", "select_blocks.cc")
ROW_PRODUCTS = Target("etjax_row_products_cpu", "EtjaxRowProductsCpu", "row_products.cc")
GROUPED_PRODUCTS = Target(
    "etjax_grouped_products_cpu", "EtjaxGroupedProductsCpu", "grouped_products.cc"
)
BLOCK_PRODUCTS = Target("etjax_block_products_cpu", "EtjaxBlockProductsCpu", "block_products.cc")
INT8_ROWS = Target("etjax_int8_rows_cpu", "EtjaxInt8RowsCpu", "int8_rows.cc")

# Every target, in the order their sources are compiled (part of the cache key).
TARGETS = (
    RAGGED_PASS,
    BLOCK_SPARSE,
    PAGE_BOUNDS,
    SELECT_BLOCKS,
    ROW_PRODUCTS,
    GROUPED_PRODUCTS,
    BLOCK_PRODUCTS,
    INT8_ROWS,
)
