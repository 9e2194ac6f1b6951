"""Int8 rows (weights="stored-int8-rows"): the interleaved layout against the plain one, value
for value; the int8-rows kernel (cpp_kernels/int8_rows.cc) and its XLA fallback against the
float64 reference of the same arithmetic, and against float32 rows' exact product within the
rounding bound of the rows; a row's product the same bits alone and in a batch, and from the
AVX-512 VNNI, AVX2 and portable builds; the real SmolLM2 file loaded so, value for value."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpp_kernels import cpu_kernels_available
from etjax.model.quantized import QuantizedWeight, embedding_rows, from_block_arrays
from pallas_kernels.block_products import formats
from pallas_kernels.block_products.cpu import int8_rows_cpu, int8_rows_cpu_takes
from pallas_kernels.block_products.reference import (
    block_products_reference,
    int8_rows_bound,
    int8_rows_reference,
)
from pallas_kernels.block_products.xla import deinterleave_xla, int8_rows_xla

FORMATS = [formats.Q8_0, formats.Q4_0, formats.Q4_1, formats.Q4_K]
KERNELS = Path(__file__).resolve().parent.parent / "cpp_kernels"

_kernel = jax.jit(int8_rows_cpu, static_argnums=(4, 5))
_xla = jax.jit(int8_rows_xla, static_argnums=(4,))


def _weights(fmt: formats.BlockFormat, out: int, width: int, seed: int) -> formats.BlockArrays:
    # Every quant value (8 bits: -128 included), scales and offsets of both signs.
    rng = np.random.default_rng(seed)
    if fmt.bits == 4:
        quants = rng.integers(0, 256, (out, width // 2), dtype=np.uint8)
    else:
        quants = rng.integers(-128, 128, (out, width), dtype=np.int8)
        quants[0, :32] = -128
    dtype = np.dtype(fmt.scale_dtype)
    scales = (rng.standard_normal((out, width // 32)) * 0.05).astype(dtype)
    offsets = (rng.standard_normal(scales.shape) * 0.3).astype(dtype) if fmt.offsets else None
    return formats.BlockArrays(quants, scales, offsets)


def _rows(count: int, width: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((count, width)).astype(np.float32)
    x[0, :32] = 0.0  # a block of zeros: dx 0, every value 0
    x[-1, 32:64] *= 1000.0  # a block far larger than its neighbours
    return x


def _device(arrays) -> list:
    return [None if a is None else jnp.asarray(a) for a in arrays]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_interleaving_reorders_the_values_and_deinterleaving_restores_them(fmt):
    plain = _weights(fmt, 48, 96, seed=1)
    mixed = formats.interleave(plain, fmt)
    for a, b in zip(mixed, plain, strict=True):
        if a is not None:
            assert a.shape == b.shape and a.dtype == b.dtype
            assert not np.array_equal(a, b) and np.array_equal(np.sort(a, None), np.sort(b, None))
    # Value 4c + t of block b of row 16 g + l sits at chunk c, lane l, byte t (8 bits).
    if fmt.bits == 8:
        g, b, c, lane, t = 2, 1, 5, 9, 3
        group = mixed.quants[16 * g : 16 * g + 16].reshape(-1)
        assert (
            group[(b * 8 + c) * 64 + 4 * lane + t]
            == plain.quants[16 * g + lane, 32 * b + 4 * c + t]
        )
    back = formats.deinterleave(mixed, fmt)
    in_program = deinterleave_xla(*_device(mixed), fmt.bits)
    for a, b, c in zip(back, in_program, plain, strict=True):
        assert (a is None) == (c is None)
        if a is not None:
            assert np.array_equal(a, c) and np.array_equal(np.asarray(b), c)


@pytest.mark.parametrize("rows", [1, 3, 8, 13])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_the_kernel_is_the_reference_arithmetic_within_the_rows_rounding(fmt, rows):
    plain = _weights(fmt, 48, 96, seed=2)
    mixed = _device(formats.interleave(plain, fmt))
    x = _rows(rows, 96, seed=rows)
    assert int8_rows_cpu_takes(jnp.asarray(x), *mixed, 32, fmt.bits, jnp.float32)
    got = np.asarray(_kernel(jnp.asarray(x), *mixed, 32, fmt.bits))
    same_arithmetic = int8_rows_reference(x, *plain, fmt.bits)
    # The same integers, scaled and summed in float32 over 3 blocks: a few roundings.
    scale = np.abs(same_arithmetic).max()
    assert np.abs(got - same_arithmetic).max() <= 1e-6 * scale
    exact = block_products_reference(x, *plain, 32, fmt.bits)
    assert np.all(np.abs(got - exact) <= int8_rows_bound(x, *plain, fmt.bits))
    # A row alone gives the bits it gave beside the others.
    alone = np.asarray(_kernel(jnp.asarray(x[-1:]), *mixed, 32, fmt.bits))
    assert np.array_equal(alone[0], got[-1])


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_the_xla_fallback_is_the_same_arithmetic(fmt):
    plain = _weights(fmt, 32, 64, seed=3)
    x = _rows(5, 64, seed=4)
    got = np.asarray(_xla(jnp.asarray(x), *_device(plain), fmt.bits))
    expected = int8_rows_reference(x, *plain, fmt.bits)
    assert np.abs(got - expected).max() <= 1e-6 * np.abs(expected).max()
    # No rows (a step's head with nothing to read): no rows out.
    assert _xla(jnp.zeros((0, 64)), *_device(plain), fmt.bits).shape == (0, 32)


def test_the_kernel_takes_blocks_of_32_and_outputs_in_sixteens():
    x = jnp.zeros((2, 64), jnp.float32)
    q8 = _device(_weights(formats.Q8_0, 32, 64, seed=5))
    assert int8_rows_cpu_takes(x, *q8, 32, 8, jnp.float32)
    assert not int8_rows_cpu_takes(
        x, *_device(_weights(formats.Q8_0, 24, 64, 5)), 32, 8, jnp.float32
    )
    assert not int8_rows_cpu_takes(x.astype(jnp.bfloat16), *q8, 32, 8, jnp.float32)


def _build(march: str, directory: Path) -> str:
    # int8_rows.cc alone, for `march`, registered under its own target name.
    out = directory / f"int8_rows_{march}.so"
    subprocess.run(
        [shutil.which("g++") or "c++", "-O3", f"-march={march}", "-std=c++17", "-shared", "-fPIC",
         "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
         "-ffp-contract=fast", f"-I{jax.ffi.include_dir()}", f"-I{KERNELS}",
         str(KERNELS / "int8_rows.cc"), "-o", str(out)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    name = f"etjax_test_int8_rows_{march.replace('-', '_')}"
    library = ctypes.cdll.LoadLibrary(str(out))
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(library.EtjaxInt8RowsCpu), platform="cpu")
    return name


@pytest.mark.skipif(not cpu_kernels_available(), reason="no C++ compiler")
def test_every_instruction_set_gives_a_row_the_same_bits(tmp_path):
    # The library's own build (-march=native: VNNI on this Zen 4, AVX2 on a Zen 3), an AVX2
    # build and a portable one: the same integers and float32 operations in the same order.
    targets = [_build(march, tmp_path) for march in ("x86-64-v3", "x86-64")]
    for fmt in FORMATS:
        plain = _weights(fmt, 32, 128, seed=6)
        mixed = formats.interleave(plain, fmt)
        x = _rows(11, 128, seed=7)
        offsets = jnp.zeros((0,), plain.scales.dtype) if plain.offsets is None else mixed.offsets
        args = (jnp.asarray(x), jnp.asarray(mixed.quants), jnp.asarray(mixed.scales), offsets)
        native = np.asarray(_kernel(*_device(args[:3]), None if plain.offsets is None else offsets,
                                    32, fmt.bits))  # fmt: skip
        for target in targets:
            call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((11, 32), jnp.float32))
            assert np.array_equal(np.asarray(call(*args)), native), (fmt.name, target)


def test_an_interleaved_embedding_gathers_the_rows_it_held():
    plain = _weights(formats.Q8_0, 64, 64, seed=8)
    table = from_block_arrays(plain, formats.Q8_0, (64, 64))
    mixed = from_block_arrays(formats.interleave(plain, formats.Q8_0),
                              formats.INTERLEAVED["q8_0"], (64, 64))  # fmt: skip
    tokens = jnp.asarray([0, 17, 63, 17, 40], jnp.int32)
    assert np.array_equal(np.asarray(mixed.dequantize()), np.asarray(table.dequantize()))
    assert np.array_equal(
        np.asarray(embedding_rows(mixed, tokens, jnp.float32)),
        np.asarray(embedding_rows(table, tokens, jnp.float32)),
    )
    assert np.array_equal(
        np.asarray(embedding_rows(mixed, tokens[:1], jnp.float32)),
        np.asarray(embedding_rows(table, tokens[:1], jnp.float32)),
    )


@pytest.fixture(scope="module")
def int8_rows_smollm2(smollm2_path):
    import etjax

    return etjax.load_model(smollm2_path, weights="stored-int8-rows")


def test_smollm2_loads_its_blocks_interleaved_value_for_value(smollm2_path, int8_rows_smollm2):
    import etjax

    stored = etjax.load_model(smollm2_path, weights="stored")
    rows = int8_rows_smollm2
    assert rows.weights_format == "q4_1x16+q8_0x16"
    leaves = jax.tree.leaves(rows.weights, is_leaf=lambda w: isinstance(w, QuantizedWeight))
    plain = jax.tree.leaves(stored.weights, is_leaf=lambda w: isinstance(w, QuantizedWeight))
    for mixed, kept in zip(leaves, plain, strict=True):
        if isinstance(mixed, QuantizedWeight):
            assert mixed.format.interleaved and mixed.nbytes == kept.nbytes
            back = formats.deinterleave(
                formats.BlockArrays(*(None if a is None else np.asarray(a)
                                      for a in (mixed.quants, mixed.scales, mixed.offsets))),
                mixed.format,
            )  # fmt: skip
            assert np.array_equal(back.quants, np.asarray(kept.quants))
            assert np.array_equal(back.scales, np.asarray(kept.scales))


def test_speculation_on_int8_rows_gives_the_plain_tokens_and_logprobs_bit_for_bit(
    int8_rows_smollm2,
):
    # The verifying steps (up to 8 rows) and the bursts (1 row) must round every row alike,
    # the norms included (tests/test_norms.py): a last-bit difference upstream of a rounding
    # to int8 can move a value by a whole int8 step and change a token.
    import etjax

    text = "Copy this list exactly:\n- red apple\n- green pear\n- yellow banana\n- purple grape"
    runs = [
        etjax.decode(text, model=int8_rows_smollm2, chat=True, max_new_tokens=24,
                     ignore_eos=True, max_batch_size=1, speculation=speculation)[0]
        for speculation in (False, True)
    ]  # fmt: skip
    plain, speculating = runs
    assert speculating.accepted_tokens > 0 and speculating.verify_steps > 0
    assert speculating.token_ids == plain.token_ids
    assert speculating.logprob == plain.logprob
