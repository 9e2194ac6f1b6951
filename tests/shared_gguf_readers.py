"""One parse of each GGUF file per test process for the `gguf` package's reader.

transformers, the tests' reference, parses a GGUF file with `gguf.GGUFReader` once for the
config, once for the tokenizer and once more for the weights: 8.5 s each for Gemma 3's
262,144-token vocabulary, 2.2 s for SmolLM2's. In the test process a file's reader is parsed
once and handed out again while the file is unchanged (path, size, modification time); the
reference still reads what the `gguf` package parses from the same bytes. The last two files'
readers are kept (a parsed Gemma 3 vocabulary is a few hundred MB of numpy views).
"""

from __future__ import annotations

import os
from collections import OrderedDict

import gguf

KEPT = 2


def install() -> None:
    """Make `gguf.GGUFReader` share parses (idempotent)."""
    if getattr(gguf.GGUFReader, "shares_parses", False):
        return
    gguf.GGUFReader = _shared_reader_class(gguf.GGUFReader)


def _shared_reader_class(parse: type) -> type:
    readers: OrderedDict[tuple, object] = OrderedDict()

    class SharedGGUFReader(parse):
        shares_parses = True

        def __new__(cls, path, mode="r"):
            if mode != "r":  # writable maps are never shared
                reader = super().__new__(cls)
                reader._parsed = False
                return reader
            stat = os.stat(path)
            key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
            reader = readers.get(key)
            if reader is None:
                reader = super().__new__(cls)
                reader._parsed = False
                readers[key] = reader
                while len(readers) > KEPT:
                    readers.popitem(last=False)
            readers.move_to_end(key)
            return reader

        def __init__(self, path, mode="r"):
            if not self._parsed:
                super().__init__(path, mode)
                self._parsed = True

    return SharedGGUFReader
