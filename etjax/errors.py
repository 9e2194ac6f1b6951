"""Exceptions etjax raises for bad input.

Every error a user can cause derives from :class:`EtjaxError` (a ``ValueError``), so callers can
catch one type, and its message names the file, field or value at fault and what is allowed.
"""

from __future__ import annotations


class EtjaxError(ValueError):
    """Base class of every user-facing etjax error."""


class ModelLoadError(EtjaxError):
    """A model file or directory is missing, corrupt, or describes an unsupported model."""


class TokenizerError(EtjaxError):
    """Tokenizer files or metadata are missing or malformed."""


class RequestError(EtjaxError):
    """A prompt or a generation setting is invalid."""


class ConfigError(EtjaxError):
    """A config file is missing, malformed, or has an unknown key or a bad value."""
