"""The keys file: API keys' hashes mapped to a tenant, a role and a weight, read by every server
(`KeyRing`, re-read when it changes) and written by `kvplan keys add` and `kvplan up`.

    keys:
      "sha256:9f86d08...": {tenant: acme, role: user, weight: 2}
      "sha256:60303ae...": {tenant: ops, role: admin}

Keys themselves are never stored. A tenant is letters, digits and `_.-` (at most 64), so it can
never forge a log line or a segment name; `weight` (default 1, at most 1000) is the tenant's
share in fair admission (`executor.fairness`). `kvplan up` marks the keys it makes (`origin`)
and replaces only those on its next start: keys added with `kvplan keys add` stay.
"""
from __future__ import annotations

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

import yaml

from kvcore.config import ConfigError, SecurityConfig, from_env

ROLES = ("user", "admin")
TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
KEY_PREFIX = "kvp_"


@dataclass(frozen=True)
class Identity:
    tenant: str          # "" when authentication is off (the request names its tenant)
    role: str            # "user" | "admin"
    authenticated: bool = True
    weight: float = 1.0  # the tenant's share in fair admission (executor.fairness)



def check_tenant(tenant: str, field: str = "tenant") -> str:
    """A tenant name a request or a key file gives: ValueError naming `field` unless it matches
    TENANT (letters, digits, `_.-`; so it can never forge a log line or a segment name)."""
    if not TENANT.match(tenant):
        raise ValueError(f"{field}: must match {TENANT.pattern} (letters, digits, _ . -; at most 64), "
                         f"got {printable(tenant)}")
    return tenant



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
        self._checked, self._mtime, self._keys, self._weights = 0.0, None, {}, {}
        self._load()

    def lookup(self, key: str) -> Identity | None:
        self._refresh()
        return self._keys.get(hash_key(key))

    def weight(self, tenant: str) -> float:
        """The tenant's weight in fair admission: the largest its keys give (1 when none says)."""
        self._refresh()
        return self._weights.get(tenant, 1.0)

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._checked > 1.0:
            with self._lock:
                self._checked = now
                try:
                    if self.path.stat().st_mtime_ns != self._mtime:
                        self._load()
                except (OSError, ConfigError):
                    pass                     # keep the keys we have; the next change is read again

    def _load(self) -> None:
        try:
            mtime = self.path.stat().st_mtime_ns
            self._keys = read_keys(self.path)
            weights: dict[str, float] = {}
            for who in self._keys.values():
                weights[who.tenant] = max(weights.get(who.tenant, 0.0), who.weight)
            self._weights = weights
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
            weight = check_weight(entry.get("weight", 1.0), f"keys.{h[:15]}....weight")
        except ValueError as e:
            raise ConfigError(f"{path}: {e}") from None
        out[h] = Identity(tenant, entry["role"], weight=weight)
    return out


MAX_WEIGHT = 1000.0


def check_weight(weight, field: str = "weight") -> float:
    """A tenant's weight: a number in (0, 1000]; ValueError naming `field` otherwise."""
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= MAX_WEIGHT:
        raise ValueError(f"{field}: must be a number in (0, {MAX_WEIGHT:g}], got {printable(str(weight))}")
    return float(weight)


def add_key(path: str | Path, tenant: str, role: str, weight: float | None = None, origin: str = "") -> str:
    """A new key for tenant/role: its hash joins the file (created 0600), the key is returned
    (and shown once: only its hash is kept). `weight`: the tenant's share in fair admission;
    `origin`: who made it (`kvplan up` marks its own, to replace them on the next `up`)."""
    check_tenant(tenant)
    if role not in ROLES:
        raise ValueError(f"role: must be one of {', '.join(ROLES)}, got {role!r}")
    if weight is not None:
        check_weight(weight)
    path = Path(path)
    data = yaml.safe_load(path.read_text()) if path.exists() else None
    data = data if isinstance(data, dict) else {}
    entries = data.setdefault("keys", {})
    key = new_key()
    entry = {"tenant": tenant, "role": role, "added": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if weight is not None:
        entry["weight"] = weight
    if origin:
        entry["origin"] = origin
    entries[hash_key(key)] = entry
    _write_keys(path, data)
    return key


def _write_keys(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "w") as f:                       # mkstemp: 0600
        json.dump(data, f, indent=1)
    os.replace(tmp, path)                               # atomic: a reader never sees half a file


ADMIN_KEY_FILE, KEYS_FILE = "admin.key", "keys.json"     # in a `kvplan up` cluster's state dir


UP_ORIGIN = "kvplan up"


def cluster_keys(state: Path, environ: dict) -> dict[str, str]:
    """The env a `kvplan up` cluster's services run with: a keys file in the state dir holding an
    admin key (saved 0600 as admin.key, which the CLI then uses) and the services' own key. The
    keys an earlier `kvplan up` made are replaced; every other key of the file (`kvplan keys
    add`) stays. None of it when KVPLAN_AUTH=off; when the caller brings KVPLAN_AUTH_KEYS_FILE,
    the services' key (KVPLAN_API_KEY) must be an admin key of that file (ConfigError if not:
    every job would fail UNAUTHENTICATED)."""
    sec = from_env(SecurityConfig, environ)
    if not sec.auth_on:
        return {}
    if sec.keys_file:
        check_services_key(sec)
        return {}
    keys = state / KEYS_FILE
    if keys.exists():                                   # drop the last `up`'s own keys, keep the rest
        data = yaml.safe_load(keys.read_text()) or {}
        data = data if isinstance(data, dict) else {}
        entries = data.get("keys") if isinstance(data.get("keys"), dict) else {}
        data["keys"] = {h: e for h, e in entries.items() if not (isinstance(e, dict) and e.get("origin") == UP_ORIGIN)}
        _write_keys(keys, data)
    admin = add_key(keys, "admin", "admin", origin=UP_ORIGIN)
    service = add_key(keys, "kvplan-services", "admin", origin=UP_ORIGIN)
    fd = os.open(state / ADMIN_KEY_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(admin + "\n")
    return {"KVPLAN_AUTH": "on", "KVPLAN_AUTH_KEYS_FILE": str(keys), "KVPLAN_API_KEY": service}


def check_services_key(sec: SecurityConfig) -> None:
    """KVPLAN_API_KEY is an admin key of KVPLAN_AUTH_KEYS_FILE (what services send each other)."""
    path = Path(sec.keys_file)
    if not path.exists():
        raise ConfigError(f"KVPLAN_AUTH_KEYS_FILE={path}: no such file")
    if not sec.api_key:
        raise ConfigError(f"KVPLAN_AUTH_KEYS_FILE={path} is set but KVPLAN_API_KEY is not: the services need an "
                          "admin key of that file to call each other (make one with `kvplan keys add --tenant "
                          f"kvplan-services --role admin --file {path}` and export it as KVPLAN_API_KEY)")
    who = read_keys(path).get(hash_key(sec.api_key))
    if who is None or who.role != "admin":
        raise ConfigError(f"KVPLAN_API_KEY is {'a user key' if who else 'not a key'} of KVPLAN_AUTH_KEYS_FILE={path}: "
                          "the services need an admin key of that file to call each other (`kvplan keys add "
                          f"--tenant kvplan-services --role admin --file {path}`)")


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
