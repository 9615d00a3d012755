"""The API key of an HTTP request, as the gRPC metadata the executor checks it in: the gateway
never sends a key of its own, and refuses one gRPC could not carry."""
from __future__ import annotations

from fastapi import Request

from kvplan.openai_errors import ApiError

MAX_KEY_CHARS = 512             # an API key's length (kvplan's own are 47 characters)


def metadata(request: Request) -> tuple[tuple[str, str], ...]:
    """The request's `Authorization: Bearer <key>` as the gRPC metadata the executor checks. 401
    in OpenAI's shape for a header that is no Bearer key of 1 to MAX_KEY_CHARS visible ASCII
    characters: gRPC refuses other bytes in metadata (`Bearer a b\\tc` was a 500 "Invalid
    metadata") and metadata over its limit (a 60 KB key was 413 with gRPC's text)."""
    auth = request.headers.get("authorization")
    if auth is None:
        return ()
    scheme, _, key = auth.strip().partition(" ")
    if scheme.lower() != "bearer":
        raise _unauthorized("Authorization: must be `Bearer <API key>`")
    if not 1 <= len(key) <= MAX_KEY_CHARS:
        raise _unauthorized(f"Authorization: the API key must be 1 to {MAX_KEY_CHARS} characters, got {len(key)}")
    if not all("!" <= c <= "~" for c in key):
        raise _unauthorized("Authorization: the API key must be visible ASCII characters (no spaces, tabs or "
                            "control characters)")
    return (("authorization", f"Bearer {key}"),)


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
