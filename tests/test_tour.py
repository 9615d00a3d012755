"""The tour works as written (issue 41): README.md's "A 60-second tour" CLI commands, then
docs/http-api.md's `openai` and SDK examples, against a real `kvplan up` cluster with the shipped
document (examples/report.txt) — every one answered; the streamed example whose budget the
prompt cannot hold raises `openai.BadRequestError` before any chunk. Before, the tour's first
compressed command was refused on a 349-token report the repository did not ship, and the
streaming example raised a bare `APIError` mid-stream.

New tokens default to 16 here (KVPLAN_DEFAULT_MAX_NEW_TOKENS, read by the executor and by
`kvplan plan` alike) so the commands run as written in a few minutes; `make setup` says what it is
doing (no silent minutes of pip)."""
import contextlib
import io
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_cluster import _up_env

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "examples" / "report.txt"


def _block(page: Path, after: str, lang: str) -> list[str]:
    """Every `lang` code block after a line `after` in `page`."""
    return re.findall(rf"{re.escape(after)}\s*```{lang}\n(.*?)```", page.read_text(), re.S)


def _tour_commands() -> list[list[str]]:
    """The README tour's `kvplan` command lines, as argv (comments dropped)."""
    text = (ROOT / "README.md").read_text()
    tour = text.split("## A 60-second tour", 1)[1]
    block = re.search(r"```sh\n(.*?)```", tour, re.S).group(1)
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.startswith("kvplan ")]


def test_the_shipped_document_is_long_enough_for_the_tours_budget():
    """At ~2,900 tokens the floor auto keeps (sinks, window, 128 new tokens) is far below 0.2."""
    from transformers import AutoTokenizer
    from kvcore import model
    from kvcore.config import ModelConfig, from_env
    n = len(AutoTokenizer.from_pretrained(model.prepare(from_env(ModelConfig)))(DOC.read_text())["input_ids"])
    assert 2500 <= n <= 3500, n
    assert DOC.read_text().rstrip().endswith("The report was signed by Helena Okafor, Chair of the Board.")


def test_make_setup_says_what_it_is_doing():
    """Before: pip ran --quiet for about a minute of silence."""
    recipe = (ROOT / "Makefile").read_text()
    said = [line for line in recipe.splitlines() if line.strip().startswith("@echo")]
    for words in ("installing torch 2.13.0 (CPU)", "installing kvplan", "converting the model"):
        assert any(words in line for line in said), words
    lines = recipe.split("$(STAMP): pyproject.toml\n", 1)[1].split("\n\n", 1)[0].splitlines()   # the setup's installs
    for i, line in enumerate(lines):                    # each long pip install is announced just before it
        if "pip install" in line and "--upgrade pip" not in line:
            assert "echo" in lines[i - 1], line


@pytest.fixture
def tour(tmp_path, real_model_dir, monkeypatch):
    """A working directory holding examples/report.txt, and the env of a `kvplan up` cluster of
    its own (ports, state dir, keys) that the tour's `kvplan up` starts."""
    (tmp_path / "examples").mkdir()
    shutil.copy(DOC, tmp_path / "examples" / "report.txt")
    env = _up_env(tmp_path, KVPLAN_DEFAULT_MAX_NEW_TOKENS="16", PYTHONPATH=str(ROOT))
    monkeypatch.chdir(tmp_path)
    yield tmp_path, env
    subprocess.run([sys.executable, "-m", "kvplan.cli", "down"], cwd=tmp_path, env=env, capture_output=True,
                   timeout=120)


def _run(argv: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    assert argv[0] == "kvplan"
    return subprocess.run([sys.executable, "-m", "kvplan.cli", *argv[1:]], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)


def test_the_tour_runs_as_written_against_kvplan_up(tour, monkeypatch):
    pytest.importorskip("matplotlib")
    openai = pytest.importorskip("openai")
    cwd, env = tour
    commands = _tour_commands()
    assert commands[0] == ["kvplan", "up"] and commands[-1] == ["kvplan", "down"]
    assert sum("examples/report.txt" in argv for argv in commands) >= 3
    for argv in commands[:-1]:
        got = _run(argv, cwd, env)
        assert got.returncode == 0, (argv, got.stdout[-2000:], got.stderr[-3000:])
        if argv[1] == "generate":
            assert got.stdout.strip(), (argv, got.stderr)                      # answered
            if "--question" in argv and "--ratio" not in argv:
                assert "Okafor" in got.stdout, got.stdout                      # full KV: the signer
        if argv[1] == "plan":
            assert got.stdout.startswith("auto v1: ") and "refused" not in got.stderr, got.stderr
            assert (cwd / "plan.png").read_bytes()[:4] == b"\x89PNG"
        if argv[1] == "strategies":
            marked = [line.split()[0] for line in got.stdout.splitlines() if "[cannot compress this model" in line]
            assert marked == ["minicache"], got.stdout

    from kvcore.keyfile import ADMIN_KEY_FILE
    key = (cwd / "state" / ADMIN_KEY_FILE).read_text().strip()
    port, executor = env["KVPLAN_HTTP_PORT"], f"127.0.0.1:{env['KVPLAN_EXECUTOR_PORT']}"
    page = ROOT / "docs" / "http-api.md"
    streamed, refused = _block(page, "<!-- tour-openai -->", "python")
    scope = {"KEY": key}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(streamed.replace("127.0.0.1:8000", f"127.0.0.1:{port}"), scope)
    assert out.getvalue().split("\n")[0].strip(), out.getvalue()               # answered, at 0.2 of the report
    assert " of " in out.getvalue().rstrip().splitlines()[-1]                 # its usage: KV bytes of the full's
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(refused, scope)                                                  # the client of the block before
    assert out.getvalue().startswith("kv_ratio: auto cannot hold reserve ratio 0.2 on this job"), out.getvalue()
    assert "ChatCompletionChunk" not in out.getvalue()                        # no chunk before the refusal
    with pytest.raises(openai.BadRequestError):                               # as the block says
        next(iter(scope["client"].chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Hello!"}], stream=True,
            extra_body={"kv_ratio": 0.2})))

    (sdk,) = _block(page, "<!-- tour-sdk -->", "python")
    monkeypatch.setenv("KVPLAN_API_KEY", key)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(sdk.replace("127.0.0.1:50052", executor), {"KEY": key})
    lines = out.getvalue().strip().splitlines()
    assert lines and lines[0].strip() and float(lines[-1]) > 0, out.getvalue()
