"""`python -m executor` (and `kvplan serve executor`): serve until SIGTERM/SIGINT (settings: KVPLAN_* env)."""
import dataclasses
import sys

from kvcore.config import ExecutorConfig, ModelConfig, from_env
from kvcore.launch import run


def build(cfg: ExecutorConfig):
    from executor.service import build_service  # imported once logging is set up, as the service starts
    from kvcore import threads
    model_cfg = from_env(ModelConfig)
    threads.solo(model_cfg.threads)             # torch's threads: the engine thread's alone (kvcore/threads.py)
    return build_service(cfg, dataclasses.replace(model_cfg, threads=0))


def main() -> int:
    return run(ExecutorConfig, build)


if __name__ == "__main__":
    sys.exit(main())
