"""gRPC channels and server ports with the process's security settings (`SecurityConfig`):
TLS from PEM files, and the API key sent as `authorization: Bearer <key>` on every call.

- a server with KVPLAN_TLS_CERT_FILE/KEY_FILE serves TLS only; with KVPLAN_TLS_CLIENT_AUTH it
  also requires a client certificate signed by KVPLAN_TLS_CA_FILE (mutual TLS);
- a client with KVPLAN_TLS_CA_FILE connects with TLS trusting that CA, and presents its own
  certificate (KVPLAN_TLS_CERT_FILE/KEY_FILE) when it has one — services calling each other
  with the same settings get mutual TLS;
- KVPLAN_API_KEY goes in the metadata of every call (a client interceptor, so it works on
  plain and TLS channels alike).
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import grpc

from kvcore.config import ConfigError, SecurityConfig, from_env


def _read(path: str, name: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{name}={path}: {e.strerror}") from None


def server_credentials(sec: SecurityConfig) -> grpc.ServerCredentials | None:
    """TLS credentials for a server port; None: plain TCP."""
    if not sec.tls_cert_file:
        return None
    pair = (_read(sec.tls_key_file, "KVPLAN_TLS_KEY_FILE"), _read(sec.tls_cert_file, "KVPLAN_TLS_CERT_FILE"))
    ca = _read(sec.tls_ca_file, "KVPLAN_TLS_CA_FILE") if sec.tls_client_auth else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=sec.tls_client_auth)


def channel_credentials(sec: SecurityConfig) -> grpc.ChannelCredentials | None:
    """TLS credentials for a client; None: plain TCP."""
    if not sec.tls_ca_file:
        return None
    key = cert = None
    if sec.tls_cert_file:
        key, cert = _read(sec.tls_key_file, "KVPLAN_TLS_KEY_FILE"), _read(sec.tls_cert_file, "KVPLAN_TLS_CERT_FILE")
    return grpc.ssl_channel_credentials(_read(sec.tls_ca_file, "KVPLAN_TLS_CA_FILE"), key, cert)


class _Details(NamedTuple):
    method: str
    timeout: float | None
    metadata: tuple | None
    credentials: object
    wait_for_ready: bool | None
    compression: object


class _SyncDetails(_Details, grpc.ClientCallDetails):
    pass


def _with_key(metadata, key: str) -> tuple:
    return (*(metadata or ()), ("authorization", f"Bearer {key}"))


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
              grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the API key to every call of a synchronous channel."""

    def __init__(self, key: str):
        self.key = key

    def _details(self, d) -> _SyncDetails:
        return _SyncDetails(d.method, d.timeout, _with_key(d.metadata, self.key), d.credentials,
                            getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


def _aio_details(d, key: str) -> grpc.aio.ClientCallDetails:
    return grpc.aio.ClientCallDetails(d.method, d.timeout, _with_key(d.metadata, key), d.credentials,
                                      d.wait_for_ready)


class _AioUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, key: str):
        self.key = key

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_aio_details(details, self.key), request)


class _AioUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, key: str):
        self.key = key

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_aio_details(details, self.key), request)


def client_channel(address: str, options: list | None = None, sec: SecurityConfig | None = None) -> grpc.Channel:
    """A synchronous channel to `address` with this process's TLS and API key."""
    sec = sec or from_env(SecurityConfig)
    creds = channel_credentials(sec)
    ch = grpc.secure_channel(address, creds, options=options) if creds else grpc.insecure_channel(address, options=options)
    return grpc.intercept_channel(ch, _Bearer(sec.api_key)) if sec.api_key else ch


def aio_channel(address: str, options: list | None = None, sec: SecurityConfig | None = None) -> grpc.aio.Channel:
    """An asyncio channel to `address` with this process's TLS and API key."""
    sec = sec or from_env(SecurityConfig)
    creds = channel_credentials(sec)
    interceptors = [_AioUnaryUnary(sec.api_key), _AioUnaryStream(sec.api_key)] if sec.api_key else None
    if creds:
        return grpc.aio.secure_channel(address, creds, options=options, interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
