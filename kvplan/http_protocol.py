"""The HTTP/1.1 protocol the HTTP API serves with: uvicorn's h11 protocol, its own refusals in
OpenAI's error shape too.

uvicorn answers a request h11 cannot parse — `Content-Length: -1`, a header line too long, a
broken request line — itself, before any ASGI app runs, with a plain-text 400 "Invalid HTTP
request received." (issue 42). Here that answer is `{"error": {...}}` like every other error of
the API, with h11's own status hint (431 for headers too large). Always h11 (never httptools,
which uvicorn picks when it is installed), so the answer does not depend on what else is
installed.
"""
from __future__ import annotations

import json
import sys
from http import HTTPStatus

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvplan.openai_errors import ApiError

CODES = {400: "invalid_request", 413: "request_too_large", 414: "uri_too_long",
         431: "request_header_fields_too_large"}


class Protocol(H11Protocol):
    def send_400_response(self, msg: str) -> None:
        """uvicorn calls this while it handles h11's `RemoteProtocolError` (the exception at hand
        carries h11's status hint)."""
        error = sys.exc_info()[1]
        status = getattr(error, "error_status_hint", 400) if isinstance(error, h11.RemoteProtocolError) else 400
        detail = str(error) if isinstance(error, h11.RemoteProtocolError) and str(error) else msg
        body = json.dumps(ApiError(status, f"malformed HTTP request: {detail}", code=CODES.get(status)).body()).encode()
        try:
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            event = h11.Response(status_code=status, reason=HTTPStatus(status).phrase.encode(), headers=headers)
            self.transport.write(self.conn.send(event))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:                   # a response had started: nothing more can be said
            pass
        self.transport.close()
