"""`python -m planner` (and `kvplan serve planner`): serve until SIGTERM/SIGINT (settings: KVPLAN_* env)."""
import sys

from kvcore.config import PlannerConfig
from kvcore.launch import run


def build(cfg: PlannerConfig):
    from planner.service import build_service  # imported once logging is set up, as the service starts
    return build_service(cfg)


def main() -> int:
    return run(PlannerConfig, build)


if __name__ == "__main__":
    sys.exit(main())
