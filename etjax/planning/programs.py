"""The engine's step programs compiled for a TPU topology this host does not have.

The programs are the engine's own: a `DeviceBackend` built compile-only for the topology's
devices (etjax/engine/device.py) lays out a round exactly as it would to run it
(`mixed_arguments`, `burst_arguments`), and its arguments, shapes placed on the topology's
devices, are lowered and compiled by the TPU compiler. What comes back per program: the
compile time, the bytes XLA reports per chip (`memory_analysis`) and the Mosaic kernels in the
compiled module (the Pallas kernels built for the chip, not interpreted).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from etjax.buckets import batch_bucket
from etjax.cache.page_allocator import pages_needed
from etjax.engine.backend import PrefillJob
from etjax.engine.device import DeviceBackend
from etjax.model.config import ModelConfig
from etjax.model.weights import Weights, abstract_weights
from etjax.planning.topology import Topology
from etjax.runtime.options import RuntimeOptions
from etjax.runtime.steps import decode_steps, mixed_step

# Keyword arguments of the step programs that are static (not arrays).
_STATIC = ("statics", "max_draft", "num_steps")
# A Mosaic kernel in a compiled TPU module: a custom call with this target, and its kernel's
# name in the call's metadata.
MOSAIC_CALL = "tpu_custom_call"


@dataclass(frozen=True)
class ProgramReport:
    """One compiled program, per chip."""

    name: str  # "ragged step" or "decode burst"
    compile_s: float  # lowering and compiling
    argument_bytes: int  # weights, KV pool, row store and the call's inputs
    output_bytes: int
    alias_bytes: int  # outputs written over donated arguments (the pool and the store)
    temp_bytes: int  # the program's scratch
    code_bytes: int
    kernels: tuple[str, ...]  # Mosaic kernels of the compiled module, by name
    # On a mesh, the collectives in the compiled module by kind: (count, payload bytes a
    # chip), each counted once as written (one inside a loop runs once an iteration).
    collectives: tuple[tuple[str, int, int], ...] = ()
    # The collectives one layer runs (kind, the op they follow, bytes a chip: an all-gather's
    # shard, any other's array), and those a step runs besides its layers
    # (`layer_collectives`).
    layer_collectives: tuple[tuple[str, str, int], ...] = ()
    step_collectives: tuple[tuple[str, str, int], ...] = ()
    # Bytes a chip holds of the weights, the KV pool and the row store as the compiler lays
    # them out (its tiles pad the minor dimensions: a pool of 69 pages takes 128's room).
    laid_out: tuple[tuple[str, int], ...] = ()
    # CPU seconds of lowering and compiling, all threads of the compiling process: a child of
    # its own for a described topology, so what this compile cost whatever else the host
    # ran (on a TPU host both programs compile in one process, and each counts both).
    compile_cpu_s: float = 0.0

    @property
    def peak_bytes(self) -> int:
        """Bytes the chip holds while the program runs: its arguments, outputs not written
        over donated arguments, scratch and code."""
        fresh = self.output_bytes - self.alias_bytes
        return self.argument_bytes + fresh + self.temp_bytes + self.code_bytes


def compile_only_backend(
    cfg: ModelConfig,
    options: RuntimeOptions,
    num_pages: int,
    topology: Topology,
    weights: Weights | None = None,
) -> DeviceBackend:
    """The engine's device half for `topology`, holding shapes: `weights` (a tree of shapes;
    default `abstract_weights(cfg)`) and a pool of `num_pages` pages."""
    return DeviceBackend(
        abstract_weights(cfg) if weights is None else weights,
        cfg,
        (0,),
        options,
        num_pages,
        devices=topology.devices(),
        compile_only=True,
    )


def ragged_call(backend: DeviceBackend, rows: int, context: int, chunk: int) -> dict:
    """`mixed_step`'s arguments for `rows` decoding rows of `context` cached tokens each
    beside one prefill chunk of `chunk` tokens (its pages after theirs)."""
    tables = _tables(backend, [context + 1] * rows + [chunk])
    job = PrefillJob(row=rows, tokens=[3] * chunk, start=0, pages=tables[-1])
    budgets = [1.0] * rows
    _, arguments = backend.mixed_arguments(
        list(range(rows)), tables[:-1], [context] * rows, budgets, [job]
    )
    return arguments


def burst_call(backend: DeviceBackend, rows: int, context: int) -> dict:
    """`decode_steps`' arguments for a burst of `rows` rows of `context` cached tokens."""
    k = backend.options.steps_per_sync
    tables = _tables(backend, [context + k] * rows)
    _, arguments = backend.burst_arguments(
        list(range(rows)), tables, [context] * rows, [1.0] * rows, batch_bucket(rows)
    )
    return arguments


PROGRAMS = ("decode burst", "ragged step")


