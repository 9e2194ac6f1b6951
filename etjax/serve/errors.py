"""OpenAI's error shape, and the HTTP status of each way a request can fail.

Every failure a client sees is `{"error": {"message", "type", "param", "code"}}` with a status
that says whose fault it is: 400 a bad body (the message names the field, `param` holds its
body name), 401 a missing or wrong API key, 404 an unknown model or route, 413 a body over the
size limit, 429 a full queue (with `Retry-After`), 503 while the model loads or the server
drains, 504 a request past its timeout, 500 a failure of the server itself.
"""

from __future__ import annotations

import json

from starlette.responses import Response

# status -> OpenAI's error type for it
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
    504: "timeout_error",
}


class ApiError(Exception):
    """A request's failure as the client sees it: status, message, the body field at fault
    (`param`) and a machine-readable `code`; `headers` ride along (Retry-After)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code, self.headers = code, headers or {}

    def body(self) -> dict:
        """The JSON object of OpenAI's error responses."""
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> Response:
        return json_response(self.body(), self.status, self.headers)


def json_bytes(content: object) -> bytes:
    """UTF-8 JSON; text holding a lone surrogate (a client may send "\\ud800", and a model
    name or stop string is echoed back) is written with ASCII escapes instead, so an answer
    is always valid JSON and never a failure to encode."""
    try:
        return json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def json_response(content: object, status: int = 200, headers: dict | None = None) -> Response:
    return Response(json_bytes(content), status, headers, media_type="application/json")
