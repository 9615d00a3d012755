"""OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, for every error the
HTTP API answers: `ApiError`, its message and param bounded (`clip`: a client's 1 MB string is
never echoed whole, and a lone surrogate never breaks the JSON encoder), and `bad` for a 400
naming the parameter at fault."""
from __future__ import annotations

from typing import Any

MAX_ERROR_CHARS = 1000          # an error's message and param: a client's 1 MB string is never echoed whole


def clip(text: str | None, limit: int = MAX_ERROR_CHARS) -> str | None:
    """`text` cut to `limit` characters (with a mark) and without lone surrogates (unencodable)."""
    if text is None:
        return None
    text = text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit} more characters)"
    return text.encode("utf-8", "replace").decode()


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, its
    message and param bounded (`clip`)."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
             413: "invalid_request_error", 429: "rate_limit_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, clip(message), clip(param, 200), code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        kind = self.TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> ApiError:
    """400 `invalid_value` naming `param`."""
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")
