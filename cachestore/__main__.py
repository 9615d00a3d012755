"""`python -m cachestore`: serve until SIGTERM/SIGINT (settings: KVPLAN_* env)."""
from kvplan.launch import run

if __name__ == "__main__":
    run("cachestore")
