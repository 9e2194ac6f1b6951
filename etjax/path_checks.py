"""The files and environment a command needs, checked before any model loads.

A wrong path or variable should cost a second and say what is wrong, not a model load and a
traceback. Every check raises `ConfigError` naming the path or variable and what is allowed.
"""

from __future__ import annotations

import os
from pathlib import Path

from etjax.errors import ConfigError


def input_file(path: Path) -> Path:
    """An existing, readable regular file."""
    if path.is_dir():
        raise ConfigError(f"input {path} is a directory; pass a JSONL file")
    if not path.exists():
        raise ConfigError(f"input file {path} not found")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"input file {path} is not readable")
    return path


def output_file(path: Path, input_path: Path | None = None) -> Path:
    """A file that can be created or appended to, and is not the input."""
    if path.is_dir():
        raise ConfigError(f"output {path} is a directory; pass a file path")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError(f"output {path}: the folder {parent} does not exist")
    if path.exists() and not os.access(path, os.W_OK):
        raise ConfigError(f"output {path} is not writable")
    if not path.exists() and not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"output {path}: the folder {parent} is not writable")
    if input_path is not None and path.resolve() == input_path.resolve():
        raise ConfigError(f"output {path} is the input file; write the results elsewhere")
    return path


def new_directory(path: Path) -> Path:
    """Where a command will create a directory: absent, or an existing directory."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"destination {path} is an existing file; pass a directory path")
    return path


def env_int(name: str, default: int, minimum: int) -> int:
    """An integer environment variable >= minimum, or `default` when unset."""
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < minimum:
        raise ConfigError(f"{name}={value!r}; must be an integer >= {minimum}")
    return number
