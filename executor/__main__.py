"""`python -m executor` (and `kvplan serve executor`): serve until SIGTERM/SIGINT (settings: KVPLAN_* env)."""
import sys

from kvcore.config import ExecutorConfig, ModelConfig, from_env
from kvcore.launch import run


def build(cfg: ExecutorConfig):
    from executor.service import build_service  # imported once logging is set up, as the service starts
    return build_service(cfg, from_env(ModelConfig))


def main() -> int:
    return run(ExecutorConfig, build)


if __name__ == "__main__":
    sys.exit(main())
