"""`etjax plan` counted by hand (etjax/planning/plan.py): the bytes a chip holds, the pool and
batch that remain, the modelled decode step, the JSON the command prints.

These plans compile nothing (`compile_programs=False`): the TPU compiler's side is
tests/test_tpu_compile.py. Sharded plans name a topology's devices and need libtpu.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jax
import pytest

from etjax.cli import main
from etjax.planning.plan import plan
from etjax.planning.programs import collectives, layer_collectives, mosaic_kernels
from etjax.planning.topology import LIBTPU_FOR_JAX

CONFIGS = Path(__file__).parent.parent / "configs" / "models" / "plan"
LLAMA_8B = CONFIGS / "llama-3.1-8b.json"
GIB = 2**30
needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None or jax.__version__ not in LIBTPU_FOR_JAX,
    reason="needs the libtpu of this jax: pip install etjax[tpu]",
)

# Llama-3.1-8B's published sizes (configs/models/plan/llama-3.1-8b.json).
D, F, LAYERS, HEADS, KV_HEADS, HD, VOCAB = 4096, 14336, 32, 32, 8, 128, 128256


def _llama_8b_weight_bytes() -> int:
    # Untied embedding and LM head; per layer q, k, v, o, gate, up and down in bfloat16 (2
    # bytes a parameter), two norms in float32 (etjax keeps norms at 4); the final norm.
    layer = D * (HEADS * HD + 2 * KV_HEADS * HD) + HEADS * HD * D + 3 * D * F
    norms = LAYERS * 2 * D + D
    return 2 * (2 * VOCAB * D + LAYERS * layer) + 4 * norms


def _page_bytes(kv_heads: int) -> int:
    # One 16-token page of keys and values (bfloat16) and its float32 key bounds (min, max).
    return 2 * LAYERS * kv_heads * 16 * HD * 2 + 2 * LAYERS * kv_heads * HD * 4


def _state_bytes(rows: int) -> int:
    # The row store: logits (float32), token counts (int32) and prompt mask (bool) per row
    # over the vocabulary, for 2 x batch resident rows and the pad row.
    return (2 * rows + 1) * VOCAB * 9


def test_llama_8b_on_one_v5e_leaves_about_a_gigabyte_beside_its_weights():
    p = plan(LLAMA_8B, "v5e-1", batch=8, context=4096, compile_programs=False)
    assert p.weights_bytes == p.weights_bytes_per_chip == _llama_8b_weight_bytes()
    assert 0.9e9 < 16 * GIB - p.weights_bytes < 1.2e9  # 1.12 GB
    # 8 rows of 4K tokens ask for 4.8 GB of pool: it does not fit, and the plan says what
    # does: the pool left in 95% of the HBM beside the weights and the row state.
    assert not p.fits
    room = 0.95 * 16 * GIB - _llama_8b_weight_bytes() - _state_bytes(8)
    pages = room / _page_bytes(KV_HEADS)
    assert p.max_pool_pages == pytest.approx(pages, rel=0.05)
    assert p.max_batch(4096) == 0
    assert p.max_context == pytest.approx((pages - 1) // 8 * 16, rel=0.05)
    assert any("shorter context" in s for s in p.suggestions())


@needs_libtpu
def test_llama_8b_on_eight_v5e_chips_fits_with_the_pool_split_by_kv_head():
    p = plan(LLAMA_8B, "v5e-8", batch=64, context=4096, compile_programs=False)
    assert p.mesh == "1x8" and p.fits
    # Every weight but the norms splits eight ways; each chip holds one of the 8 KV heads.
    assert p.weights_bytes_per_chip == pytest.approx(_llama_8b_weight_bytes() / 8, rel=0.001)
    pool_pages = 64 * -(-(4096 + 8) // 16) + 1  # each row's pages, a burst ahead, null page
    assert p.kv_pool_bytes_per_chip == pytest.approx(pool_pages * _page_bytes(1), rel=0.05)
    room = 0.95 * 16 * GIB - _llama_8b_weight_bytes() / 8 - _state_bytes(64) / 8
    assert p.max_pool_pages == pytest.approx(room / _page_bytes(1), rel=0.05)


def _llama_8b_int8_bytes() -> int:
    # weights="int8": every matrix [out, in] (projections, the embedding, the LM head) as one
    # int8 a weight and a float32 scale an output row; the norms stay float32.
    shapes = [(VOCAB, D)] * 2 + LAYERS * [
        (HEADS * HD, D), (KV_HEADS * HD, D), (KV_HEADS * HD, D), (D, HEADS * HD),
        (F, D), (F, D), (D, F),
    ]  # fmt: skip
    norms = LAYERS * 2 * D + D
    return sum(out * width + 4 * out for out, width in shapes) + 4 * norms


def test_int8_weights_hold_llama_8b_in_half_a_v5e_with_gigabytes_of_pool_beside(capsys):
    p = plan(LLAMA_8B, "v5e-1", batch=8, context=4096, compile_programs=False, weights="int8")
    assert p.weights_bytes == p.weights_bytes_per_chip == _llama_8b_int8_bytes()  # 8.03 GB
    # bfloat16 left no row of 4K (above); int8 leaves a pool of over 2 GB (8.2 GB, 13 rows).
    room = 0.95 * 16 * GIB - _llama_8b_int8_bytes() - _state_bytes(8)
    assert p.max_pool_pages * _page_bytes(KV_HEADS) > 2e9
    assert p.max_pool_pages == pytest.approx(room / _page_bytes(KV_HEADS), rel=0.01)
    # A decode step reads the int8 weights once, as held (the count by hand above).
    kv = 8 * 4096 * 2 * LAYERS * KV_HEADS * HD * 2
    assert p.modelled["dense"]["weight_bytes"] == _llama_8b_int8_bytes()
    assert p.modelled["dense"]["step_bytes"] == pytest.approx(
        p.modelled["dense"]["weight_bytes"] + kv, rel=1e-6
    )
    argv = ["plan", str(LLAMA_8B), "--weights", "int8", "--no-compile", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["weights"] == "int8" and out["weights_bytes"] == _llama_8b_int8_bytes()
    # The engine's pool sizing (etjax/planning/pool.py) passes the weights it loaded: an int8
    # tree counts as the option does.
    from etjax.model.weights import abstract_weights
    from etjax.planning.plan import _options, model_config, plan_config
    from etjax.planning.topology import Topology

    cfg, topo = model_config(LLAMA_8B, "bfloat16"), Topology.parse("v5e-1")
    tree = abstract_weights(cfg, "int8")
    held = plan_config(cfg, topo, _options(None, topo, 8, None, None, None), 4096,
                       compile_programs=False, weights=tree)  # fmt: skip
    assert held.weights == "int8" and held.weights_bytes == _llama_8b_int8_bytes()
    # A file's own blocks are not planned: refused by name.
    from etjax.errors import ConfigError

    with pytest.raises(ConfigError, match="weights='stored'"):
        plan(LLAMA_8B, "v5e-1", compile_programs=False, weights="stored")


def test_modelled_decode_reads_the_weights_once_and_each_rows_kv():
    # Llama-3.1-8B, 64 rows of 2K tokens on a v6e: HBM-bound; a step reads the weights once
    # as held (8,030,261,248 parameters, the matrices at 2 bytes, the norms at 4: counted by
    # hand in `_llama_8b_weight_bytes`) and every row's 128 pages
    # (the roofline at 1.64 TB/s): on one chip the engine's dense step is the Pallas pass,
    # reading the pages in place (128 pages, whole key tiles of 4: no padding); the XLA
    # kernel, which a mesh runs, moves that KV three times.
    p = plan(LLAMA_8B, "v6e-1", batch=64, context=2048, compile_programs=False)
    weights, kv = _llama_8b_weight_bytes(), 64 * 2048 * 2 * LAYERS * KV_HEADS * HD * 2
    dense, gather = p.modelled["dense"], p.modelled["dense_xla_gather"]
    assert dense == p.modelled["dense_in_place"]
    assert dense["bound"] == gather["bound"] == "memory"
    assert dense["step_bytes"] == pytest.approx(weights + kv, rel=1e-6)
    assert dense["tokens_per_s"] == pytest.approx(64 / ((weights + kv) / 1640e9), rel=1e-6)
    assert gather["step_bytes"] == pytest.approx(weights + 3 * kv, rel=1e-6)
    # Pruned at the floor: 20% of the 128 blocks (26, above the sink and recent floor), and
    # the float32 key bounds (min and max) of all 128 pages.
    pruned = p.modelled["pruned"]
    bounds = 128 * 2 * LAYERS * KV_HEADS * HD * 4
    assert pruned["blocks_read"] == 26
    assert pruned["step_bytes"] == pytest.approx(weights + 64 * (kv / 64 * 26 / 128 + bounds))
    # A row of 2,049 tokens (129 pages) reads its last key tile whole: 132 pages, within
    # the 1.1x of the KV it needs.
    p = plan(LLAMA_8B, "v6e-1", batch=64, context=2049, compile_programs=False)
    assert p.modelled["dense"]["blocks_read"] == 132


def test_the_command_prints_one_json_object_and_says_what_would_fit(capsys):
    code = main(["plan", str(CONFIGS / "llama-3.1-70b.json"), "--topology", "v5e-1",
                 "--no-compile", "--json"])  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("fits", "chips", "hbm_bytes_per_chip", "weights_bytes",
                "weights_bytes_per_chip", "kv_pool_bytes_per_chip", "programs",
                "modelled_decode_tokens_per_s"):  # fmt: skip
        assert key in out
    assert out["fits"] is False and out["chips"] == 1 and out["programs"] == []
    assert out["hbm_bytes_per_chip"] == 16 * GIB
    # 141 GB of weights: no one-host v5e slice holds them.
    assert out["weights_bytes"] > 8 * 16 * GIB
    assert any("v6e" in s for s in out["suggestions"])


def test_a_bad_topology_is_named(capsys):
    assert main(["plan", str(LLAMA_8B), "--topology", "v4-3", "--no-compile"]) == 2
    assert "topology 'v4-3'" in capsys.readouterr().err


def test_compiled_modules_are_read_for_kernels_and_collectives():
    # Lines in the form XLA:TPU prints them (tests/test_tpu_compile.py compiles real ones).
    hlo = "\n".join(
        [
            "  %block_sparse_attention_tpu.16 = (bf16[4,3,3,64]{3,2,1,0}, f32[4,3,8,3]{3,2,1,0})"
            ' custom-call(%a, %b), custom_call_target="tpu_custom_call", backend_config={}',
            '  %custom-call.89 = s32[1024]{0} custom-call(%p), custom_call_target="Other"',
            "  %all-reduce.42 = bf16[2,576]{1,0:T(2,128)(2,1)S(1)} all-reduce(%f), channel_id=93",
            "  %cp = (f32[2,3]{1,0}, f32[2,3]{1,0}, u32[]{:S(2)}) collective-permute-start(%s)",
            "  %all-reduce.9 = f32[2]{0:T(128)S(1)} all-reduce(%r), channel_id=13",
        ]
    )
    assert mosaic_kernels(hlo) == ("block_sparse_attention_tpu",)
    reduce, permute = ("all-reduce", 2, 2 * 576 * 2 + 2 * 4), ("collective-permute", 1, 2 * 3 * 4)
    assert collectives(hlo) == (reduce, permute)


def test_a_layers_collectives_are_told_from_the_steps_by_their_source_ops():
    # A burst's lines as XLA:TPU prints them on a 1x4 mesh (tests/test_tpu_compile.py
    # compiles real ones): the steps' scan, then the layer scan; each layer's two row-split
    # projections in its branch of the layer switch, an all-reduce of [2, 576] bfloat16 each;
    # an attention loop inside the layer; the sampling's all-gather outside the layers.
    step = "jit(decode_steps)/while/body/closed_call/cond/branch_1_fun"
    layer = f"{step}/while/body/closed_call"
    mesh = "replica_groups=mesh['axis_0'=1,'axis_1'=4] {'axis_1'}"
    hlo = "\n".join(
        [
            f"  %all-reduce.{i} = bf16[2,576]{{1,0}} all-reduce(%f), {mesh}, "
            f'metadata={{op_name="{layer}/cond/branch_{b}_fun/...i,oi->...o/dot_general"}}'
            for i, b in enumerate([0, 0, 1, 1])
        ]
        + [
            f"  %all-reduce.9 = f32[4,3,3,64]{{3,2,1,0}} all-reduce(%s), {mesh}, "
            f'metadata={{op_name="{layer}/while/body/ckrd,cksd->ckrs/dot_general"}}',
            f"  %all-gather.1 = s32[2,4096]{{1,0}} all-gather(%i), {mesh}, dimensions={{1}}, "
            f'metadata={{op_name="{step}/sort"}}',
            f"  %all-reduce.7 = (f32[2]{{0}}, f32[2]{{0}}) all-reduce(%a, %b), {mesh}, "
            f'metadata={{op_name="{step}/reduce_sum"}}',
        ]
    )
    per_layer, per_step = layer_collectives(hlo, layer_depth=2)
    loop = "dot_general (a trip of a loop in the layer)"
    assert per_layer == (
        ("all-reduce", "dot_general", 2 * 2 * 576 * 2),
        ("all-reduce", loop, 4 * 3 * 3 * 64 * 4),
    )
    # The all-gather's shard (a quarter of the gathered 2 x 4,096 int32), the tuple's arrays.
    assert per_step == (("all-gather", "sort", 2 * 4096 * 4 // 4), ("all-reduce", "reduce_sum", 16))


def test_a_folder_with_config_json_alone_is_a_model(tmp_path):
    (tmp_path / "config.json").write_text(LLAMA_8B.read_text())
    p = plan(tmp_path, "v6e-1", batch=1, context=1024, compile_programs=False)
    assert p.weights_bytes == _llama_8b_weight_bytes() and p.fits


def test_a_libtpu_other_than_jaxs_is_refused_naming_the_one_to_install(monkeypatch):
    from etjax.errors import ConfigError
    from etjax.planning import topology

    monkeypatch.setattr(topology.jax, "__version__", "0.10.2")
    monkeypatch.setattr(topology.importlib.metadata, "version", lambda name: "0.0.40")
    with pytest.raises(ConfigError, match=r'libtpu 0\.0\.40 .* pip install "libtpu==0\.0\.42\.\*"'):
        topology.check_libtpu()


def test_off_a_tpu_the_engine_sizes_its_pool_as_before():
    # The TPU sizing (etjax/planning/pool.py) compiles nothing on a CPU: the builder's own
    # sizing stands. The HBM share is checked where it is set.
    from etjax.errors import FieldError
    from etjax.planning.plan import model_config
    from etjax.planning.pool import device_pool_pages
    from etjax.runtime.options import RuntimeOptions

    assert device_pool_pages(model_config(LLAMA_8B, "bfloat16"), RuntimeOptions()) is None
    for bad in (0, 1.5, True, "0.9"):
        with pytest.raises(FieldError, match=r"hbm_fraction=.*must be a number in \(0, 1\]"):
            RuntimeOptions(hbm_fraction=bad)


def test_a_compiler_crash_is_an_error_naming_the_program_the_topology_and_the_signal(
    capsys, monkeypatch
):
    # For a described topology each program is compiled in a child process
    # (etjax/planning/isolation.py): libtpu 0.0.42 once died of a SIGSEGV compiling a sharded
    # v6e program, which took `etjax plan` down with it. A stand-in child kills itself with
    # SIGSEGV through the same helper (no libtpu, well under a second), and the other program
    # is refused by the compiler as a too large one was (the ragged pass's tables past the
    # chip's 1 MiB of scalar memory, docs/TPU.md): the plan is printed without the programs,
    # `fits` not known, each error named, and the command exits 1.
    import signal

    from etjax.planning import isolation
    from etjax.planning import plan as planning

    with pytest.raises(isolation.CompilerCrash, match=r"doing x: .* SIGSEGV \(signal 11\)"):
        isolation.run_isolated(signal.raise_signal, signal.SIGSEGV, what="doing x")
    # A child's exception comes back as itself, and its result as itself.
    with pytest.raises(ZeroDivisionError):
        isolation.run_isolated(divmod, 1, 0, what="dividing")
    assert isolation.run_isolated(divmod, 7, 2, what="dividing") == (3, 1)

    smem = (
        "RESOURCE_EXHAUSTED: Ran out of memory in memory space smem.\n 1. Size: 816.0K\n"
        "    Shape: s32[208896]{0}\n    XLA label: ragged_attention_tpu.9 = custom-call(...)"
    )

    def failing(function, name, *args, what, env):
        assert function is planning.compile_planned and env["JAX_PLATFORMS"] == "cpu"
        if name == "decode burst":
            raise isolation.ChildError("JaxRuntimeError", smem)
        return isolation.run_isolated(signal.raise_signal, signal.SIGSEGV, what=what)

    monkeypatch.setattr(planning, "run_isolated", failing)
    monkeypatch.setattr(planning, "check_libtpu", lambda: None)
    argv = ["plan", str(LLAMA_8B), "--topology", "v6e-1", "--batch", "1", "--json"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["fits"] is None and out["programs"] == []
    assert out["weights_bytes"] == _llama_8b_weight_bytes()
    refused, crashed = out["errors"]
    assert refused.startswith("the TPU compiler refused the decode burst for v6e-1")
    assert "memory space smem" in refused
    assert "(the largest allocation: s32[208896]{0} of ragged_attention_tpu.9)" in refused
    assert crashed.startswith("the TPU compiler crashed compiling the ragged step for v6e-1")
    assert "SIGSEGV (signal 11)" in crashed
    assert f"etjax: error: {crashed}" in captured.err
    # libtpu's own report is kept from its "*** SIG..." line, and a crash in the SparseCore
    # code generation (the one seen, libtpu 0.0.42) comes with the flag that leaves it out.
    stderr = "noise\n*** SIGSEGV STACK OVERFLOW ***\n@ 0x1 xla::tpu::sparse_core::Run()"
    report = isolation.crash_report(stderr)
    assert report.startswith("*** SIGSEGV") and "noise" not in report
    assert planning.SPARSE_CORE_OFF in planning._report(report)
