"""CLI conventions: --version; flags checked before any service starts (exit 2 at once, naming the
flag); a broken pipe ends quietly; an address that does not answer gets a hint to `kvplan up`;
a degraded job or a budget not held is warned on stderr whatever the output mode, and exits 3
under --strict (over a scripted executor); `kvplan demo` prints both answers and both caches'
bytes (the real model)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvplan import cli, demo
from tests.conftest import free_port
from tests.kvplan.fake_executor import FakeExecutor, events, result

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_cluster(monkeypatch, tmp_path):
    monkeypatch.setenv("KVPLAN_CACHE_DIR", str(tmp_path))
    for name in ("KVPLAN_EXECUTOR_ADDR", "KVPLAN_PLANNER_ADDR"):
        monkeypatch.delenv(name, raising=False)


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == "kvplan 0.1.0"


@pytest.mark.parametrize("argv, words", [
    (["--ratio", "1.5", "hi"], "--ratio: must be in (0, 1], got 1.5"),
    (["--kv-tokens", "0", "hi"], "--kv-tokens: must be in [1,"),
    (["--max-new-tokens", "0", "hi"], "--max-new-tokens: must be in [1,"),
    (["--seed", "-1", "hi"], "--seed: must be in [0,"),
    (["--top-p", "2", "hi"], "--top-p: must be in (0, 1]"),
    (["--temperature", "-1", "hi"], "--temperature:"),
    (["--strategy", "nope", "hi"], "--strategy: unknown strategy 'nope'"),
    (["   "], "PROMPT: must not be empty"),
])
def test_bad_flags_exit_2_before_any_service_starts(no_cluster, monkeypatch, capsys, argv, words):
    import kvplan.embedded
    monkeypatch.setattr(kvplan.embedded, "Embedded", None)       # starting the services would fail loudly
    assert cli.main(["generate", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and "embedded" not in err


def test_a_broken_pipe_ends_quietly():
    """`kvplan strategies | head -1`: the reader left before the output was written."""
    code = ("import os, sys; r, w = os.pipe(); os.close(r); os.dup2(w, 1); "
            "from kvplan.cli import main; sys.exit(main(['strategies']))")
    got = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "KVPLAN_CACHE_DIR": "/nonexistent-kvplan"})
    assert got.returncode == 141 and "Traceback" not in got.stderr and "Exception ignored" not in got.stderr


def test_an_address_that_does_not_answer_gets_a_hint(no_cluster, monkeypatch, capsys):
    monkeypatch.setenv("KVPLAN_EXECUTOR_ADDR", f"127.0.0.1:{free_port()}")
    monkeypatch.setenv("KVPLAN_CLIENT_TIMEOUT_S", "5")
    assert cli.main(["generate", "hi"]) == 1
    err = capsys.readouterr().err
    assert "UNAVAILABLE" in err and "hint:" in err and "`kvplan up`" in err


@pytest.fixture
def fake(no_cluster, monkeypatch):
    with FakeExecutor() as fx:
        monkeypatch.setenv("KVPLAN_EXECUTOR_ADDR", fx.address)
        yield fx


@pytest.mark.parametrize("strict", [False, True])
def test_a_degraded_job_warns_on_stderr_even_with_json(fake, capsys, strict):
    fake.script.events = events((1, ["Paris"]), result=result("Paris", strategy="full", degraded=True,
                                                              kv_bytes=1000, reserve_ratio=1.0))
    code = cli.main(["generate", "--json", *(["--strict"] if strict else []), "What is the capital of France?"])
    out, err = capsys.readouterr()
    assert json.loads(out)["degraded"] is True                    # stdout: exactly the JSON object
    assert "kvplan: warning: job job0 ran DEGRADED" in err
    assert code == (3 if strict else 0)


def test_a_budget_not_held_warns_with_the_floor(fake, capsys):
    fake.script.events = events((1, ["Hi"]), result=result("Hi", strategy="snapkv", budget_met=False,
                                                           budget_floor_tokens=32, prompt_tokens=52,
                                                           kv_bytes=1085, reserve_ratio=1.085))
    assert cli.main(["generate", "--strategy", "snapkv", "--ratio", "0.5", "hi"]) == 0
    err = capsys.readouterr().err
    assert "could not hold reserve ratio 0.5: snapkv keeps at least 32 of the 52 prompt tokens" in err
    assert "held 1.085" in err
    assert cli.main(["generate", "--strict", "--strategy", "snapkv", "--ratio", "0.5", "hi"]) == 3


def test_a_clean_job_has_no_warning_and_strict_exits_0(fake, capsys):
    fake.script.events = events((1, ["Hi"]), result=result("Hi", budget_met=True))
    assert cli.main(["generate", "--strict", "--ratio", "0.2", "hi"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert fake.script.requests[0].budget.reserve_ratio == pytest.approx(0.2)


def test_demo_prints_both_answers_and_both_byte_counts(embedded):
    lines = []
    assert demo.run(embedded.executor_addr, 600, out=lines.append) == 0
    text = "\n".join(lines)
    print(text)
    full = next(line for line in lines if line.startswith("full "))
    auto = next(line for line in lines if line.startswith("auto "))
    held = lambda row: int(row.split()[1].replace(",", ""))          # noqa: E731
    assert "[full]" in text and "[auto at 0.2]" in text
    assert 0 < held(auto) < 0.25 * held(full) and "auto held" in text
