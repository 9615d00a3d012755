"""`kvplan keys add --tenant T --role user|admin [--weight W] [--file F]`: make an API key, print it once, and
add its hash to the keys file (KVPLAN_AUTH_KEYS_FILE, else the `kvplan up` cluster's). Servers
read the file again when it changes: the key works at once, no restart."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from kvcore import keyfile


def add_parser(sub) -> None:
    k = sub.add_parser("keys", help="API keys: `keys add --tenant T --role user|admin` prints a new key")
    k.add_argument("action", choices=["add"])
    k.add_argument("--tenant", required=True, help="the tenant the key acts for (letters, digits, _ . -)")
    k.add_argument("--role", choices=keyfile.ROLES, default="user", help="user (default) or admin")
    k.add_argument("--weight", type=float, default=None,
                   help="the tenant's share in fair admission (default 1; a tenant of weight 2 gets twice the tokens "
                        "of one of weight 1 while both wait)")
    k.add_argument("--file", type=Path, default=None,
                   help="the keys file (default: KVPLAN_AUTH_KEYS_FILE, else the `kvplan up` cluster's)")


def keys_file(args, state: Path) -> Path:
    if args.file is not None:
        return args.file
    if os.environ.get("KVPLAN_AUTH_KEYS_FILE"):
        return Path(os.environ["KVPLAN_AUTH_KEYS_FILE"])
    return state / keyfile.KEYS_FILE


def run(args, state: Path, usage_error) -> int:
    """`usage_error`: the CLI's exception for bad input (exit code 2)."""
    path = keys_file(args, state)
    try:
        key = keyfile.add_key(path, args.tenant, args.role, weight=args.weight)
    except ValueError as e:
        raise usage_error(f"keys add --{e}") from None
    print(key)
    print(f"kvplan: a {args.role} key of tenant {args.tenant}: its hash is in {path}; the key is shown only "
          f"this once (send it as KVPLAN_API_KEY)", file=sys.stderr)
    return 0
