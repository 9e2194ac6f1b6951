"""Read weights from Hugging Face safetensors files (single or sharded), by the Hugging Face
names of the family's table (etjax/model/families/)."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes  # noqa: F401 (registers bfloat16 with numpy, for safetensors' numpy reads)
import numpy as np
from safetensors import safe_open

from etjax.errors import ModelLoadError, shown
from etjax.loaders.assemble import SourceTensor, assemble_weights
from etjax.model.config import ModelConfig
from etjax.model.leaves import Part
from etjax.model.weights import Weights

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of a directory: the shards its index names, or model.safetensors."""
    index = directory / _INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError) as e:  # not UTF-8, not JSON, no weight_map
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from None
        except RecursionError:
            raise ModelLoadError(f"{index}: JSON nested too deeply to read") from None
        if not isinstance(weight_map, dict) or not all(
            isinstance(name, str) for name in weight_map.values()
        ):
            raise ModelLoadError(
                f"{index}: weight_map must map tensor names to file names; it is "
                f"{shown(weight_map)}"
            )
        files = sorted({directory / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index}: names shards that are missing: {missing}")
        return files
    if (directory / _SINGLE).is_file():
        return [directory / _SINGLE]
    found = sorted(directory.glob("*.safetensors"))
    if found:
        return found
    raise ModelLoadError(f"{directory}: no *.safetensors weights found")


def load_safetensors_weights(
    directory: Path, cfg: ModelConfig, weights: str | None = None
) -> Weights:
    """Load and fuse the weights of a Hugging Face directory, in `cfg.dtype` (the matrices as
    `weights` says, etjax/loaders/assemble.py: "int8", "float32", "bfloat16", None: cfg's).

    Each tensor is read a chunk of rows at a time straight into its final leaf
    (etjax/loaders/assemble.py), so no float32 copy of the model is ever held.
    """
    tensors = _source_tensors(safetensors_files(directory))

    def find(part: Part, layer: int | None) -> SourceTensor:
        name = part.hf_name(layer)
        try:
            tensor = tensors[name]
        except KeyError:
            raise ModelLoadError(f"{directory}: tensor {name!r} is missing") from None
        if not part.hf_offset:
            return tensor
        read = tensor.read_rows
        shifted = lambda rows: (chunk + part.hf_offset for chunk in read(rows))  # noqa: E731
        return dataclasses.replace(tensor, read_rows=shifted)

    return assemble_weights(cfg, find, str(directory), weights)


def _source_tensors(files: list[Path]) -> dict[str, SourceTensor]:
    # Every tensor of the files, by name, unread: only the files' headers are parsed.
    tensors: dict[str, SourceTensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="numpy") as f:
                for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    shape = tuple(f.get_slice(name).get_shape())
                    read = functools.partial(_read_rows, path, name, shape)
                    tensors[name] = SourceTensor(name, shape, read)
        except Exception as e:  # safetensors raises its own untyped errors for corrupt files
            raise ModelLoadError(f"{path}: cannot read safetensors file ({e})") from None
    return tensors


def _read_rows(
    path: Path, name: str, shape: tuple[int, ...], rows_per_chunk: int
) -> Iterator[np.ndarray]:
    # The file is opened once per chunk: the pages of its memory map that a read touches stay
    # resident, and counted as this process's memory, until the map closes. bfloat16 rows come
    # back as ml_dtypes arrays and widen to float32 exactly.
    for start in range(0, shape[0], rows_per_chunk):
        stop = min(start + rows_per_chunk, shape[0])  # safetensors refuses a slice past the end
        try:
            with safe_open(str(path), framework="numpy") as f:
                rows = f.get_slice(name)[start:stop]
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot read tensor {name!r} ({e})") from None
        yield np.asarray(rows, dtype=np.float32)
