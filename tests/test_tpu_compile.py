"""The engine's step programs built by the TPU compiler, from this CPU (etjax/planning/programs.py).

`jax.export` (tests/test_export.py) proves the lowering rules; these compile: XLA:TPU and
Mosaic build the programs for a v5e or v6e chip described by libtpu, which also says what each
chip would hold (`memory_analysis`). They need libtpu (`pip install etjax[tpu]`; `make test`
installs it) and skip without it.

The model is SmolLM2-135M's real config cut to two layers and a 1,024-token vocabulary: the
attention kernels see SmolLM2's heads, head size and pages, and a compile costs 5-15 s of CPU
instead of 60 (the LM head and the sampling over 49,152 tokens dominate it; at 4,096 tokens a
burst took twice as long). 1,024 still takes the sampler's 256 candidates from each of a 1x4
mesh's vocabulary shards (etjax/distributed/topk.py), as the full vocabulary does.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from etjax.errors import ConfigError
from etjax.loaders.gguf_weights import gguf_model_config, open_gguf
from etjax.planning.pool import pool_plan
from etjax.planning.programs import (
    burst_call,
    compile_only_backend,
    compile_program,
    mosaic_kernels,
)
from etjax.planning.topology import LIBTPU_FOR_JAX, Topology
from etjax.pruning.config import PruningConfig
from etjax.runtime.options import RuntimeOptions
from pallas_kernels.block_sparse.pallas_tpu import block_sparse_attention_tpu
from pallas_kernels.ragged_attention import Segment, build_pass, ragged_attention_xla
from pallas_kernels.ragged_attention.pallas_tpu import ragged_pass_tpu

pytestmark = [
    pytest.mark.tpu_compile,
    # The extra pins the libtpu of one jax release (LIBTPU_FOR_JAX); with another jax (the GPU
    # machine's) that libtpu is not the one its compiler was built with, so nothing is compiled.
    pytest.mark.skipif(
        importlib.util.find_spec("libtpu") is None or jax.__version__ not in LIBTPU_FOR_JAX,
        reason="needs the libtpu of this jax: pip install etjax[tpu]",
    ),
]

NUM_PAGES = 64
BLOCK_SPARSE = "block_sparse_attention_tpu"
RAGGED = "ragged_attention_tpu"


@pytest.fixture(scope="module")
def cfg(smollm2_path):
    full = gguf_model_config(open_gguf(smollm2_path), "bfloat16")
    return dataclasses.replace(full, num_layers=2, vocab_size=1024)


def _options(pruning: bool, kv_dtype: str = "model") -> RuntimeOptions:
    chosen = PruningConfig(enabled=pruning)
    return RuntimeOptions(pruning=chosen, max_batch_size=4, max_prefill_rows=2, kv_dtype=kv_dtype)


def _weight_bytes(cfg) -> int:
    # SmolLM2's parameters by hand: tied embedding, per layer q|k|v and o projections, gate,
    # up and down in bfloat16 (2 bytes), two norms in float32 (etjax keeps norms at 4); the
    # final norm.
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    layer = d * (q + 2 * kv) + q * d + 3 * d * f
    norms = cfg.num_layers * 2 * d + d
    return 2 * (cfg.vocab_size * d + cfg.num_layers * layer) + 4 * norms


def _pool_bytes(cfg, itemsize: int = 2, pages: int = NUM_PAGES) -> int:
    # Keys and values [layers, pages, kv heads, page size, head dim], 16-token pages, and the
    # float32 key bounds (min and max) [layers, pages, kv heads, head dim].
    kv = 2 * cfg.num_layers * pages * cfg.num_kv_heads * 16 * cfg.head_dim * itemsize
    return kv + 2 * cfg.num_layers * pages * cfg.num_kv_heads * cfg.head_dim * 4


def _check_memory(report, cfg, pages: int = NUM_PAGES) -> None:
    # The arguments are the weights, the pool, the row store (three [rows, vocab] arrays, 9
    # bytes a token: 9 rows of an engine of 4) and the call's small inputs; the chip's tiled
    # layouts pad some of them, hence the upper bound.
    floor = _weight_bytes(cfg) + _pool_bytes(cfg, pages=pages)
    store = 9 * cfg.vocab_size * 9
    assert floor <= report.argument_bytes <= 1.25 * floor + 2 * store
    # The pool and the store are donated: the step writes them in place.
    assert report.alias_bytes >= _pool_bytes(cfg, pages=pages) // 2
    assert report.temp_bytes > 0 and report.compile_s > 0


def test_pruned_decode_burst_compiles_for_v6e(cfg):
    topology = Topology.parse("v6e-1")
    backend = compile_only_backend(cfg, _options(pruning=True), NUM_PAGES, topology)
    report = compile_program("decode burst", backend, burst_call(backend, 2, 40), topology)
    assert BLOCK_SPARSE in report.kernels
    _check_memory(report, cfg)


@pytest.mark.slow
def test_dense_decode_burst_compiles_for_v5e_on_the_ragged_pallas_pass(cfg):
    # Dense steps on one TPU run the Pallas pass, pages read in place (etjax/attention/seam.py).
    topology = Topology.parse("v5e-1")
    backend = compile_only_backend(cfg, _options(pruning=False), NUM_PAGES, topology)
    report = compile_program("decode burst", backend, burst_call(backend, 2, 40), topology)
    assert report.kernels == (RAGGED,)
    _check_memory(report, cfg)


def test_a_dense_burst_of_several_rows_writes_the_pool_in_place_on_a_tpu(cfg):
    # The burst's KV write once made the compiler copy the whole pool between two layouts in
    # every layer (docs/TPU.md, "int8 weights"): keys and values each padded to 128 lanes
    # there, 3.7 times the pool's laid-out bytes of scratch in all (529 MB, libtpu 0.0.42).
    # Written in place, the scratch is 1.35 times (153 MB: the layers' activations, the bounds'
    # tiles): the bound keeps a copy of the keys and values out.
    topology = Topology.parse("v5e-1")
    pages = 4096
    backend = compile_only_backend(cfg, _options(pruning=False), pages, topology)
    report = compile_program("decode burst", backend, burst_call(backend, 4, 40), topology)
    pool = dict(report.laid_out)["cache"]
    assert pool >= _pool_bytes(cfg) * pages // NUM_PAGES
    assert report.kernels == (RAGGED,)
    assert report.temp_bytes < 1.6 * pool


def test_ragged_pallas_pass_compiles_for_v6e_for_decode_and_prefill_tiles():
    # The dense kernel alone (v5e builds it in the steps of the tests around), as the engine
    # runs it (xla.py's passes on the Mosaic kernel) at SmolLM2's heads and pages, in one
    # program: a decode pass (one-token tiles, key tiles of 4 pages), a prefill pass of
    # 64-token tiles and one of 512-token tiles against 32 pages (1,536 rows a KV head,
    # three blocks: whole, it ran out of VMEM). The pool stays where it is, never copied:
    # the scratch is the queries' tiles and their outputs.
    device = Topology.parse("v6e-1").devices()[0]
    on_chip = SingleDeviceSharding(device)

    def shape(dims, dtype):
        return jax.ShapeDtypeStruct(dims, dtype, sharding=on_chip)

    def pass_shapes(q_tile, kv_tile):
        segment = Segment(0, q_tile, 500, 500 + q_tile - 1, list(range(1, 80)))
        built = build_pass(
            [segment], page_size=16, q_tile=q_tile, kv_tile=kv_tile, num_tokens=512,
            max_tiles=2, max_items=16,
        )  # fmt: skip
        return jax.tree.map(lambda a: shape(a.shape, a.dtype), built)

    def attend(q, k, v, positions, passes, window):
        kernel = ragged_pass_tpu
        return ragged_attention_xla(q, k, v, positions, passes, 16, window, 0.0, False, kernel)

    pages = shape((1024, 3, 16, 64), jnp.bfloat16)
    arguments = (shape((512, 9, 64), jnp.bfloat16), pages, pages, shape((512,), jnp.int32))
    passes = (pass_shapes(1, 4), pass_shapes(64, 4), pass_shapes(512, 32))
    with jax.default_device(device):
        compiled = jax.jit(attend).lower(*arguments, passes, shape((), jnp.int32)).compile()
    assert mosaic_kernels(compiled.as_text()) == (RAGGED,)
    pool_bytes = 1024 * 3 * 16 * 64 * 2  # 6.3 MB of keys
    assert compiled.memory_analysis().temp_size_in_bytes < pool_bytes


@pytest.mark.parametrize("chip", ["v5e-1", "v6e-1"])
def test_block_sparse_kernel_compiles_at_float16_kv(chip):
    # Mosaic refused float16 tiles ("Invalid vector type for load"); the kernel now reads them
    # as 32-bit words (pallas_kernels/block_sparse/pallas_tpu.py). The kernel alone at
    # SmolLM2's heads (9 query, 3 KV, 64 wide) and 16-token pages, the KV pool in float16
    # (kv_dtype="float16"); about a second to compile.
    device = Topology.parse(chip).devices()[0]
    on_chip = SingleDeviceSharding(device)

    def shape(dims, dtype):
        return jax.ShapeDtypeStruct(dims, dtype, sharding=on_chip)

    pages = shape((64, 3, 16, 64), jnp.float16)
    table, kept = shape((4, 8), jnp.int32), shape((4, 1, 4), jnp.int32)
    counts, lengths = shape((4, 1), jnp.int32), shape((4,), jnp.int32)
    q = shape((4, 9, 64), jnp.bfloat16)
    with jax.default_device(device):
        compiled = (
            jax.jit(block_sparse_attention_tpu)
            .lower(q, pages, pages, table, kept, counts, lengths)
            .compile()
        )
    assert BLOCK_SPARSE in mosaic_kernels(compiled.as_text())


@pytest.mark.parametrize("chip", ["v5e-1", "v6e-1"])
def test_int8_weights_enter_the_matrix_product_as_int8(chip):
    # weights="int8" (etjax/model/quantized.py): the XLA product (block_products_xla) widens
    # the int8 weight inside the product. Compiled, the product (a convolution on a TPU) takes
    # the s8 weight as its operand and the scale multiplies its float32 output; no bfloat16
    # copy of the weight exists anywhere in the module (one would cost twice the int8 bytes
    # in HBM and a read and a write a step). Llama's down projection shape; about a second.
    from pallas_kernels.block_products.xla import block_products_xla

    device = Topology.parse(chip).devices()[0]
    on_chip = SingleDeviceSharding(device)
    x = jax.ShapeDtypeStruct((8, 1024), jnp.bfloat16, sharding=on_chip)
    quants = jax.ShapeDtypeStruct((512, 1024), jnp.int8, sharding=on_chip)
    scales = jax.ShapeDtypeStruct((512, 1), jnp.float32, sharding=on_chip)

    def product(x, quants, scales):
        return block_products_xla(x, quants, scales, None, 1024, 8)

    with jax.default_device(device):
        compiled = jax.jit(product).lower(x, quants, scales).compile()
    hlo = compiled.as_text()
    products = [line for line in hlo.splitlines() if " convolution(" in line or " dot(" in line]
    assert products, hlo
    # The fused computation holding the product takes the weight as s8 and nothing widens it
    # to a whole bfloat16 or float32 matrix.
    assert "s8[512,1024]" in hlo
    for wide in ("bf16[512,1024]", "f32[512,1024]"):
        assert wide not in hlo
    memory = compiled.memory_analysis()
    assert memory.argument_size_in_bytes < 512 * 1024 * 1.1 + 8 * 1024 * 2 + 512 * 4 * 128
    assert memory.temp_size_in_bytes < 512 * 1024  # less than the int8 weight itself


def test_one_token_s_int8_embedding_row_is_read_where_the_table_lies():
    # A batch-1 step embeds one token. Gathering a single row of Llama-3.1-8B's int8 table
    # (s8[128256, 4096], 0.53 GB), XLA:TPU copied the whole table into another tiling every
    # step (0.53 GB of scratch); embedding_rows gathers such a row as two, which it reads in
    # place. Abstract shapes: nothing is allocated; about 3 s.
    from etjax.model.quantized import INT8, QuantizedWeight, embedding_rows

    device = Topology.parse("v5e-1").devices()[0]
    on_chip = SingleDeviceSharding(device)
    vocab, width = 128256, 4096
    table = QuantizedWeight(
        quants=jax.ShapeDtypeStruct((vocab, width), jnp.int8, sharding=on_chip),
        scales=jax.ShapeDtypeStruct((vocab, 1), jnp.float32, sharding=on_chip),
        offsets=None,
        format=INT8,
        shape=(vocab, width),
    )
    token = jax.ShapeDtypeStruct((1,), jnp.int32, sharding=on_chip)
    with jax.default_device(device):
        compiled = jax.jit(lambda t, i: embedding_rows(t, i, jnp.bfloat16)).lower(table, token)
        memory = compiled.compile().memory_analysis()
    assert memory.temp_size_in_bytes < 1 << 20  # the table's copy took 525 MB


def test_float16_kv_is_refused_on_a_tpu_by_name(cfg):
    # The kernel reads float16 tiles (above), but Mosaic takes no float16 operand: the pool
    # would reach it through a conversion XLA makes a copy of the whole pool at every layer
    # (a 2-layer burst's temporaries grew by 2.25x the pool: docs/TPU.md).
    options = _options(pruning=True, kv_dtype="float16")
    with pytest.raises(ConfigError, match=r"kv_dtype='float16' on a TPU.*bfloat16"):
        compile_only_backend(cfg, options, NUM_PAGES, Topology.parse("v5e-1"))


@pytest.mark.parametrize(
    "pruning", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["dense", "pruned"]
)
def test_burst_compiles_for_a_2x2_v5e_mesh(cfg, pruning):
    # Four chips, weights and pool split over the model axis as the engine splits them. The
    # block-sparse Pallas kernel is one custom call the SPMD partitioner cannot split
    # ("Mosaic kernels cannot be automatically partitioned"), so a mesh runs the XLA loop.
    topology = Topology.parse("v5e:2x2")
    options = dataclasses.replace(_options(pruning=pruning), mesh="1x4")
    backend = compile_only_backend(cfg, options, NUM_PAGES, topology)
    assert backend.attention_backend.name == "xla"
    report = compile_program("decode burst", backend, burst_call(backend, 2, 40), topology)
    assert report.kernels == ()
    # The Megatron split sums each layer's attention and MLP outputs over the chips: an
    # all-reduce of a [rows, hidden] bfloat16 block (2 x 576 x 2 bytes) among them.
    kinds = {kind: size for kind, _, size in report.collectives}
    assert kinds["all-reduce"] >= 2 * 576 * 2
    # Read a layer at a time (programs.py `layer_collectives`), the two projections the
    # split sums, the attention's output and the MLP's down projection, are each an
    # all-reduce of the burst's 2 rows x 576 in bfloat16, by hand 4,608 bytes a layer.
    layer = {(kind, op): size for kind, op, size in report.layer_collectives}
    assert layer["all-reduce", "dot_general"] == 2 * (2 * 576 * 2)
    # Each chip holds a quarter of the split weights (the norms whole), far under all of them.
    assert report.argument_bytes < 0.5 * (_weight_bytes(cfg) + _pool_bytes(cfg))


def test_the_engine_on_a_v5e_sizes_its_pool_from_the_compiled_programs_and_the_hbm(cfg):
    # The pool an engine on one v5e would allocate (etjax/planning/pool.py: `etjax plan`'s
    # path over the engine's devices and options), pruned, 4 rows, the default token budget
    # (a 508-token prompt chunk: the long prefill tiles that once ran out of VMEM).
    # Rows of up to 4K tokens (max_context: the engine plans for them, not the model's 8K).
    options = dataclasses.replace(_options(pruning=True), hbm_fraction=0.9, max_context=4096)
    sized = pool_plan(cfg, options, Topology.parse("v5e-1").devices())
    assert sized.compiled_layers == 2 and sized.errors == ()
    assert [r.name for r in sized.programs] == ["decode burst", "ragged step"]
    for report in sized.programs:
        # Built by Mosaic for the chip, not interpreted: the pruned decode rows' kernel (and,
        # below, the dense pass reading the prefill chunk's pages in place); the bytes against
        # a count by hand of the 1,152-page pool (the 1,029 pages asked, in whole tiles).
        assert BLOCK_SPARSE in report.kernels
        _check_memory(report, cfg, pages=1152)
        # The weights, pool and store in the compiler's layouts are its arguments, but for
        # the call's small inputs (the tokens, positions and passes: 92 KB beside a
        # 508-token chunk).
        laid_out = sum(size for _, size in report.laid_out)
        assert laid_out <= report.argument_bytes <= laid_out + 256 * 1024
    assert RAGGED in sized.programs[1].kernels
    # Against a count by hand: 90% of the chip's 16 GiB less the weights (the parameter
    # count), the row store and the larger program's scratch and code, over a page's keys,
    # values and key bounds (their shapes).
    programs = max(r.temp_bytes + r.code_bytes for r in sized.programs)
    assert sized.program_bytes_per_chip == programs
    store = 9 * cfg.vocab_size * 9  # 2 x 4 resident rows and the pad row, 9 bytes a token
    page = _pool_bytes(cfg) / NUM_PAGES
    by_hand = (0.9 * 16 * 2**30 - _weight_bytes(cfg) - store - programs) / page
    assert 0.99 * by_hand <= sized.max_pool_pages <= by_hand
    # XLA puts a pool's page axis minor-most, in 128-wide tiles: the pool is whole tiles,
    # and the 1,029 pages the 4 rows of 4K ask for (the null page too) take 1,152's room.
    assert sized.max_pool_pages % 128 == 0
    assert sized.kv_pool_pages == 4 * 257 + 1
    assert sized.kv_pool_bytes_per_chip >= 1152 * page
    # A fraction leaving less than the weights is refused by name.
    with pytest.raises(ConfigError, match="the KV pool"):
        small = dataclasses.replace(options, hbm_fraction=0.0005)
        pool_plan(cfg, small, Topology.parse("v5e-1").devices())