def compile_planned(
    name: str,
    cfg: ModelConfig,
    options: RuntimeOptions,
    num_pages: int,
    topology: Topology,
    weights: Weights,
    context: int,
    chunk: int,
) -> ProgramReport:
    """The program `name` of a plan (one of `PROGRAMS`), built and compiled from what pickles
    (plan.py runs it in a child process for a described topology): the engine's device half
    for `topology` with `weights` (shapes) and `num_pages` pages, and its largest call of that
    program at this batch and context: a burst of every row, or a ragged step of every row
    beside a prefill chunk of `chunk` tokens."""
    backend = compile_only_backend(cfg, options, num_pages, topology, weights)
    rows = options.max_batch_size
    if name == "decode burst":
        call = burst_call(backend, rows, context)
    else:
        call = ragged_call(backend, rows, context, chunk)
    return compile_program(name, backend, call, topology)


def _tables(backend: DeviceBackend, lengths: list[int]) -> list[list[int]]:
    # Page lists of sequences of these lengths, one after another in the pool (wrapping round
    # a small pool: only the shapes of what they build are compiled).
    ps, usable = backend.options.page_size, backend.num_pages - 1
    tables, next_page = [], 0
    for n in lengths:
        count = pages_needed(n, ps)
        tables.append([1 + (next_page + i) % usable for i in range(count)])
        next_page += count
    return tables


def compile_program(
    name: str, backend: DeviceBackend, arguments: dict, topology: Topology
) -> ProgramReport:
    """Lower and compile the program `name` ("ragged step" or "decode burst") for the
    topology's devices, with `arguments` from `ragged_call` or `burst_call`."""
    program = mixed_step if name == "ragged step" else decode_steps
    # The layer scan is the first loop of a ragged step, the second of a burst (its steps'
    # scan holds it).
    layer_depth = 1 if name == "ragged step" else 2
    devices = topology.devices()
    if backend.placement is None:
        default = SingleDeviceSharding(devices[0])
    else:
        default = backend.placement.replicated
    shaped = {
        key: value if key in _STATIC else _shapes(value, default)
        for key, value in arguments.items()
    }
    start, cpu = time.perf_counter(), time.process_time()
    # Pallas reads the chip it builds a kernel for from the default device.
    with jax.default_device(devices[0]):
        compiled = program.lower(**shaped).compile()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    memory = compiled.memory_analysis()
    hlo = compiled.as_text()
    per_layer, per_step = layer_collectives(hlo, layer_depth)
    formats = compiled.input_formats[1]  # the program is called by keyword
    laid_out = tuple(
        (key, _laid_out_bytes(shaped[key], formats[key])) for key in ("weights", "cache", "store")
    )
    return ProgramReport(
        name=name,
        compile_s=seconds,
        compile_cpu_s=cpu_seconds,
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes),
        temp_bytes=int(memory.temp_size_in_bytes),
        code_bytes=int(memory.generated_code_size_in_bytes),
        kernels=mosaic_kernels(hlo),
        collectives=collectives(hlo),
        laid_out=laid_out,
        layer_collectives=per_layer,
        step_collectives=per_step,
    )


def mosaic_kernels(hlo: str) -> tuple[str, ...]:
    """The Mosaic kernels a compiled TPU module calls, by the name of their custom-call
    instructions (the Pallas kernel's name; sorted, each once)."""
    names = set()
    for line in hlo.splitlines():
        if f'custom_call_target="{MOSAIC_CALL}"' in line:
            match = _INSTRUCTION.match(line)
            names.add(match.group(1) if match else MOSAIC_CALL)
    return tuple(sorted(names))


