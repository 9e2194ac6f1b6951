"""Kernels for CPUs in C++, run by XLA as FFI custom calls: attention that reads the paged KV
cache in place (dense ragged passes, block-sparse decode, the pages' Quest bounds and the kept
blocks of pruned decode) and the products of a few rows and of routed experts.

`targets.py` names every FFI target once; `build.py` compiles the sources here into one
library, caches and verifies it, and registers the targets. The Python wrappers live beside
the other implementations of their op (pallas_kernels/<op>/cpu.py). Nothing here imports
etjax or pallas_kernels.
"""

from cpp_kernels.build import call_cpu_kernel, cpu_kernels_available

__all__ = ["call_cpu_kernel", "cpu_kernels_available"]
