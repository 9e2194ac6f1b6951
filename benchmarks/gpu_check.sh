#!/bin/sh
# One command for a CUDA (or TPU) machine: every attention backend compiled and checked against
# its float32 reference, the engine's dense and pruned decode through the platform's Pallas
# kernels against XLA, then kernel timings.
# Tested here (CPU: the kernels run interpreted) with: benchmarks/gpu_check.sh --smoke
set -e
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
$PY -c "import jax; print('devices:', jax.devices(), 'jax', jax.__version__)"
# Block-sparse kernels (Pallas GPU / TPU / XLA) and the ragged kernels (XLA, Pallas GPU) vs their
# references.
$PY -m pytest -q -p no:cacheprovider tests/test_block_sparse_kernels.py tests/test_ragged_attention.py \
  tests/test_ragged_attention_gpu.py
# The product path: dense (GPU) and pruned decode through this platform's Pallas kernels equal XLA.
BACKEND=$($PY -c "from etjax.attention import resolve_backend; print(resolve_backend('auto'))")
$PY -m pytest -q -p no:cacheprovider tests/test_pruning_decode.py -k "$BACKEND or auto_backend"
# Speculation's verification pass (a row's token and drafts in one query tile) on the platform's
# dense kernel ("auto"): outputs equal to the engine without speculation.
$PY -m pytest -q -p no:cacheprovider tests/test_speculation.py -k "verification or greedy_with"
$PY benchmarks/kernel_timing.py "$@"
