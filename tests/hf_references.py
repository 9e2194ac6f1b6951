"""transformers' model and tokenizer of one GGUF file (the tests' numerical reference), loaded
together from one parse of the file.

transformers parses a GGUF file's whole header each time it needs anything from it: twice to
load a model (its config, then its tensors) and once more for a tokenizer. The header holds the
vocabulary, and `gguf.GGUFReader` builds Python objects for every token, score and type: for
Gemma 3's 262,144 tokens one parse makes 2.2 million objects and takes 12-18 s on a 2-core CPU,
and while they live every full garbage collection examines them. Loading both from one parse,
with the collector paused while it runs, gives transformers the same reader it would build
itself (the file is read-only; nothing transformers computes changes), once. Its arrays are
plain numpy views of the file's mapping, not `np.memmap` slices, whose Python-level
`__array_finalize__` ran for each of the 2 million: the parse of Gemma 3's header takes 3.1 CPU s
instead of 11.1 (AMD EPYC (Zen 4), 2 cores, loaded, 2026-12-07), with the same bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
from pathlib import Path
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Reference:
    model: Any  # transformers' causal LM in float32, in eval mode
    tokenizer: Any  # transformers' fast tokenizer


def load_reference(path: Path) -> Reference:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _one_parse_per_file():
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return Reference(model.eval(), tokenizer)


def load_reference_model(path: Path) -> Any:
    """transformers' float32 causal LM of the GGUF file at `path`, in eval mode, from one parse
    of the file (transformers alone parses it twice: for the config, then for the tensors)."""
    import torch
    from transformers import AutoModelForCausalLM

    with _one_parse_per_file():
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    return model.eval()


@contextlib.contextmanager
def _one_parse_per_file():
    # transformers imports `GGUFReader` from `gguf` inside the loading function, so replacing
    # the module attribute is seen by every load made inside this block.
    import gguf

    original = gguf.GGUFReader
    parses: dict[tuple[str, str], Any] = {}

    class _PlainArrays(original):
        # The reader slices `self.data` once per value of every field; a view as a base
        # ndarray slices in C (the memmap, its base, keeps the file mapped).
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, mapped):
            self._plain = mapped.view(np.ndarray)

    def parse_once(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in parses:
            parses[key] = _PlainArrays(path, mode)
        return parses[key]

    collecting = gc.isenabled()
    gc.disable()  # millions of new objects would start several full collections
    gguf.GGUFReader = parse_once
    try:
        yield
    finally:
        gguf.GGUFReader = original
        if collecting:
            gc.enable()
