"""API keys, tenants and roles: the one server interceptor every kvplan service runs (`Gate`).

A client sends `authorization: Bearer <key>` metadata. The keys file (`KVPLAN_AUTH_KEYS_FILE`,
YAML or JSON, `kvcore.keyfile`) maps each key's SHA-256 to its tenant, role and weight; the keys
themselves are never stored.

The gate answers UNAUTHENTICATED without a known key and PERMISSION_DENIED for an admin method
called with a `user` key — both from the call's metadata, before its message is read; it
decodes the request itself, so bytes that are no message of the method's type are
INVALID_ARGUMENT (not gRPC's UNKNOWN). The servicers read the caller with
`caller()` and act for `acting_tenant(...)`: a `user` key acts for its own tenant only, an
`admin` key (the services' own key among them) may name any. Health and reflection stay open.
The file is re-read when it changes, so `kvplan keys add` takes effect without a restart.
"""
from __future__ import annotations

import asyncio
import contextvars
from typing import Callable

import grpc
import redis.exceptions
from google.protobuf.message import DecodeError

from kvcore.allocator import give_back
from kvcore.keyfile import Identity, KeyRing, check_tenant, printable

OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
ADMIN_METHODS = frozenset({"/kvplan.v1.Planner/SetStrategy", "/kvplan.v1.Planner/DeleteStrategy"})

ANONYMOUS = Identity(tenant="", role="admin", authenticated=False)     # KVPLAN_AUTH=off
_CALLER: contextvars.ContextVar[Identity] = contextvars.ContextVar("kvplan_caller", default=ANONYMOUS)


def caller() -> Identity:
    """Who made the RPC being served (ANONYMOUS when authentication is off)."""
    return _CALLER.get()


class Denied(Exception):
    """The caller may not act for that tenant (PERMISSION_DENIED)."""


def acting_tenant(requested: str, default: str = "default", field: str = "tenant") -> str:
    """The tenant a request acts for: the key's own; an admin key (or anyone, with authentication
    off) may name another in `requested`. Denied for a user naming another tenant; ValueError
    for a malformed name."""
    who = caller()
    if requested and requested != who.tenant:
        if who.role != "admin":
            raise Denied(f"{field}: a {who.role} key of tenant {who.tenant!r} cannot act for another tenant")
        return check_tenant(requested, field)
    return requested or who.tenant or default


def _bearer(metadata) -> str:
    for k, v in metadata or ():
        if k == "authorization":
            scheme, _, key = (v if isinstance(v, str) else v.decode()).partition(" ")
            return key.strip() if scheme.lower() == "bearer" else ""
    return ""


# what a servicer meets when a store it uses went away (Redis): UNAVAILABLE, never UNKNOWN
UNREACHABLE = (ConnectionError, redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
TRIM_AFTER_BYTES = 1 << 20      # a refused request at least this large gives its memory back to the OS ...
TRIM_DELAY_S = 0.5              # ... this long after its refusal (when gRPC and the call let go of its bytes)


async def _unavailable(context, e: Exception) -> None:
    await context.abort(grpc.StatusCode.UNAVAILABLE, f"a store this service uses is unreachable "
                                                     f"({type(e).__name__}: {printable(str(e), 200)}); retry")


class Gate(grpc.aio.ServerInterceptor):
    """Authenticates, authorizes admin methods, bounds the request's size by the caller's role,
    decodes the request, and sets `caller()`.

    The caller is known from the call's metadata before its message is read: a call without a
    known key (or a user key on an admin method) is refused by a handler that never reads it, so
    a keyless caller's 50 MB message costs the service nothing (issue 42: ten keyless 50 MB Plan
    calls grew the planner by 690 MB, which it kept). gRPC's own receive limit is the service's
    largest (an admin's: the executor's statistics to the planner); `max_request_bytes(role)` is
    the caller's, checked on the raw bytes before they are decoded, so a user key's oversized
    request costs no decoding (RESOURCE_EXHAUSTED), and its bytes go back to the OS
    (`allocator.give_back`: a process that holds freed memory for its model would keep them)."""

    def __init__(self, keys: KeyRing | None, max_request_bytes: Callable[[str], int] | None = None):
        self.keys = keys
        self.max_request_bytes = max_request_bytes

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(OPEN_SERVICES) or handler.request_streaming:
            return handler
        who, refusal = self._identify(details.invocation_metadata)
        if refusal is None and method in ADMIN_METHODS and who.role != "admin":
            refusal = (grpc.StatusCode.PERMISSION_DENIED, f"{method.rsplit('/', 1)[-1]} needs an admin key")
        if refusal is not None:
            return _refusing(handler, *refusal)
        limit = self.max_request_bytes(who.role) if self.max_request_bytes else None

        async def admit(raw: bytes, context):
            if limit is not None and len(raw) > limit:
                if len(raw) >= TRIM_AFTER_BYTES:          # once the call has let go of its bytes
                    asyncio.get_running_loop().call_later(TRIM_DELAY_S, give_back)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"request: {len(raw)} bytes, more than the {limit} a {who.role} key may send "
                                    f"to this service (docs/security.md, limits before work)")
            try:
                request = handler.request_deserializer(raw) if handler.request_deserializer else raw
            except (DecodeError, ValueError, TypeError, RuntimeError) as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid message ({e})")
            _CALLER.set(who)
            return request

        if handler.unary_unary:
            async def unary(raw, context):
                request = await admit(raw, context)
                try:
                    return await handler.unary_unary(request, context)
                except UNREACHABLE as e:
                    await _unavailable(context, e)
            return grpc.unary_unary_rpc_method_handler(unary, None, handler.response_serializer)

        async def stream(raw, context):
            request = await admit(raw, context)
            try:
                async for item in handler.unary_stream(request, context):
                    yield item
            except UNREACHABLE as e:
                await _unavailable(context, e)
        return grpc.unary_stream_rpc_method_handler(stream, None, handler.response_serializer)

    def _identify(self, metadata) -> tuple[Identity, tuple | None]:
        """(the caller, None), or (ANONYMOUS, (code, message)) when the call is refused."""
        if self.keys is None:
            return ANONYMOUS, None
        key = _bearer(metadata)
        if not key:
            return ANONYMOUS, (grpc.StatusCode.UNAUTHENTICATED, "no API key: send `authorization: Bearer <key>` "
                                                                "(the CLI sends KVPLAN_API_KEY)")
        who = self.keys.lookup(key)
        if who is None:
            return ANONYMOUS, (grpc.StatusCode.UNAUTHENTICATED, "unknown API key")
        return who, None


def _refusing(handler, code: grpc.StatusCode, message: str):
    """A handler for `handler`'s method that answers `code` without reading the request: a
    request-streaming handler, whose message gRPC only reads when the handler asks for it."""
    async def refuse(requests, context):
        await context.abort(code, message)

    if handler.unary_unary:
        return grpc.stream_unary_rpc_method_handler(refuse, None, handler.response_serializer)

    async def refuse_stream(requests, context):
        await context.abort(code, message)
        yield                                             # (a generator: never reached)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, None, handler.response_serializer)
