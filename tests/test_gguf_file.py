"""The GGUF header reader against the `gguf` package's reader: every value type, tensors of
plain and quantized types, the real SmolLM2 file, and the errors of broken files."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from etjax.gguf_file import read_gguf


def _as_reader_sees_it(path) -> tuple[dict, list[tuple]]:
    reader = GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = [
        (
            t.name,
            t.tensor_type,
            tuple(int(d) for d in t.shape),
            int(t.data_offset),
            t.data.dtype,
            tuple(t.data.shape),
        )
        for t in reader.tensors
    ]
    return fields, tensors


def _as_we_see_it(path) -> tuple[dict, list[tuple]]:
    header = read_gguf(path)
    tensors = [
        (t.name, t.tensor_type, t.dims, t.data_offset, t.data_dtype, t.data_shape)
        for t in header.tensors
    ]
    return header.fields, tensors


def _write_every_kind(path) -> None:
    writer = GGUFWriter(path, "llama")
    scalars = {
        GGUFValueType.UINT8: 200,
        GGUFValueType.INT8: -100,
        GGUFValueType.UINT16: 60000,
        GGUFValueType.INT16: -30000,
        GGUFValueType.UINT32: 4_000_000_000,
        GGUFValueType.INT32: -2_000_000_000,
        GGUFValueType.FLOAT32: 0.1,
        GGUFValueType.BOOL: True,
        GGUFValueType.UINT64: 2**63 + 5,
        GGUFValueType.INT64: -(2**62),
        GGUFValueType.FLOAT64: 1e-300,
        GGUFValueType.STRING: "héllo ▁wörld 🙂",
    }
    for vtype, value in scalars.items():
        writer.add_key_value(f"test.{vtype.name.lower()}", value, vtype)
    writer.add_key_value("test.ints", [3, -1, 7], GGUFValueType.ARRAY, GGUFValueType.INT32)
    writer.add_key_value("test.floats", [0.5, -2.25], GGUFValueType.ARRAY, GGUFValueType.FLOAT32)
    writer.add_key_value("test.bools", [True, False], GGUFValueType.ARRAY, GGUFValueType.BOOL)
    writer.add_key_value("test.words", ["a", "", "ü b"], GGUFValueType.ARRAY, GGUFValueType.STRING)
    rng = np.random.default_rng(0)
    writer.add_tensor("plain.f32", rng.normal(size=(3, 5)).astype(np.float32))
    writer.add_tensor("plain.f16", rng.normal(size=(7,)).astype(np.float16))
    # Q8_0: blocks of 32 values in 34 bytes; rows of 64 values are 68 bytes.
    blocks = rng.integers(0, 255, size=(4, 68), dtype=np.uint8)
    writer.add_tensor("quant.q8_0", blocks, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_every_value_type_and_tensor_kind_reads_as_the_gguf_package_reads_it(tmp_path):
    path = tmp_path / "every-kind.gguf"
    _write_every_kind(path)
    fields, tensors = _as_we_see_it(path)
    assert (fields, tensors) == _as_reader_sees_it(path)
    assert fields["test.string"] == "héllo ▁wörld 🙂" and fields["test.bool"] is True
    q8 = next(t for t in read_gguf(path).tensors if t.name == "quant.q8_0")
    assert q8.dims == (64, 4) and q8.data_shape == (4, 68) and q8.nbytes == 4 * 68


def test_the_real_smollm2_header_reads_as_the_gguf_package_reads_it(smollm2_path):
    assert _as_we_see_it(smollm2_path) == _as_reader_sees_it(smollm2_path)


@pytest.mark.parametrize(
    "cut, message",
    [(3, "shorter than a GGUF header"), (40, "past the end"), (-100, "runs past the end")],
)
def test_broken_files_are_refused_with_what_is_wrong(tmp_path, cut, message):
    whole = tmp_path / "whole.gguf"
    _write_every_kind(whole)
    data = whole.read_bytes()
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(data[:cut])
    with pytest.raises(ValueError, match=message):
        read_gguf(broken)


def test_a_file_without_the_magic_or_of_another_version_is_refused(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="no GGUF magic"):
        read_gguf(path)
    path.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(60))
    with pytest.raises(ValueError, match="version 1"):
        read_gguf(path)


def _with_dims(source, path, tensor: str, dims: tuple[int, ...]) -> None:
    # A copy of `source` whose header lists `dims` for `tensor` (same count of dimensions):
    # its table entry is the name, then n_dims (uint32), then each dimension (uint64).
    data = bytearray(source.read_bytes())
    name = tensor.encode()
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    assert int.from_bytes(data[at : at + 4], "little") == len(dims)
    for i, d in enumerate(dims):
        data[at + 4 + 8 * i : at + 12 + 8 * i] = d.to_bytes(8, "little")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "dims",
    [
        (2**32, 2**32),  # 2**64 items: the product wraps to 0 in int64
        (2**62, 3),  # 3 * 2**62 * 4 bytes wraps to a small positive number
        (2**64 - 1, 0),  # no items, but a dimension no array can have
        (10**6, 10**3),  # 4 GB: simply past the end of the file
    ],
)
def test_a_tensor_whose_size_overflows_is_refused_naming_file_and_tensor(tmp_path, dims):
    from etjax.errors import ModelLoadError
    from etjax.loaders.gguf_weights import open_gguf

    whole = tmp_path / "whole.gguf"
    _write_every_kind(whole)
    bad = tmp_path / "overflow.gguf"
    _with_dims(whole, bad, "plain.f32", dims)  # the first tensor, float32, 3 x 5
    with pytest.raises(ModelLoadError, match=r"overflow\.gguf: .*tensor 'plain\.f32'"):
        open_gguf(bad)


def test_metadata_arrays_nested_past_a_bound_are_refused_naming_the_field(tmp_path):
    from etjax.errors import ModelLoadError
    from etjax.loaders.gguf_weights import open_gguf

    # Version 3, no tensors, one field "deep": an array (type 9) of one array of one array ...
    # 5,000 deep (12 bytes a level), which would exhaust Python's stack read recursively.
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 4) + b"deep"
    levels = struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 5_000 + struct.pack("<IQ", 4, 0)
    path = tmp_path / "nested.gguf"
    path.write_bytes(header + levels + bytes(32))
    with pytest.raises(ModelLoadError, match=r"nested\.gguf: .*field 'deep': arrays nested"):
        open_gguf(path)
