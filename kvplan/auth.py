"""API keys, tenants and roles: the one server interceptor every kvplan service runs (`Gate`).

A client sends `authorization: Bearer <key>` metadata. The keys file (`KVPLAN_AUTH_KEYS_FILE`,
YAML or JSON) maps each key's SHA-256 to its tenant and role; the keys themselves are never
stored:

    keys:
      "sha256:9f86d08...": {tenant: acme, role: user}
      "sha256:60303ae...": {tenant: ops, role: admin}

The gate answers UNAUTHENTICATED without a known key and PERMISSION_DENIED for an admin method
called with a `user` key; it decodes the request itself, so bytes that are no message of the
method's type are INVALID_ARGUMENT (not gRPC's UNKNOWN). The servicers read the caller with
`caller()` and act for `acting_tenant(...)`: a `user` key acts for its own tenant only, an
`admin` key (the services' own key among them) may name any. Health and reflection stay open.
The file is re-read when it changes, so `kvplan keys add` takes effect without a restart.
"""
from __future__ import annotations

import contextvars
import hashlib
import json
import os
import re
import secrets
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import redis.exceptions
import yaml
from google.protobuf.message import DecodeError

from kvplan.config import ConfigError, SecurityConfig, from_env

ROLES = ("user", "admin")
TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
ADMIN_METHODS = frozenset({"/kvplan.v1.Planner/SetStrategy", "/kvplan.v1.Planner/DeleteStrategy"})
KEY_PREFIX = "kvp_"


@dataclass(frozen=True)
class Identity:
    tenant: str          # "" when authentication is off (the request names its tenant)
    role: str            # "user" | "admin"
    authenticated: bool = True


ANONYMOUS = Identity(tenant="", role="admin", authenticated=False)     # KVPLAN_AUTH=off
_CALLER: contextvars.ContextVar[Identity] = contextvars.ContextVar("kvplan_caller", default=ANONYMOUS)


def caller() -> Identity:
    """Who made the RPC being served (ANONYMOUS when authentication is off)."""
    return _CALLER.get()


class Denied(Exception):
    """The caller may not act for that tenant (PERMISSION_DENIED)."""


def check_tenant(tenant: str, field: str = "tenant") -> str:
    """A tenant name a request or a key file gives: ValueError naming `field` unless it matches
    TENANT (letters, digits, `_.-`; so it can never forge a log line or a segment name)."""
    if not TENANT.match(tenant):
        raise ValueError(f"{field}: must match {TENANT.pattern} (letters, digits, _ . -; at most 64), "
                         f"got {printable(tenant)}")
    return tenant


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


def printable(s: str, limit: int = 80) -> str:
    """`s` for a log line: control characters escaped, at most `limit` characters, quoted."""
    return repr(s[:limit] + ("..." if len(s) > limit else ""))


def hash_key(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


class KeyRing:
    """The keys file, read again when its modification time changes (checked once a second)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._checked, self._mtime, self._keys = 0.0, None, {}
        self._load()

    def lookup(self, key: str) -> Identity | None:
        now = time.monotonic()
        if now - self._checked > 1.0:
            with self._lock:
                self._checked = now
                try:
                    if self.path.stat().st_mtime_ns != self._mtime:
                        self._load()
                except (OSError, ConfigError):
                    pass                     # keep the keys we have; the next change is read again
        return self._keys.get(hash_key(key))

    def _load(self) -> None:
        try:
            mtime = self.path.stat().st_mtime_ns
            self._keys = read_keys(self.path)
            self._mtime = mtime
        except OSError as e:
            raise ConfigError(f"KVPLAN_AUTH_KEYS_FILE={self.path}: {e.strerror}") from None


def read_keys(path: Path) -> dict[str, Identity]:
    """hash -> Identity from a keys file; ConfigError naming the entry at fault."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML or JSON: {' '.join(str(e).split())}") from None
    entries = data.get("keys", {}) if isinstance(data, dict) else None
    if not isinstance(entries, dict):
        raise ConfigError(f"{path}: must be a mapping with `keys: {{sha256:<hex>: {{tenant, role}}}}`")
    out = {}
    for h, entry in entries.items():
        if not (isinstance(h, str) and re.fullmatch(r"sha256:[0-9a-f]{64}", h)):
            raise ConfigError(f"{path}: keys: {printable(str(h))} is not sha256:<64 hex digits>")
        if not isinstance(entry, dict) or entry.get("role") not in ROLES:
            raise ConfigError(f"{path}: keys.{h[:15]}...: needs a tenant and a role ({' | '.join(ROLES)})")
        try:
            tenant = check_tenant(str(entry.get("tenant", "")), f"keys.{h[:15]}....tenant")
        except ValueError as e:
            raise ConfigError(f"{path}: {e}") from None
        out[h] = Identity(tenant, entry["role"])
    return out


