"""`python -m cachestore` (and `kvplan serve cachestore`): serve until SIGTERM/SIGINT (settings: KVPLAN_* env)."""
import sys

from kvcore.config import CachestoreConfig
from kvcore.launch import run


def build(cfg: CachestoreConfig):
    from cachestore.service import build_service  # imported once logging is set up, as the service starts
    return build_service(cfg)


def main() -> int:
    return run(CachestoreConfig, build)


if __name__ == "__main__":
    sys.exit(main())
