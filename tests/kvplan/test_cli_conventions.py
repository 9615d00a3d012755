"""CLI conventions: --version; flags checked before any service starts (exit 2 at once, naming the
flag; --floor without --budget adaptive too); a broken pipe ends quietly; an address that does
not answer gets a hint to `kvplan up`; a degraded job or a budget not held is warned on stderr
whatever the output mode, and exits 3 under --strict; a job refused once planned (a budget its
strategy cannot hold) exits 2 naming the flag; `--json` gives every count as a JSON number; a
cache above 1 says why (over a scripted executor); `kvplan demo` prints both answers and both
caches' bytes (the real model)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvplan import cli, demo
from cachestore.process import free_port
from protos import executor_pb2 as pb
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
    (["--floor", "0.2", "--ratio", "0.3", "hi"], "--floor: the lowest ratio of an adaptive budget: give it with "
                                                 "--budget adaptive (got --floor 0.2 with --ratio)"),
    (["--floor", "0", "hi"], "--floor: the lowest ratio of an adaptive budget"),
    (["--stop", "", "hi"], "stop[0]: must be 1 to 256 characters"),
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
    assert ("snapkv plan could not promise reserve ratio 0.5 at every step: it keeps at least 32 of the 52 "
            "prompt tokens") in err
    assert "measured at its end, after 1 tokens, it held 1.085" in err
    assert cli.main(["generate", "--strict", "--strategy", "snapkv", "--ratio", "0.5", "hi"]) == 3


def test_a_clean_job_has_no_warning_and_strict_exits_0(fake, capsys):
    fake.script.events = events((1, ["Hi"]), result=result("Hi", budget_met=True))
    assert cli.main(["generate", "--strict", "--ratio", "0.2", "hi"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert fake.script.requests[0].budget.reserve_ratio == pytest.approx(0.2)


def test_a_full_cache_over_1_by_its_last_blocks_is_said_but_not_warned(fake, capsys):
    fake.script.events = events((1, ["Hi"]), result=result("Hi", strategy="full", budget_met=True, prompt_tokens=52,
                                                           kv_bytes=1008, reserve_ratio=1.008))
    assert cli.main(["generate", "--strict", "--strategy", "full", "--ratio", "1", "hi"]) == 0
    err = capsys.readouterr().err
    assert "warning" not in err and "reserve ratio 1.008, above 1: the pool holds whole blocks" in err
    fake.script.events = events((1, ["Hi"]), result=result("Hi", strategy="snapkv", budget_met=True, prompt_tokens=52,
                                                           kv_bytes=508, reserve_ratio=0.508))
    assert cli.main(["generate", "--strict", "--strategy", "snapkv", "--ratio", "0.5", "hi"]) == 3
    assert "held reserve ratio 0.508, above the 0.5 asked" in capsys.readouterr().err


def test_a_budget_refused_once_planned_exits_2_naming_the_flag(fake, capsys):
    why = ("auto cannot hold reserve ratio 0.3 on this job (412 prompt tokens, 128 new tokens): the budget leaves "
           "the prompt 19 tokens per KV head; reserve ratio 0.34 fits")
    fake.script.events = events((1, [])) + [pb.JobEvent(job_id="job0", attempt=1, status=pb.JobStatus(
        job_id="job0", state=pb.FAILED, error=f"budget.reserve_ratio: {why}", error_field="budget.reserve_ratio"))]
    assert cli.main(["generate", "--ratio", "0.3", "hi"]) == 2
    assert f"kvplan: error: --ratio: {why}" in capsys.readouterr().err


def test_json_gives_every_count_as_a_number(fake, capsys):
    fake.script.events = events((1, ["Hi"]), result=result(
        "Hi", budget_floor_tokens=36, kv_reserved_bytes=5_000_000, predicted_kv_bytes=4_000_000,
        per_layer=[pb.LayerStats(layer=0, kept_tokens=40, kv_bytes=100, full_kv_bytes=500, kind="quant")],
        offload=pb.OffloadStats(host_kv_bytes=7), shrinks=[pb.Shrink(ratio=0.5, kv_bytes_before=9)]))
    assert cli.main(["generate", "--json", "hi"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["budget_floor_tokens"], got["kv_reserved_bytes"], got["predicted_kv_bytes"]) == (36, 5_000_000, 4_000_000)
    assert got["per_layer"][0]["kept_tokens"] == 40 and got["offload"]["host_kv_bytes"] == 7
    assert got["shrinks"][0]["kv_bytes_before"] == 9
    ints = [got[k] for k in ("prompt_tokens", "generated_tokens", "kv_bytes", "full_kv_bytes")]
    assert all(type(x) is int for x in ints + [got["budget_floor_tokens"], got["kv_reserved_bytes"]])


def test_a_cache_above_the_full_one_says_why(fake, capsys):
    fake.script.events = events((1, ["Paris"]), result=result("Paris", strategy="full", prompt_tokens=40,
                                                              generated_tokens=1, kv_bytes=1200, full_kv_bytes=1025,
                                                              reserve_ratio=1.171))
    assert cli.main(["generate", "hi"]) == 0
    err = capsys.readouterr().err
    assert "reserve ratio 1.171, above 1: the pool holds whole blocks of 16 rows per KV head and layer" in err


def test_held_back_text_is_printed_from_the_result(fake, capsys):
    """A stop sequence's possible start is held back from the deltas; the result has the rest."""
    fake.script.events = events((1, ["Par"]), result=result("Paris", finish_reason="stop"))
    assert cli.main(["generate", "--stop", "\n\n", "hi"]) == 0
    assert capsys.readouterr().out.startswith("Paris\n")
    assert list(fake.script.requests[0].stop) == ["\n\n"]


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


@pytest.mark.parametrize("strict", [False, True])
def test_an_answer_at_risk_warns_and_json_carries_its_risk(fake, capsys, strict):
    fake.script.events = events((1, ["1234"]), result=result("The number is 1234.", strategy="snapkv",
                                                             kv_risk=0.25, kv_at_risk=True))
    code = cli.main(["generate", "--json", *(["--strict"] if strict else []), "--ratio", "0.2", "hi"])
    out, err = capsys.readouterr()
    got = json.loads(out)
    assert got["kv_risk"] == 0.25 and got["kv_at_risk"] is True
    assert "kvplan: warning: job job0's answer is AT RISK from its compression (snapkv" in err
    assert "25% of it is not copied from the prompt" in err
    assert code == (3 if strict else 0)
