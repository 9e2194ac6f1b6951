"""The weight tables (etjax/model/families/, etjax/model/weights.py) against the names and
shapes the file formats' own projects give: transformers' state dicts and llama.cpp's tensor
list (the `gguf` package). Everything a loader reads is derived from these tables."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from gguf.constants import MODEL_ARCH, MODEL_ARCH_NAMES, MODEL_TENSOR, MODEL_TENSORS, TENSOR_NAMES

import etjax
from etjax.errors import ModelLoadError
from etjax.loaders.hf_config import read_hf_config
from etjax.model.families import FAMILIES, family
from etjax.model.leaves import OUTPUT_MAJOR
from etjax.model.weights import MODEL_LEAVES


def _leaves(cfg):
    # (leaf name, leaf, layer index or None) of every leaf a model with `cfg` has.
    fam = family(cfg.architecture)
    for name, leaf in MODEL_LEAVES.items():
        if leaf.present(cfg):
            yield name, leaf, None
    for i in range(cfg.num_layers):
        for name, leaf in fam.layer.items():
            if leaf.present(cfg):
                yield name, leaf, i


@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen2"])
def test_hf_names_and_shapes_are_transformers(kind, tiny_hf_dir):
    import torch
    from transformers import AutoModelForCausalLM

    directory = tiny_hf_dir(kind)
    cfg = read_hf_config(directory / "config.json", "float32")
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    state = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    read = set()
    for name, leaf, layer in _leaves(cfg):
        shapes = [state[part.hf_name(layer)] for part in leaf.parts]
        if leaf.layout == OUTPUT_MAJOR:  # parts [out_i, in] -> [sum(out_i), in]
            built = (sum(s[0] for s in shapes), *shapes[0][1:])
        else:
            built = shapes[0]
        assert built == leaf.shape(cfg), (name, layer)
        read |= {part.hf_name(layer) for part in leaf.parts}
    # Every tensor but a tied head's alias is read.
    assert set(state) - read <= {"lm_head.weight"}


@pytest.mark.parametrize("architecture", sorted(FAMILIES))
def test_gguf_names_are_llama_cpps(architecture):
    fam = FAMILIES[architecture]
    for gguf_arch in fam.gguf_architectures:
        arch = next(a for a, n in MODEL_ARCH_NAMES.items() if n == gguf_arch)
        known = {TENSOR_NAMES[t].replace("{bid}", "{i}") for t in MODEL_TENSORS[arch]}
        model = dict(fam.model or MODEL_LEAVES)
        if MODEL_TENSOR.OUTPUT not in MODEL_TENSORS[arch]:
            # llama.cpp always ties this architecture's head (Gemma 2); etjax refuses an
            # untied one at load.
            del model["lm_head"]
        for leaf in (*model.values(), *fam.layer.values()):
            for part in leaf.parts:
                if part.gguf is None:  # a tensor no GGUF file holds (Qwen3-MoE's dense layers)
                    continue
                base, suffix = part.gguf.rsplit(".", 1)
                assert suffix in ("weight", "bias") and base in known, (gguf_arch, part.gguf)
    assert MODEL_ARCH.LLAMA in MODEL_TENSORS  # the lookup above found real tables


def test_a_tensor_of_the_wrong_shape_is_named(tiny_hf_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    directory = tmp_path / "bad-shape"
    shutil.copytree(tiny_hf_dir("llama"), directory)
    tensors = load_file(directory / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors[name] = np.ascontiguousarray(tensors[name][:-16])
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"layer 1 wqkv .*k_proj.* config gives \(128, 64\)"):
        etjax.load_model(directory)
