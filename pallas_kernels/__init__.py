"""Attention kernels for etjax's paged KV cache.

Self-contained: nothing here imports etjax, so the kernels can be tested and reused on their own.
"""
