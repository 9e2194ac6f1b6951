"""`ServeLimits`: what the server allows a client, set by `etjax serve`'s flags."""

from __future__ import annotations

from dataclasses import dataclass

from etjax.errors import FieldError


@dataclass(frozen=True)
class ServeLimits:
    """max_body_bytes: a request body's size (413 past it). max_tokens: the most tokens one
    sample may ask for (`max_tokens`, 400 past it); a request that gives none takes the run
    config's [request] max_new_tokens. max_waiting: requests queued beyond the engine's
    resident rows (429 past it, with Retry-After). request_timeout: seconds a request may take
    from arrival to its last token (504 past it; its pages are freed). grace_period: seconds
    in-flight requests get to finish after SIGTERM before they are cut."""

    max_body_bytes: int = 1 << 20
    max_tokens: int = 4096
    max_waiting: int = 256
    request_timeout: float = 600.0
    grace_period: float = 30.0

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_tokens", "max_waiting"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise FieldError(name, value, "a positive integer")
        for name in ("request_timeout", "grace_period"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise FieldError(name, value, "a positive number of seconds")
