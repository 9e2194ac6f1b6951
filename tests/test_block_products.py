"""Block products (pallas_kernels/block_products): the GGUF conversions bit for bit against
the gguf package's dequantization, and the XLA path and the C++ kernel against float64 NumPy
of the dequantized blocks, for every block format, odd sizes, one row and many; the shapes
the kernel refuses fall back to XLA."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpp_kernels import cpu_kernels_available
from pallas_kernels.block_products import formats
from pallas_kernels.block_products.cpu import (
    MAX_KERNEL_ROWS,
    block_products_cpu,
    block_products_cpu_takes,
)
from pallas_kernels.block_products.reference import (
    block_products_reference,
    dequantize_reference,
)
from pallas_kernels.block_products.xla import block_products_xla

FORMATS = [formats.Q8_0, formats.Q4_0, formats.Q4_1, formats.Q4_K, formats.Q6_K, formats.INT8]
U = 2.0**-24  # float32's unit roundoff

_xla = jax.jit(block_products_xla, static_argnums=(4, 5, 6))
_cpu = jax.jit(block_products_cpu, static_argnums=(4, 5))

needs_kernels = pytest.mark.skipif(not cpu_kernels_available(), reason="no C++ compiler")


def _weights(fmt: formats.BlockFormat, out: int, width: int, seed: int) -> formats.BlockArrays:
    # Arrays of the format with every quant value and scales of both signs and magnitudes.
    rng = np.random.default_rng(seed)
    block = fmt.block_size(width)
    if fmt.bits == 4:
        quants = rng.integers(0, 256, (out, width // 2), dtype=np.uint8)
    else:
        quants = rng.integers(-128, 128, (out, width), dtype=np.int8)
    dtype = np.dtype(fmt.scale_dtype)
    scales = (rng.standard_normal((out, width // block)) * 0.05).astype(dtype)
    offsets = (rng.standard_normal(scales.shape) * 0.3).astype(dtype) if fmt.offsets else None
    return formats.BlockArrays(quants, scales, offsets)


def _bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    # Each weight rounded once to float32, each product once, and a float32 sum of K terms
    # in any order: |error| <= (K + 1) u sum |x w| to first order; K + 2 covers the rest.
    return (x.shape[-1] + 2) * U * (np.abs(x) @ np.abs(w).T) + 1e-30


def _check(got, x, arrays, fmt):
    block = fmt.block_size(x.shape[-1])
    w = dequantize_reference(*arrays, block, fmt.bits)
    expected = block_products_reference(x, *arrays, block, fmt.bits)
    assert got.dtype == np.float32 and got.shape == expected.shape
    assert np.all(np.abs(got - expected) <= _bound(x.astype(np.float64), w))


def _args(arrays):
    return [None if a is None else jnp.asarray(a) for a in arrays]


# ---- GGUF conversions --------------------------------------------------------------------


def _gguf_bytes(name: str, out: int, width: int) -> np.ndarray:
    qtype = gguf.GGMLQuantizationType[name]
    rng = np.random.default_rng(7)
    if name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0"):  # the gguf package quantizes these itself
        return gguf.quants.quantize(rng.standard_normal((out, width)).astype(np.float32), qtype)
    # K-quants: every byte drawn, then the float16 super-block scales set to finite values
    # from the subnormal to the large, where an inexact product would show.
    values, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (out, width // values, size), dtype=np.uint8)
    d = np.array([6e-8, 3e-5, 0.0123, 1.0, 0.5, 17.25, 6000.0], np.float16)
    picks = d[np.arange(raw.shape[0] * raw.shape[1]) % d.size].reshape(raw.shape[:2], order="F")
    fields = [(0, 2), (2, 4)] if name == "Q4_K" else [(208, 210)]
    for start, stop in fields:
        raw[..., start:stop] = picks[..., None].view(np.uint8)
    return raw.reshape(out, -1)


@pytest.mark.parametrize("name", sorted(formats.GGUF_FORMATS))
def test_gguf_tensors_convert_bit_for_bit(name):
    out, width = 5, 512
    raw = _gguf_bytes(name, out, width)
    truth = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])
    fmt = formats.GGUF_FORMATS[name]
    arrays = formats.from_gguf(raw, name, (out, width))
    assert arrays.scales.dtype == np.dtype(fmt.scale_dtype)
    assert (arrays.offsets is not None) == fmt.offsets
    if name in ("Q8_0", "Q4_0", "Q4_1"):  # the file's value bytes as they are: a copy
        header = {"Q8_0": 2, "Q4_0": 2, "Q4_1": 4}[name]
        blocks = raw.reshape(out, width // 32, -1)
        assert arrays.quants.tobytes() == np.ascontiguousarray(blocks[..., header:]).tobytes()
    got = dequantize_reference(*arrays, fmt.block, fmt.bits)
    # float64 holds every value exactly, so rounding it once is float32's value of it.
    np.testing.assert_array_equal(got.astype(np.float32), truth)
    assert np.array_equal(got, truth.astype(np.float64))  # and no value was rounded at all


def test_gguf_refusals_name_the_type_and_the_bytes():
    with pytest.raises(ValueError, match="Q5_K"):
        formats.from_gguf(np.zeros(176, np.uint8), "Q5_K", (1, 256))
    with pytest.raises(ValueError, match="needs 68 bytes, got 34"):
        formats.from_gguf(np.zeros(34, np.uint8), "Q8_0", (1, 64))
    with pytest.raises(ValueError, match="not whole blocks"):
        formats.from_gguf(np.zeros(34, np.uint8), "Q8_0", (1, 48))


def test_int8_per_channel_rounds_to_the_nearest_step():
    w = np.random.default_rng(3).standard_normal((6, 40)).astype(np.float32)
    w[2] = 0  # a row of zeros
    arrays = formats.quantize_int8(w)
    back = dequantize_reference(*arrays, 40, 8)
    steps = arrays.scales.astype(np.float64)
    assert np.all(np.abs(back - w) <= steps / 2 * (1 + 1e-6))
    assert np.abs(arrays.quants).max() == 127 and not back[2].any()


# ---- products ----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("rows", [5])
def test_xla_products_match_numpy(fmt, rows):
    # Odd sizes: 13 outputs; one block of a row (32 values, 256 for K-quants) and several.
    for width in (32, 160) if fmt.block == 32 or fmt.block is None else (256,):
        arrays = _weights(fmt, 13, width, seed=rows + width)
        x = np.random.default_rng(rows).standard_normal((rows, width)).astype(np.float32)
        got = _xla(jnp.asarray(x), *_args(arrays), fmt.block_size(width), fmt.bits, None)
        _check(np.asarray(got), x, arrays, fmt)


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("rows", [1, 3, 7, 37])
def test_kernel_products_match_numpy(fmt, rows):
    # 44 outputs: eleven groups of 4, more than one unit's 8; rows on each of the kernel's
    # paths (dequantized in registers for up to 4 rows, and with AVX-512 a pair of weight
    # rows at a time for up to 8; into L1 for more: 9 blocks of 4 and 1).
    for width in (32, 160) if fmt.block == 32 or fmt.block is None else (256, 512):
        arrays = _weights(fmt, 44, width, seed=rows + width)
        x = np.random.default_rng(rows).standard_normal((rows, width)).astype(np.float32)
        args = (jnp.asarray(x), *_args(arrays), fmt.block_size(width), fmt.bits)
        assert block_products_cpu_takes(*args, jnp.float32)
        _check(np.asarray(_cpu(*args)), x, arrays, fmt)


@needs_kernels
def test_a_rows_product_does_not_depend_on_the_rows_beside_it():
    # Bit for bit: a row alone (weights dequantized in registers) equals the same row among
    # eight (a pair of weight rows at a time, with AVX-512) and among eleven (weights
    # dequantized into L1 first).
    fmt = formats.Q4_1
    arrays = _args(_weights(fmt, 8, 64, seed=0))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((11, 64)), jnp.float32)
    together = np.asarray(_cpu(x, *arrays, 32, 4))
    for i in (0, 4, 10):
        alone = np.asarray(_cpu(x[i : i + 1], *arrays, 32, 4))[0]
        np.testing.assert_array_equal(alone, together[i])
    np.testing.assert_array_equal(np.asarray(_cpu(x[3:5], *arrays, 32, 4)), together[3:5])
    np.testing.assert_array_equal(np.asarray(_cpu(x[2:10], *arrays, 32, 4)), together[2:10])


def test_the_kernel_refuses_what_it_cannot_read_and_xla_takes_it():
    fmt = formats.Q4_1
    arrays = _args(_weights(fmt, 8, 64, seed=1))
    x = jnp.zeros((2, 64), jnp.float32)
    assert block_products_cpu_takes(x, *arrays, 32, 4, jnp.float32)
    refused = [
        (x.astype(jnp.bfloat16), *arrays, 32, 4, jnp.float32),  # bfloat16 rows
        (x, *arrays, 32, 4, jnp.bfloat16),  # a bfloat16 result
        (jnp.zeros((MAX_KERNEL_ROWS + 1, 64), jnp.float32), *arrays, 32, 4, jnp.float32),
        (x, arrays[0][:6], arrays[1][:6], arrays[2][:6], 32, 4, jnp.float32),  # N of 6
        (x, arrays[0], arrays[1].astype(jnp.bfloat16), None, 32, 4, jnp.float32),
        (x, arrays[0].astype(jnp.int8), *arrays[1:], 32, 8, jnp.float32),  # offsets, 8 bits
    ]
    for args in refused:
        assert not block_products_cpu_takes(*args)
    # K = 48 is not whole 32s for the kernel; XLA takes it (8 bits, blocks of 16).
    odd = _weights(formats.Q6_K, 6, 48, seed=2)
    rows = np.random.default_rng(2).standard_normal((3, 48)).astype(np.float32)
    args = (jnp.asarray(rows), *_args(odd), 16, 8)
    assert not block_products_cpu_takes(*args, jnp.float32)
    _check(np.asarray(_xla(*args, None)), rows, odd, formats.Q6_K)