def add_key(path: str | Path, tenant: str, role: str) -> str:
    """A new key for tenant/role: its hash joins the file (created 0600), the key is returned
    (and shown once: only its hash is kept)."""
    check_tenant(tenant)
    if role not in ROLES:
        raise ValueError(f"role: must be one of {', '.join(ROLES)}, got {role!r}")
    path = Path(path)
    data = yaml.safe_load(path.read_text()) if path.exists() else None
    data = data if isinstance(data, dict) else {}
    entries = data.setdefault("keys", {})
    key = new_key()
    entries[hash_key(key)] = {"tenant": tenant, "role": role, "added": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "w") as f:                       # mkstemp: 0600
        json.dump(data, f, indent=1)
    os.replace(tmp, path)                               # atomic: a reader never sees half a file
    return key


ADMIN_KEY_FILE, KEYS_FILE = "admin.key", "keys.json"     # in a `kvplan up` cluster's state dir


def cluster_keys(state: Path, environ: dict) -> dict[str, str]:
    """The env a `kvplan up` cluster's services run with: a keys file in the state dir holding an
    admin key (saved 0600 as admin.key, which the CLI then uses) and the services' own key. None
    of it when KVPLAN_AUTH=off, or when the caller brings KVPLAN_AUTH_KEYS_FILE (and then the
    services' KVPLAN_API_KEY) itself."""
    sec = from_env(SecurityConfig, environ)
    if not sec.auth_on or sec.keys_file:
        return {}
    keys = state / KEYS_FILE
    keys.unlink(missing_ok=True)                        # a new cluster, new keys
    admin = add_key(keys, "admin", "admin")
    service = add_key(keys, "kvplan-services", "admin")
    fd = os.open(state / ADMIN_KEY_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(admin + "\n")
    return {"KVPLAN_AUTH": "on", "KVPLAN_AUTH_KEYS_FILE": str(keys), "KVPLAN_API_KEY": service}


def use_cluster_key(state: Path) -> None:
    """The CLI's key: KVPLAN_API_KEY, else the admin key of the `kvplan up` cluster in `state`."""
    f = state / ADMIN_KEY_FILE
    if not os.environ.get("KVPLAN_API_KEY") and f.exists():
        os.environ["KVPLAN_API_KEY"] = f.read_text().strip()


def keyring(sec: SecurityConfig) -> KeyRing | None:
    """The keys a server checks; None when authentication is off."""
    if not sec.auth_on:
        return None
    if not sec.keys_file:
        raise ConfigError("authentication is on (KVPLAN_AUTH=on) but KVPLAN_AUTH_KEYS_FILE is not set: make one "
                          "with `kvplan keys add --tenant T --role admin`, or set KVPLAN_AUTH=off (local development)")
    return KeyRing(sec.keys_file)


def _bearer(context) -> str:
    for k, v in context.invocation_metadata() or ():
        if k == "authorization":
            scheme, _, key = (v if isinstance(v, str) else v.decode()).partition(" ")
            return key.strip() if scheme.lower() == "bearer" else ""
    return ""


# what a servicer meets when a store it uses went away (Redis): UNAVAILABLE, never UNKNOWN
UNREACHABLE = (ConnectionError, redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


async def _unavailable(context, e: Exception) -> None:
    await context.abort(grpc.StatusCode.UNAVAILABLE, f"a store this service uses is unreachable "
                                                     f"({type(e).__name__}: {printable(str(e), 200)}); retry")


class Gate(grpc.aio.ServerInterceptor):
    """Authenticates, authorizes admin methods, decodes the request, and sets `caller()`."""

    def __init__(self, keys: KeyRing | None):
        self.keys = keys

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(OPEN_SERVICES) or handler.request_streaming:
            return handler
        gate = self

        async def admit(raw: bytes, context):
            who = await gate._identify(context)
            if method in ADMIN_METHODS and who.role != "admin":
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{method.rsplit('/', 1)[-1]} needs an admin key")
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

    async def _identify(self, context) -> Identity:
        if self.keys is None:
            return ANONYMOUS
        key = _bearer(context)
        if not key:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "no API key: send `authorization: Bearer <key>` "
                                                                 "(the CLI sends KVPLAN_API_KEY)")
        who = self.keys.lookup(key)
        if who is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "unknown API key")
        return who
