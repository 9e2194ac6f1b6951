#!/bin/sh
# One command for a CUDA (or TPU) machine: the kernel tests compiled, then kernel timings.
# Tested here in interpret mode with: ETJAX_PALLAS_INTERPRET=1 benchmarks/gpu_check.sh --smoke
set -e
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
$PY -c "import jax; print('devices:', jax.devices(), 'jax', jax.__version__)"
$PY -m pytest -q -p no:cacheprovider tests/test_block_sparse_kernels.py
$PY benchmarks/kernel_timing.py "$@"
