"""`etjax plan`: whether a model fits a TPU topology with an engine's settings, what each chip
holds, the largest pool, batch and context that fit, and a modelled decode speed.

The weights, the KV pool and the row store are counted from their shapes and the shardings the
engine gives them (etjax/distributed/placement.py), per chip; the programs' temporaries come
from the TPU compiler, which builds the engine's own step programs for the topology
(programs.py). The programs are compiled at a reduced depth (`layers`, default 2): their
weights and pool at full depth are counted, not compiled, and a step's scratch does not grow
with its depth (one layer's buffers are reused by the next). The decode speed is a roofline
model, not a measurement: a step reads the weights once and each row's KV (the cost model's
bytes and FLOPs, etjax/entropy/cost.py), at the chip's published HBM bandwidth and peak FLOPs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from etjax.attention.backend import resolve_backend
from etjax.cache.kv_cache import init_kv_cache
from etjax.cache.page_allocator import pages_needed
from etjax.distributed.mesh import MeshShape, make_mesh
from etjax.distributed.placement import Placement
from etjax.engine.row_store import empty_store
from etjax.entropy.cost import CostModel
from etjax.errors import ConfigError, ModelLoadError
from etjax.model.config import ModelConfig
from etjax.model.quantized import STORED_CHOICES, check_weights, resolve_weights, weight_formats
from etjax.model.weights import Weights, abstract_weights, routed_expert_bytes
from etjax.planning.isolation import ChildError, CompilerCrash, run_isolated
from etjax.planning.programs import PROGRAMS, ProgramReport, compile_planned
from etjax.planning.topology import Topology, check_libtpu, libtpu_version
from etjax.pruning.budget import kept_block_count
from etjax.run_config import load_run_config
from etjax.runtime.options import RuntimeOptions
from pallas_kernels.ragged_attention.tiles import DECODE_KV_TILE

# XLA lays a KV pool out with its page axis minor-most, in tiles of this many pages
# (tests/test_tpu_compile.py): a pool takes the room of a whole number of them.
POOL_TILE_PAGES = 128

# The dense XLA kernel moves a row's KV three times a layer: it reads the pages to gather
# them, writes the contiguous copy and reads that (pallas_kernels/ragged_attention/xla.py). A
# TPU's engine runs it on a mesh; on one chip the Pallas pass reads the pages in place.
XLA_GATHER_TRAFFIC = 3


@dataclass(frozen=True)
class Plan:
    """What `plan` found; `as_dict` is `etjax plan --json`."""

    model: str
    topology: Topology
    mesh: str
    dtype: str
    kv_dtype: str
    batch: int
    context: int
    page_size: int
    max_position: int  # the model's longest context
    pruning: bool
    weights_bytes: int  # all chips, each weight once
    weights_bytes_per_chip: int
    kv_bytes_per_page_per_chip: int
    kv_pool_pages: int  # the pool the batch and context ask for, null page included
    state_bytes_per_chip: int
    programs: tuple[ProgramReport, ...]
    compiled_layers: int
    full_layers: int  # the model's layers
    hbm_fraction: float
    modelled: dict  # "dense" and, under pruning, "pruned": step seconds and tokens/s
    weights: str = ""  # how the matrices are held: "int8", or a float dtype ("": `dtype`)
    # The programs the TPU compiler could not build, each a message naming the program and
    # the topology and why: it crashed (`CompilerCrash`: the signal) or refused the program
    # (ran out of a memory, rejected a kernel). Their scratch is not counted.
    errors: tuple[str, ...] = ()

    @property
    def chips(self) -> int:
        return self.topology.chips

    @property
    def hbm_bytes_per_chip(self) -> int:
        return self.topology.chip.hbm_bytes

    @property
    def kv_pool_bytes_per_chip(self) -> int:
        return self._laid_out_pages(self.kv_pool_pages) * self.kv_bytes_per_page_per_chip

    def _laid_out_pages(self, pages: int) -> int:
        # Compiled, a pool takes the room of whole tiles of `POOL_TILE_PAGES` pages.
        tile = POOL_TILE_PAGES if self.programs else 1
        return -(-pages // tile) * tile

    @property
    def program_bytes_per_chip(self) -> int:
        """The largest program's scratch and code (0 when none was compiled)."""
        return max((p.temp_bytes + p.code_bytes for p in self.programs), default=0)

    @property
    def usable_bytes_per_chip(self) -> int:
        return int(self.hbm_bytes_per_chip * self.hbm_fraction)

    @property
    def fixed_bytes_per_chip(self) -> int:
        """Everything but the pool: weights, row store, the programs' scratch and code."""
        return self.weights_bytes_per_chip + self.state_bytes_per_chip + self.program_bytes_per_chip

    @property
    def total_bytes_per_chip(self) -> int:
        return self.fixed_bytes_per_chip + self.kv_pool_bytes_per_chip

    @property
    def fits(self) -> bool | None:
        """Whether everything fits `hbm_fraction` of a chip; None (not known) where a program
        failed to compile (`errors`) and what was counted without its scratch fits."""
        counted = self.total_bytes_per_chip <= self.usable_bytes_per_chip
        return None if counted and self.errors else counted

    @property
    def max_pool_pages(self) -> int:
        """The largest pool (pages, null page included) beside everything else; compiled,
        whole tiles of `POOL_TILE_PAGES` pages (those it takes the room of)."""
        room = self.usable_bytes_per_chip - self.fixed_bytes_per_chip
        pages = max(room // self.kv_bytes_per_page_per_chip, 0)
        tile = POOL_TILE_PAGES if self.programs and pages >= POOL_TILE_PAGES else 1
        return pages // tile * tile

    def max_batch(self, context: int) -> int:
        """The most rows of `context` tokens the largest pool holds."""
        return max(self.max_pool_pages - 1, 0) // pages_needed(context, self.page_size)

    @property
    def max_context(self) -> int:
        """The longest context each of `batch` rows can have in the largest pool."""
        pages = max(self.max_pool_pages - 1, 0) // self.batch
        return min(pages * self.page_size, self.max_position)

    def step_collective_bytes(self, program: ProgramReport) -> int:
        """Bytes a chip's collectives move in one step of `program` at the model's full
        depth: each layer's (`layer_collectives`, a loop's inside a layer counted once) and
        the step's own."""
        per_layer = sum(size for _, _, size in program.layer_collectives)
        return self.full_layers * per_layer + sum(size for _, _, size in program.step_collectives)

    def suggestions(self) -> list[str]:
        """What would fit, when this does not."""
        if self.fits is not False:
            return []
        out = []
        if self.weights_bytes_per_chip > self.usable_bytes_per_chip:
            per_chip = self.weights_bytes / self.usable_bytes_per_chip
            chips = next((n for n in (1, 4, 8) if n > per_chip * 1.1), None)
            if chips and chips > self.chips:
                out.append(f"more chips: {self.topology.chip.name}-{chips} (weights split)")
            elif self.topology.chip.name == "v5e":
                out.append("a chip with more HBM: v6e (32 GiB a chip)")
            if self.dtype == "float32":
                out.append("a smaller dtype: --dtype bfloat16 (half the weights)")
            if (self.weights or self.dtype) != "int8":
                out.append("int8 weights: --weights int8 (one byte a weight)")
            if not out:
                out.append("more than one host's chips (not planned here)")
            return out
        if self.max_batch(self.context) >= 1:
            out.append(f"a smaller batch: {self.max_batch(self.context)} at {self.context} tokens")
        if self.max_context >= self.page_size:
            out.append(f"a shorter context: {self.max_context} tokens at batch {self.batch}")
        if (self.weights or self.dtype) != "int8":
            out.append("int8 weights: --weights int8 (one byte a weight, more room for the pool)")
        out.append(f"more chips than {self.chips} (the KV pool split by head)")
        return out

    def as_dict(self) -> dict:
        """The plan as `etjax plan --json` prints it."""
        return {
            "model": self.model,
            "topology": self.topology.name,
            "mesh": self.mesh,
            "dtype": self.dtype,
            "kv_dtype": self.kv_dtype,
            "weights": self.weights or self.dtype,
            "fits": self.fits,
            "chips": self.chips,
            "hbm_bytes_per_chip": self.hbm_bytes_per_chip,
            "weights_bytes": self.weights_bytes,
            "weights_bytes_per_chip": self.weights_bytes_per_chip,
            "kv_pool_bytes_per_chip": self.kv_pool_bytes_per_chip,
            "state_bytes_per_chip": self.state_bytes_per_chip,
            "program_bytes_per_chip": self.program_bytes_per_chip,
            "batch": self.batch,
            "context": self.context,
            "page_size": self.page_size,
            "max_kv_pool_bytes_per_chip": self.max_pool_pages * self.kv_bytes_per_page_per_chip,
            "max_batch_at_context": self.max_batch(self.context),
            "max_context_at_batch": self.max_context,
            "hbm_fraction": self.hbm_fraction,
            "compiled_layers": self.compiled_layers,
            "programs": [
                {
                    "name": p.name,
                    "compile_s": round(p.compile_s, 2),
                    "compile_cpu_s": round(p.compile_cpu_s, 2),
                    "temp_bytes": p.temp_bytes,
                    "code_bytes": p.code_bytes,
                    "argument_bytes": p.argument_bytes,
                    "kernels": list(p.kernels),
                    "collectives": [
                        {"kind": kind, "count": n, "bytes": size} for kind, n, size in p.collectives
                    ],
                    "layer_collectives": [
                        {"kind": kind, "after": op, "bytes": size}
                        for kind, op, size in p.layer_collectives
                    ],
                    "step_collective_bytes": self.step_collective_bytes(p),
                }
                for p in self.programs
            ],
            "modelled_decode_tokens_per_s": self.modelled["dense"]["tokens_per_s"],
            "modelled": self.modelled,
            "suggestions": self.suggestions(),
            "errors": list(self.errors),
        }


def plan(
    model: str | Path,
    topology: str = "v5e-1",
    dtype: str = "bfloat16",
    config: str | Path | None = None,
    *,
    batch: int | None = None,
    context: int | None = None,
    kv_dtype: str | None = None,
    pruning: bool | None = None,
    mesh: str | None = None,
    layers: int = 2,
    compile_programs: bool = True,
    hbm_fraction: float | None = None,
    weights: str = "auto",
) -> Plan:
    """Plan `model` (a GGUF file, or an HF folder or config.json; only the config is read) on
    `topology` ("v5e-1", "v6e-8", ...) at `dtype`, with the engine options of `config` (a
    config name or .toml path; default "default") and these overrides: `batch` rows of
    `context` tokens (default the config's `max_batch_size`, and 4096 or the model's context),
    `kv_dtype`, `pruning`, `mesh` ("DATAxMODEL"; default all chips on `model`). The step
    programs are compiled with `layers` layers (0: all) unless `compile_programs` is False or
    the weights alone overflow the chips; `hbm_fraction` of each chip's HBM is planned
    (default: the config's). A program the TPU compiler crashes on (a libtpu fault, in the
    child process it is compiled in) or refuses is named in the plan's `errors`, and `fits`
    is then None unless what was counted already overflows. `weights`, as `load_model`'s option
    (etjax/model/quantized.py): how the matrices are held, "int8" (one byte a weight and a
    float32 scale an output, the programs' products XLA's int8 x `dtype` ones), "float32",
    "bfloat16" or "auto" (as a load resolves it); "stored" needs a file's blocks and is not
    planned. Needs libtpu (`pip install etjax[tpu]`)."""
    topo = Topology.parse(topology)
    cfg = model_config(model, dtype)
    options = _options(config, topo, batch, kv_dtype, pruning, mesh, hbm_fraction)
    held = planned_weights(weights, cfg.dtype)
    return plan_config(cfg, topo, options, context, layers, compile_programs, str(model), held)


def planned_weights(weights: str, dtype: str) -> str | None:
    """The `abstract_weights` option a plan counts for the load option `weights` of a model
    of `dtype`: None where the matrices stay in `dtype`."""
    held = resolve_weights(check_weights(weights), dtype)
    if held in STORED_CHOICES:
        raise ConfigError(
            f"weights={held!r} keeps a file's own blocks, which a plan does not read; plan "
            "--weights int8, bfloat16 or float32"
        )
    return None if held == dtype else held


def plan_config(
    cfg: ModelConfig,
    topo: Topology,
    options: RuntimeOptions,
    context: int | None = None,
    layers: int = 2,
    compile_programs: bool = True,
    name: str = "",
    weights: str | Weights | None = None,
) -> Plan:
    """`plan`'s work for a model config and an engine's options as they are (`plan` derives
    them from files and flags; the engine's pool sizing, pool.py, passes its own), in
    `options.hbm_fraction` of each chip's HBM, the matrices held as `weights` says: an
    `abstract_weights` option (None keeps cfg.dtype), or a loaded `Weights` tree (an engine's:
    its arrays' shapes and dtypes, whatever form they are in)."""
    hbm_fraction = options.hbm_fraction
    context = context or options.max_context or min(cfg.max_position_embeddings, 4096)
    if context <= 0:
        raise ConfigError(f"context={context}; must be a positive number of tokens")
    # The engine planned serves rows of up to `context` tokens: its programs' attention work
    # lists are sized for them (StepGeometry.max_seq_pages), not for the model's context.
    options = dataclasses.replace(options, max_context=min(context, cfg.max_position_embeddings))
    k, ps = options.steps_per_sync, options.page_size
    num_pages = options.max_batch_size * pages_needed(context + k, ps) + 1
    shape = options.mesh_shape
    # One chip places nothing; a mesh needs the topology's devices (libtpu).
    placement = None if shape.size == 1 else Placement(make_mesh(shape, topo.devices()))
    kv_dtype_name = options.kv_cache_dtype(cfg.dtype, "tpu")
    held = _held(cfg, weights)
    weights_pc = _bytes_per_chip(held, placement and placement.weights(held))
    pool = jax.eval_shape(lambda: init_kv_cache(cfg, 2, ps, 1, 1, kv_dtype_name))
    pool = pool.replace(block_mass=None)  # per row, not per page: in the state
    page_pc = _bytes_per_chip(pool, placement and placement.cache(pool)) // 2
    store = jax.eval_shape(lambda: empty_store(cfg, options.resident_rows + 1, (0,)))
    store_sharding = placement and placement.state(store, cfg.vocab_size)
    state_pc = _bytes_per_chip(store, store_sharding)
    weights_all = _tree_bytes(held)
    usable = topo.chip.hbm_bytes * hbm_fraction
    programs: tuple[ProgramReport, ...] = ()
    errors: tuple[str, ...] = ()
    compiled = 0
    if compile_programs and weights_pc + state_pc < usable:
        compiled = layers if 0 < layers < cfg.num_layers else cfg.num_layers
        # A pool of whole tiles of pages, so that its laid-out bytes a page are those of any
        # large pool (the 69 pages of a small one took 128's room).
        tiled = -(-num_pages // POOL_TILE_PAGES) * POOL_TILE_PAGES
        cut = held.replace(layers=held.layers[:compiled])
        programs, errors = _compile(_cut(cfg, compiled), options, tiled, topo, context, cut)
        if programs:
            # The pool and the row store as the compiler lays them out (its tiles pad the
            # minor dimensions), the pool scaled from the compiled layers to all of them.
            laid_out = dict(programs[0].laid_out)
            pool_pc = laid_out["cache"] * cfg.num_layers // compiled
            page_pc = max(page_pc, -(-pool_pc // tiled))
            state_pc = max(state_pc, laid_out["store"])
    return Plan(
        model=name,
        topology=topo,
        mesh=str(shape),
        dtype=cfg.dtype,
        kv_dtype=kv_dtype_name or cfg.dtype,
        batch=options.max_batch_size,
        context=context,
        page_size=ps,
        max_position=cfg.max_position_embeddings,
        pruning=options.pruning.enabled,
        weights_bytes=weights_all,
        weights_bytes_per_chip=weights_pc,
        kv_bytes_per_page_per_chip=page_pc,
        kv_pool_pages=num_pages,
        state_bytes_per_chip=state_pc,
        programs=programs,
        compiled_layers=compiled,
        full_layers=cfg.num_layers,
        hbm_fraction=hbm_fraction,
        modelled=modelled_decode(cfg, options, kv_dtype_name, topo, context, held),
        weights=_held_name(held),
        errors=errors,
    )


def model_config(model: str | Path, dtype: str) -> ModelConfig:
    """The config of a GGUF file, an HF folder or its config.json (weights are not read)."""
    path = Path(model)
    if path.suffix == ".gguf":
        from etjax.loaders.gguf_weights import gguf_model_config, open_gguf

        return gguf_model_config(open_gguf(path), dtype)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix != ".json" or not path.is_file():
        raise ModelLoadError(
            f"{model}: expected a .gguf file, a Hugging Face folder with config.json, or a "
            "config.json"
        )
    from etjax.loaders.hf_config import read_hf_config

    return read_hf_config(path, dtype)


def modelled_decode(
    cfg: ModelConfig,
    options: RuntimeOptions,
    kv_dtype: str | None,
    topology: Topology,
    context: int,
    held: Weights | None = None,
) -> dict:
    """A decode step of `max_batch_size` rows of `context` tokens on the topology's chips, by
    the roofline: max(bytes / bandwidth, FLOPs / peak) per chip, each chip reading its share of
    the weights (once per step, however many rows) and of each row's KV, four ways:

    - "dense": as the engine runs a dense step on these chips, by the attention backend it
      resolves: "dense_in_place" on one chip, "dense_xla_gather" on a mesh;
    - "dense_in_place": the Pallas pass (pallas_kernels/ragged_attention/pallas_tpu.py),
      reading each row's pages where they are, in whole key tiles of `DECODE_KV_TILE` pages
      (the last one padded with the null page);
    - "dense_xla_gather": the XLA kernel, which gathers each row's pages into a contiguous
      copy every layer: the KV is read twice and written once (`XLA_GATHER_TRAFFIC`);
    - "pruned": the block-sparse Pallas kernel at the pruning's floor (`min_fraction` of the
      blocks, with its sink and recent blocks: the most pruning saves), plus the float32 key
      bounds of every page that block selection scores.

    `held`: the weights as held (shapes; int8 or blocks read fewer bytes a step than cfg.dtype,
    the routed experts' share as held too); None: every weight in cfg.dtype."""
    cost = CostModel.for_model(
        cfg,
        options.page_size,
        kv_dtype,
        resident_bytes=None if held is None else _tree_bytes(held),
        expert_resident_bytes=None if held is None else routed_expert_bytes(held, cfg),
    )
    rows, chip, n = options.max_batch_size, topology.chip, topology.chips
    # A step of many rows reads the union of their experts (between k and all of them per
    # layer), not one row's k (etjax/entropy/cost.py).
    experts = cfg.num_experts_per_tok
    extra_experts = min(cfg.num_experts - experts, (rows - 1) * experts) if experts else 0
    weight_bytes = cost.weight_bytes + extra_experts * cost.expert_bytes
    ps = options.page_size
    blocks = pages_needed(context, ps)
    floor = np.float32(options.pruning.min_fraction)
    pruned = int(kept_block_count(floor, blocks, options.pruning, xp=np))
    bounds = blocks * 2.0 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    tiled = -(-blocks // DECODE_KV_TILE) * DECODE_KV_TILE
    ways = {  # blocks read, times the KV is moved, bytes besides
        "dense_in_place": (tiled, 1, 0.0),
        "dense_xla_gather": (blocks, XLA_GATHER_TRAFFIC, 0.0),
        "pruned": (pruned, 1, bounds),
    }
    backend = resolve_backend(options.attention_backend, "tpu", topology.chips)
    ways["dense"] = ways["dense_in_place" if backend.name == "pallas_tpu" else "dense_xla_gather"]
    out = {}
    for name, (read, traffic, extra) in ways.items():
        keys = float(cost.layer_keys(np.float32(read * ps), np.float32(context)))
        kv = rows * (traffic * cost.kv_bytes_per_key * keys + extra)
        nbytes = weight_bytes + kv
        flops = rows * (cost.matmul_flops_per_token + cost.attention_flops_per_key * keys)
        seconds = max(nbytes / n / chip.bandwidth, flops / n / chip.flops)
        out[name] = {
            "rows": rows,
            "blocks_read": read,
            "step_bytes": nbytes,
            "weight_bytes": weight_bytes,
            "kv_bytes": kv,
            "step_flops": flops,
            "step_s": seconds,
            "tokens_per_s": rows / seconds,
            "tokens_per_s_per_chip": rows / seconds / n,
            "bound": "memory" if nbytes / chip.bandwidth >= flops / chip.flops else "compute",
        }
    return out


def _options(
    config: str | Path | None,
    topo: Topology,
    batch: int | None,
    kv_dtype: str | None,
    pruning: bool | None,
    mesh: str | None,
    hbm_fraction: float | None = None,
) -> RuntimeOptions:
    options = load_run_config(config or "default").options
    changes: dict = {"mesh": mesh or f"1x{topo.chips}"}
    if hbm_fraction is not None:
        changes["hbm_fraction"] = hbm_fraction
    if batch is not None:
        changes["max_batch_size"] = batch
    if kv_dtype is not None:
        changes["kv_dtype"] = kv_dtype
    if pruning is not None:
        changes["pruning"] = dataclasses.replace(options.pruning, enabled=pruning)
    options = dataclasses.replace(options, **changes)
    if options.max_resident is not None and options.max_resident < options.max_batch_size:
        options = dataclasses.replace(options, max_resident=None)
    if options.token_budget <= options.max_batch_size:
        options = dataclasses.replace(options, token_budget=2 * options.max_batch_size)
    if MeshShape.parse(options.mesh).size != topo.chips:
        raise ConfigError(f"mesh {options.mesh} does not use the {topo.chips} chips of {topo.name}")
    return options


def _cut(cfg: ModelConfig, layers: int) -> ModelConfig:
    # The first `layers` layers: a program of the same kinds of layer (local and global,
    # dense and sparse), compiled in a fraction of the time.
    if layers >= cfg.num_layers:
        return cfg
    return dataclasses.replace(
        cfg,
        num_layers=layers,
        local_layers=tuple(i for i in cfg.local_layers if i < layers),
        dense_mlp_layers=tuple(i for i in cfg.dense_mlp_layers if i < layers),
    )


def _compile(
    cfg: ModelConfig,
    options: RuntimeOptions,
    num_pages: int,
    topo: Topology,
    context: int,
    weights: Weights,
) -> tuple[tuple[ProgramReport, ...], tuple[str, ...]]:
    # The engine's largest programs of this batch and context (`PROGRAMS`: a burst of every
    # row, and a ragged step of every row beside a chunk filling the token budget), and the
    # messages of those the compiler crashed on or refused. For a described topology each is
    # compiled in a child process (isolation.py): libtpu can die of a signal, which here
    # would end the plan; a real slice's devices (the engine's own pool sizing on a TPU host)
    # belong to this process, which compiles them itself.
    rows = options.max_batch_size
    chunk = min(max(options.token_budget - rows, 1), options.prefill_chunk)
    if not topo.given:
        check_libtpu()  # here, before a child would find it missing

    def build(name: str) -> ProgramReport:
        arguments = (name, cfg, options, num_pages, topo, weights, context, chunk)
        if topo.given:
            return compile_planned(*arguments)
        what = f"compiling the {name} for {topo.name} (libtpu {libtpu_version()})"
        return run_isolated(compile_planned, *arguments, what=what, env=_CHILD_ENV)

    # The TPU compiler runs on one core a program: two programs on two threads (or children)
    # take the time of the longer one where the host has the cores (it releases the GIL).
    with _no_persistent_cache(), concurrent.futures.ThreadPoolExecutor(len(PROGRAMS)) as pool:
        futures = [pool.submit(build, name) for name in PROGRAMS]
        reports, errors = [], []
        for name, future in zip(PROGRAMS, futures, strict=True):
            try:
                reports.append(future.result())
            except CompilerCrash as crash:
                errors.append(f"the TPU compiler crashed {crash}" + _report(crash.report))
            except (jax.errors.JaxRuntimeError, ChildError) as e:
                if isinstance(e, ChildError) and e.kind != "JaxRuntimeError":
                    raise
                errors.append(_refused(name, topo, e))
        return tuple(reports), tuple(errors)


def _refused(name: str, topo: Topology, error: Exception) -> str:
    # The compiler's refusal of a program (it ran out of a memory, Mosaic rejected a kernel):
    # its first line, and where it lists allocations, the largest one's shape and owner.
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else type(error).__name__
    shape = next((line for line in lines if line.startswith("Shape:")), "")
    label = next((line for line in lines if line.startswith("XLA label:")), "")
    owner = label.removeprefix("XLA label:").split(" = ")[0].strip()
    if owner:
        shape = shape.removeprefix("Shape:").strip()
        text += f" (the largest allocation: {shape + ' of ' if shape else ''}{owner})"
    return (
        f"the TPU compiler refused the {name} for {topo.name} (libtpu {libtpu_version()}): {text}"
    )


# A child compiling for a described topology needs no backend of its own (nor a TPU this
# host may have: the parent's), may load libtpu beside other processes (topology.py), and
# keeps its programs out of the persistent cache (`_no_persistent_cache`).
_CHILD_ENV = {
    "JAX_PLATFORMS": "cpu",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    "JAX_ENABLE_COMPILATION_CACHE": "false",
}


# libtpu 0.0.42 on a v6e gives scatters (the row store's token counts) to the chip's
# SparseCores, and its crash on a sharded v6e plan was in their code generation
# (docs/TPU.md); this flag keeps scatters on the TensorCore, as a v5e runs them.
SPARSE_CORE_OFF = "--xla_tpu_enable_offloading_scatter_to_sparsecore=false"


def _report(report: str) -> str:
    # libtpu's report, and where it names the SparseCores, the flag that leaves them out.
    if not report:
        return ""
    text = "; libtpu reported:\n" + report
    if "sparse_core" in report:
        text += (
            f"\n(a crash in SparseCore code generation: LIBTPU_INIT_ARGS={SPARSE_CORE_OFF} "
            "compiles the scatters for the TensorCore instead; docs/TPU.md)"
        )
    return text


@contextlib.contextmanager
def _no_persistent_cache():
    # Programs compiled for a described topology cannot be loaded back from the persistent
    # cache (no TPU client: "PjRtCompiler must be constructed with a Client"): a second plan
    # warned and compiled again. They are kept out of it.
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)


def _held(cfg: ModelConfig, weights: str | Weights | None) -> Weights:
    # The weights a plan counts and compiles, as shapes.
    if weights is None or isinstance(weights, str):
        return abstract_weights(cfg, weights)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), weights)


def _held_name(weights: Weights) -> str:
    # The block formats of quantized matrices ("int8", "q4_1"), "" when every one is float.
    return ",".join(sorted(set(weight_formats(weights).values())))


def _tree_bytes(tree) -> int:
    return sum(_nbytes(leaf) for leaf in jax.tree.leaves(tree))


def _nbytes(leaf) -> int:
    return math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize


def _bytes_per_chip(tree, shardings) -> int:
    # Bytes of `tree`'s arrays on one chip: each array's shard under its sharding.
    leaves = jax.tree.leaves(tree)
    if shardings is None:
        return sum(_nbytes(leaf) for leaf in leaves)
    total = 0
    for leaf, sharding in zip(leaves, jax.tree.leaves(shardings), strict=True):
        shard = sharding.shard_shape(leaf.shape)
        total += math.prod(shard) * np.dtype(leaf.dtype).itemsize
    return total
