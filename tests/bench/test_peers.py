"""bench.peers' table: kvplan's serve runs and the peers' results in one table, each row's ratio
against the named peer row; a missing peer script is said plainly."""
import json

import pytest

from bench import peers


def _write(tmp_path, name, data):
    p = tmp_path / name
    p.write_text(json.dumps(data))
    return str(p)


def test_one_table_with_ratios_against_the_named_peer(tmp_path, capsys):
    run = dict(strategy="auto", ratio=0.2, measured_ratio=0.198, most_decoding=16, decode_tps=120.0, output_tps=40.0,
               ttft=[60.0, 80.0, 90.0], correct=15, requests=20)
    serve = _write(tmp_path, "serve.json", {"runs": [dict(run, strategy="full", ratio=1.0, measured_ratio=1.0,
                                                          decode_tps=60.0, output_tps=20.0), run]})
    vllm = dict(vllm="0.32.0", dtype="bfloat16", most_decoding_steps=8, ttft=[30.0, 40.0, 50.0], correct=16, requests=20)
    fp8 = _write(tmp_path, "fp8.json", dict(vllm, kv_dtype="fp8", decode_tps=100.0, output_tps=50.0))
    bf16 = _write(tmp_path, "bf16.json", dict(vllm, kv_dtype="auto", decode_tps=80.0, output_tps=40.0))
    out = tmp_path / "t.json"
    peers.main(["table", "--serve", serve, "--vllm", bf16, fp8, "--against", "vLLM fp8", "--out", str(out)])
    text = capsys.readouterr().out
    assert "| kvplan auto 0.2 | 0.20 of fp16 | 16 | 120.0 | 1.20× | 40.00 | 0.80× | 60.0 | 15/20 |" in text
    assert "| vLLM 0.32.0 bf16 | fp8 | 8 | 100.0 | 1.00× | 50.00 | 1.00× |" in text
    assert text.rstrip().endswith("× against vLLM fp8")
    assert len(json.loads(out.read_text())["rows"]) == 4


def test_a_peer_without_its_scripts_is_refused_plainly(tmp_path):
    with pytest.raises(SystemExit, match="is not here: give --peers-dir"):
        peers.main(["run", "vllm", "--peers-dir", str(tmp_path)])


FAKE_VLLM = '''
import argparse, json, sys
from pathlib import Path
ap = argparse.ArgumentParser()
for a in ("--checkout", "--jobs", "--dtype", "--kv-cache-dtype", "--out", "--tag", "--requests", "--lengths"):
    ap.add_argument(a)
a = ap.parse_args()
lines = [json.loads(s) for s in open(a.jobs)]                   # the jobs bench.peers wrote for it
assert "kv_budget_bytes" in lines[0]["header"] and len(lines) == 1 + int(a.requests), lines[0]
if a.kv_cache_dtype == "fp8" and a.dtype == "float32":
    sys.exit("fp8 KV refused")                                   # this configuration does not start
tps = {"bfloat16": 60.0, "float32": 45.0}[a.dtype] * (2 if a.kv_cache_dtype == "fp8" else 1)
Path(a.out, f"vllm_peer-{a.tag}.json").write_text(json.dumps(dict(
    vllm="0.32.0", dtype=a.dtype, kv_dtype=a.kv_cache_dtype, most_decoding_steps=4, ttft=[10.0, 11.0, 12.0],
    correct=3, requests=int(a.requests), done=int(a.requests), decode_tps=tps * 2, output_tps=tps)))
'''


def test_best_vllm_keeps_the_fastest_configuration_that_starts(tmp_path, monkeypatch, capsys):
    peers_dir = tmp_path / "peers"
    (peers_dir / "vllm").mkdir(parents=True)
    (peers_dir / "vllm" / "run_vllm_peer.py").write_text(FAKE_VLLM)
    monkeypatch.setitem(peers.SCRIPTS, "vllm", ("vllm/run_vllm_peer.py", peers.Path(peers.sys.executable)))
    out = tmp_path / "results"
    with pytest.raises(SystemExit) as done:
        peers.main(["best", "vllm", "--peers-dir", str(peers_dir), "--dtypes", "float32", "bfloat16",
                    "--out", str(out), "--requests", "3", "--lengths", "300"])
    assert done.value.code == 0
    best = json.loads((out / "best_vllm.json").read_text())
    tried = [(c["dtype"], c["kv"], c["started"]) for c in best["candidates"]]
    assert tried == [("float32", "fp8", False), ("float32", "auto", True), ("bfloat16", "fp8", True)]
    assert (best["best"]["dtype"], best["best"]["kv"], best["best"]["output_tps"]) == ("bfloat16", "fp8", 120.0)
    jobs = [json.loads(s) for s in (out / "jobs.jsonl").read_text().splitlines()]
    assert jobs[0]["header"]["requests"] == 3 and [j["max_tokens"] for j in jobs[1:]] == [256] * 3
    assert all(j["prompt_tokens"] == len(j["prompt_token_ids"]) > 200 and j["answer"] in j["prompt"] for j in jobs[1:])
    assert best["host"]["cpu"] and "native_bf16" in best["host"] and best["host_line"]
    assert "bfloat16 fp8: 120.00 out tok/s  <- best" in capsys.readouterr().out
    peers.main(["table", "--vllm", str(out / "best_vllm.json")])
    text = capsys.readouterr().out
    assert text.startswith(f"Host: {best['host_line']}")
    assert "| vLLM 0.32.0 bf16 **(best)** | fp8 | 4 | 240.0 | 1.00× | 120.00 | 1.00× |" in text
    assert "| vLLM 0.32.0 fp32 | fp32 | 4 | 90.0 | 0.38× | 45.00 | 0.38× |" in text
    assert text.rstrip().endswith("× against vLLM best")


def test_best_fails_plainly_when_nothing_starts(tmp_path, monkeypatch):
    peers_dir = tmp_path / "peers"
    (peers_dir / "vllm").mkdir(parents=True)
    (peers_dir / "vllm" / "run_vllm_peer.py").write_text("import sys; sys.exit(3)")
    monkeypatch.setitem(peers.SCRIPTS, "vllm", ("vllm/run_vllm_peer.py", peers.Path(peers.sys.executable)))
    with pytest.raises(SystemExit) as done:
        peers.main(["best", "vllm", "--peers-dir", str(peers_dir), "--out", str(tmp_path / "r"), "--requests", "2",
                    "--lengths", "300"])
    assert done.value.code == 1
    best = json.loads((tmp_path / "r" / "best_vllm.json").read_text())
    assert best["best"] is None and len(best["candidates"]) == 4 and not any(c["started"] for c in best["candidates"])
