"""bench.peer_shim: a peer's script written against the old module names runs on this checkout."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_script_importing_the_old_names_gets_kvcores_modules_and_its_arguments(tmp_path):
    script = tmp_path / "peer.py"
    script.write_text(
        "import sys\n"
        "from kvplan import model as models\n"
        "from kvplan.config import ModelConfig, from_env\n"
        "from bench import serve\n"
        "import kvcore.model, kvcore.config, bench.summary\n"
        "print(models is kvcore.model, from_env is kvcore.config.from_env, serve.pct is bench.summary.pct,\n"
        "      sys.argv[1:], __name__)\n")
    out = subprocess.run([sys.executable, "-m", "bench.peer_shim", str(script), "--jobs", "2"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == "True True True ['--jobs', '2'] __main__"


def test_without_a_script_it_says_how_to_call_it():
    r = subprocess.run([sys.executable, "-m", "bench.peer_shim"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode != 0 and "usage: python -m bench.peer_shim SCRIPT" in r.stderr
