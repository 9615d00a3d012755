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