def layout_bytes(shape: tuple[int, ...], itemsize: int, layout) -> int:
    """Bytes of an array of `shape` in a compiled `layout` (its dimensions in
    `major_to_minor` order, the minor ones padded to the first tile)."""
    dims = [shape[i] for i in layout.major_to_minor]
    tile = layout.tiling[0] if layout.tiling else ()
    for offset, size in enumerate(reversed(tile), start=1):
        if offset <= len(dims):
            dims[-offset] = -(-dims[-offset] // size) * size
    return math.prod(dims) * itemsize


def _laid_out_bytes(tree, formats) -> int:
    # One chip's bytes of `tree`'s arrays: each shard in the layout the compiler chose.
    total = 0
    for leaf, fmt in zip(jax.tree.leaves(tree), jax.tree.leaves(formats), strict=True):
        shard = fmt.sharding.shard_shape(leaf.shape)
        itemsize = np.dtype(leaf.dtype).itemsize
        if fmt.layout is None or not hasattr(fmt.layout, "major_to_minor"):
            total += math.prod(shard) * itemsize
        else:
            total += layout_bytes(shard, itemsize, fmt.layout)
    return total


def collectives(hlo: str) -> tuple[tuple[str, int, int], ...]:
    """(kind, count, payload bytes) of the collectives a compiled module holds, by kind
    ("all-reduce", "all-gather", ...; an asynchronous "-start" counted as its kind), the
    payload being the result's first array."""
    found: dict[str, list[int]] = {}
    for line in hlo.splitlines():
        match = _COLLECTIVE.search(line)
        if match is None:
            continue
        kind = match.group(3)
        entry = found.setdefault(kind, [0, 0])
        entry[0] += 1
        entry[1] += _array_bytes(match.group(1), match.group(2))
    return tuple((kind, n, size) for kind, (n, size) in sorted(found.items()))


def layer_collectives(hlo: str, layer_depth: int) -> tuple[tuple, tuple]:
    """The collectives a compiled step runs once a layer, and once a step besides, from each
    collective's source op (its `op_name`): those under the `layer_depth`-th `while/body` are
    the layer scan's (those in a layer's own branch of its `lax.switch`, `cond/branch_K_fun`,
    counted for one layer: their sum over the branches over the branches' count; those in a
    loop inside a layer, once a trip, are named so), those under one loop fewer a step's.
    Each a (kind, the op
    they follow: the last name of its op_name, bytes a chip: an all-gather's shard, an
    all-reduce's arrays, a collective-permute's sent array), merged by kind and op, sorted."""
    layer: dict[tuple[str, str], float] = {}
    branches: dict[tuple[str, str], dict[str, int]] = {}
    step: dict[tuple[str, str], float] = {}
    for line in hlo.splitlines():
        match = _COLLECTIVE_LINE.search(line)
        if match is None:
            continue
        types, kind = match.group(1), match.group(2)
        name = _OP_NAME.search(line)
        op_name = name.group(1) if name else ""
        key = (kind, op_name.rsplit("/", 1)[-1])
        size = _payload_bytes(types, kind, line)
        parts = op_name.split("while/body/closed_call/")
        if len(parts) > layer_depth:
            inner = "while/body/closed_call/".join(parts[layer_depth:])
            if "while/body" in inner:  # a loop inside the layer (attention's): once a trip
                key = (kind, f"{key[1]} (a trip of a loop in the layer)")
            branch = _BRANCH.match(inner)
            if branch:
                counts = branches.setdefault(key, {})
                counts[branch.group(1)] = counts.get(branch.group(1), 0) + size
            else:
                layer[key] = layer.get(key, 0) + size
        elif len(parts) == layer_depth:
            step[key] = step.get(key, 0) + size
    ids = {b for counts in branches.values() for b in counts}
    for key, counts in branches.items():
        layer[key] = layer.get(key, 0) + sum(counts.values()) / len(ids)

    def listed(found: dict) -> tuple:
        return tuple((kind, op, round(size)) for (kind, op), size in sorted(found.items()))

    return listed(layer), listed(step)


def _payload_bytes(types: str, kind: str, line: str) -> int:
    # A chip's bytes of one collective: an all-reduce's arrays (a tuple of several reduces
    # them all), an all-gather's shard (the result over the group), a permute's sent array.
    arrays = _ARRAY.findall(types)
    if kind == "all-reduce":
        return sum(_array_bytes(dtype, dims) for dtype, dims in arrays)
    size = _array_bytes(*arrays[0])
    if kind == "all-gather":
        size //= _group_size(line)
    return size


def _group_size(line: str) -> int:
    # Devices in one replica group: "{{0,1},{2,3}}" or "mesh['axis_0'=1,'axis_1'=4] {'axis_1'}".
    groups = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if groups:
        return len(groups.group(1).split(","))
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if mesh:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", mesh.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", mesh.group(2)))
    return 1


def _array_bytes(dtype: str, dims: str) -> int:
    sizes = [int(d) for d in dims.split(",") if d.strip()]
    bits = int(re.sub(r"\D", "", dtype) or 8) if dtype != "pred" else 8
    return math.prod(sizes) * max(bits // 8, 1)


# "= bf16[2,576]{...} all-reduce(" or "= (f32[2,3]{...}, ...) collective-permute-start(".
_COLLECTIVE = re.compile(
    r"=\s*\(?([a-z]+\d*)\[([\d,]*)\][^=]*?\s"
    r"(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
)


# A collective's result types (one array or a tuple) and kind.
_COLLECTIVE_LINE = re.compile(
    r"=\s*(\(.*?\)|[a-z]+\d*\[[\d,]*\]\S*)\s"
    r"(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
)
_ARRAY = re.compile(r"([a-z]+\d*)\[([\d,]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_BRANCH = re.compile(r"cond/branch_(\d+)_fun/")


# An HLO instruction's name without its numbering: "%block_sparse_attention_tpu.16 = ...".
_INSTRUCTION = re.compile(r"\s*(?:ROOT\s+)?%([A-Za-z_][\w-]*?)(?:\.\d+)*\s*=")


def _shapes(tree, default):
    # Every array of a call's argument as a shape on the topology: the sharding a
    # compile-only backend gave it, else `default` (one chip, or replicated on a mesh).
    def shape(x):
        if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None:
            return x
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=default)

    return jax.tree.map(shape, tree)
