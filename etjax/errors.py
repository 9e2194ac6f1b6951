"""Exceptions etjax raises for bad input.

Every error a user can cause derives from :class:`EtjaxError` (a ``ValueError``), so callers can
catch one type, and its message names the file, field or value at fault and what is allowed.
"""

from __future__ import annotations

# How much of a refused value a message shows: enough to recognise it, never the whole of a
# 10,000-value schema (a message is read in a terminal or a log line).
SHOWN_CHARS = 200


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """`repr(value)` cut to `limit` characters, with how long it was: what an error message
    echoes of a value. A value nested too deeply to repr says so instead."""
    try:
        text = repr(value)
    except RecursionError:
        return f"<{type(value).__name__} nested too deeply to show>"
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} chars)"


class EtjaxError(ValueError):
    """Base class of every user-facing etjax error."""


class ModelLoadError(EtjaxError):
    """A model file or directory is missing, corrupt, or describes an unsupported model."""


class TokenizerError(EtjaxError):
    """Tokenizer files or metadata are missing or malformed."""


class RequestError(EtjaxError):
    """A prompt or a generation setting is invalid."""


class FieldError(RequestError):
    """A setting holds a value it cannot take, whichever way it came in (a `decode()` keyword,
    a batch record, an OpenAI line, a config key, a flag). `field`, `value` and `allowed` say
    which, what it was and what it may be; the message reads `field=value; must be allowed`,
    the value cut to `SHOWN_CHARS` (`shown`; `.value` keeps it whole). A config file reports
    it as a `ConfigError` that adds the file and the table."""

    def __init__(self, field: str, value: object, allowed: str) -> None:
        super().__init__(f"{field}={shown(value)}; must be {allowed}")
        self.field, self.value, self.allowed = field, value, allowed


class ConfigError(EtjaxError):
    """A config file is missing, malformed, or has an unknown key or a bad value."""


class JobError(EtjaxError):
    """A batch job cannot go on: its output cannot be written, or another process holds it.
    What the job wrote before stays valid, and rerunning the same command resumes it."""


class JobInterrupted(JobError):
    """A batch job stopped on SIGTERM or SIGINT after saving every completed result."""

    def __init__(self, message: str, signal_number: int) -> None:
        super().__init__(message)
        self.signal_number = signal_number


class CalibrationError(EtjaxError):
    """A calibration file is missing, malformed, or does not fit the model it is loaded with."""
