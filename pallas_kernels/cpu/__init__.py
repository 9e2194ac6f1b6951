"""Attention kernels for CPUs in C++ (XLA FFI custom calls) that read the paged KV cache in
place: `build.py` compiles and registers them; the Python wrappers live beside the other
backends of each kernel (ragged_attention/cpu.py, block_sparse/cpu.py)."""

from pallas_kernels.cpu.build import cpu_kernels_available

__all__ = ["cpu_kernels_available"]
