"""`python -m executor`: serve until SIGTERM/SIGINT (settings: KVPLAN_* env)."""
import sys

from kvplan.launch import run

if __name__ == "__main__":
    sys.exit(run("executor"))
