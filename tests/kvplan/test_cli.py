"""The CLI without a cluster: `strategies` lists the shipped registry, `strategies set` says there
is nothing to switch (exit 1), `strategies define` against an in-process planner, `plan` in
process (table, proto JSON, plot, probing a prompt file), bad input exits 2."""
import asyncio
import dataclasses
import json
import sys
import threading

import pytest

from kvplan import cli
from planner.request import ModelShape, PlanInput
from planner.strategies import STRATEGIES


def _no_cluster(monkeypatch, tmp_path):
    monkeypatch.setenv("KVPLAN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KVPLAN_PLANNER_ADDR", raising=False)
    monkeypatch.delenv("KVPLAN_DEFAULT_STRATEGY", raising=False)


def test_strategies_without_a_planner_lists_the_registry(monkeypatch, tmp_path, capsys):
    _no_cluster(monkeypatch, tmp_path)
    assert cli.main(["strategies"]) == 0
    out, err = capsys.readouterr()
    assert "no planner is up" in err
    lines = out.splitlines()
    assert {line.lstrip("* ").split()[0] for line in lines} == set(STRATEGIES)
    assert [line for line in lines if line.startswith("*")] == [line for line in lines if line[2:].startswith("full ")]


def test_strategies_set_without_a_planner_fails_clearly(monkeypatch, tmp_path, capsys):
    _no_cluster(monkeypatch, tmp_path)
    assert cli.main(["strategies", "set", "snapkv"]) == 1
    assert "nothing to switch" in capsys.readouterr().err


def test_generate_without_a_prompt_exits_2(monkeypatch, tmp_path, capsys):
    _no_cluster(monkeypatch, tmp_path)
    assert cli.main(["generate"]) == 2
    assert "give a PROMPT" in capsys.readouterr().err


# ---- `kvplan strategies define` ------------------------------------------------------------

MINE = "name: mine\ndescription: snapkv, pool 5\neviction: {scorer: snapkv, pool_kernel: 5}\n"


@pytest.fixture
def planner_up(monkeypatch, tmp_path):
    """A planner in a background event loop; KVPLAN_PLANNER_ADDR points at it."""
    from kvcore import serving
    from kvcore.config import PlannerConfig, from_env
    from planner.service import build_service

    _no_cluster(monkeypatch, tmp_path)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    cfg = dataclasses.replace(from_env(PlannerConfig, {}), port=0, redis_url="", warm_probe=False)
    svc = build_service(cfg)
    server, port = asyncio.run_coroutine_threadsafe(serving.start(svc, cfg, with_metrics=False), loop).result(10)
    monkeypatch.setenv("KVPLAN_PLANNER_ADDR", f"127.0.0.1:{port}")
    yield
    asyncio.run_coroutine_threadsafe(serving.shutdown(server, svc, 0.5), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_strategies_define_registers_and_activates_only_when_asked(planner_up, tmp_path, capsys):
    f = tmp_path / "mine.yaml"
    f.write_text(MINE)
    assert cli.main(["strategies", "define", str(f)]) == 0
    assert "defined: mine (v1); jobs use it with --strategy mine" in capsys.readouterr().out
    assert cli.main(["strategies"]) == 0
    assert [line.split()[1] for line in capsys.readouterr().out.splitlines() if line.startswith("*")] == ["full"]
    assert cli.main(["strategies", "define", str(f), "--activate"]) == 0
    assert "defined and active: mine (v1)" in capsys.readouterr().out
    assert cli.main(["strategies"]) == 0
    active = [line for line in capsys.readouterr().out.splitlines() if line.startswith("*")]
    assert len(active) == 1 and active[0].split()[1:3] == ["mine", "v1"]


@pytest.mark.parametrize("text, words", [
    (MINE.replace("scorer: snapkv", "scorer: foo"), "definition.eviction.scorer: 'foo' is not one of"),
    ("name: x\noffload: {low_bits: 3}\n", "definition.offload.low_bits: 3 is not one of [1, 2, 4]"),
    ("{name: x", "definition: not valid JSON or YAML"),
])
def test_strategies_define_a_bad_file_exits_2_naming_the_field(planner_up, tmp_path, capsys, text, words):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    assert cli.main(["strategies", "define", str(f)]) == 2
    assert words in capsys.readouterr().err
    assert cli.main(["strategies", "define", str(tmp_path / "missing.yaml")]) == 2
    assert "No such file" in capsys.readouterr().err


def test_strategies_define_without_a_planner_fails_clearly(monkeypatch, tmp_path, capsys):
    _no_cluster(monkeypatch, tmp_path)
    f = tmp_path / "mine.yaml"
    f.write_text(MINE)
    assert cli.main(["strategies", "define", str(f)]) == 1
    assert "nothing to define" in capsys.readouterr().err


# ---- `kvplan plan` -------------------------------------------------------------------------

@pytest.fixture
def real_shape(monkeypatch, real_model_dir):
    monkeypatch.setenv("KVPLAN_MODEL", str(real_model_dir))


def _local(name, ratio, prompt):
    inp = PlanInput(job_id="j", strategy=name, prompt_tokens=prompt, reserve_ratio=ratio,
                    model=ModelShape(num_layers=30, num_kv_heads=3, num_query_heads=9, head_dim=64))
    return STRATEGIES[name].plan(inp, "p")


def test_plan_prints_the_per_layer_table(real_shape, capsys):
    assert cli.main(["plan", "--strategy", "spindlekv", "--ratio", "0.2", "--new-tokens", "0"]) == 0
    head, columns, *rows, note = capsys.readouterr().out.splitlines()
    want = _local("spindlekv", 0.2, 2048)      # a hair under 0.2: each stream's last page has spare rows
    assert head.startswith(f"spindlekv v2: 2048 prompt tokens, predicted reserve ratio {want.predicted_reserve_ratio:.3f}")
    assert 0.19 <= want.predicted_reserve_ratio <= 0.2
    assert columns.split()[:5] == ["layer", "kind", "kept", "keep_tokens", "window"]
    assert [r.split()[:4] for r in rows] == [[str(lp.layer), lp.kind, str(32 + lp.eviction.keep_tokens),
                                              str(lp.eviction.keep_tokens)] for lp in want.layers]
    assert all("0.98/0.95" in r for r in rows) and note.startswith("kept: prompt tokens kept per KV head")


def test_plan_json_is_the_protos_json_form(real_shape, capsys):
    assert cli.main(["plan", "--strategy", "pyramidkv", "--kv-tokens", "1000", "--tokens", "4096", "--json",
                     "--new-tokens", "0"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = _local("pyramidkv", 1000 / 4096, 4096)
    assert (got["strategy"], got["strategy_version"]) == ("pyramidkv", "1")
    assert [int(lp["eviction"]["keep_tokens"]) for lp in got["layers"]] == [lp.eviction.keep_tokens for lp in want.layers]
    assert got["layers"][3]["eviction"]["pool_kernel"] == 7


def test_plan_new_tokens_keeps_what_the_answer_leaves_of_the_budget(real_shape, capsys):
    args = ["plan", "--strategy", "snapkv", "--ratio", "0.5", "--tokens", "1000", "--json"]
    assert cli.main(args + ["--new-tokens", "0"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert cli.main(args + ["--new-tokens", "32"]) == 0
    told = json.loads(capsys.readouterr().out)
    keep = lambda p: [int(lp["eviction"]["keep_tokens"]) for lp in p["layers"]]
    # 500 per head alone, less the 15 rows a pooled stream may hold past its last (whole blocks of 16);
    # with 32 new tokens the worst step is the last: 0.5 · (1000 + 32) - 32 - 15 = 469
    assert set(keep(alone)) == {485 - 32} and set(keep(told)) == {469 - 32}      # the window of 32 apart
    assert cli.main(args + ["--new-tokens", "-1"]) == 2
    assert "--new-tokens: must be >= 0" in capsys.readouterr().err


def test_plan_minicache_shows_the_merged_pairs(real_shape, tmp_path, capsys):
    f = tmp_path / "m.yaml"                      # ungated: the shipped preset probes to choose its pairs
    f.write_text("name: m\nmerge: {min_cos: null}\n")
    assert cli.main(["plan", "--strategy", str(f), "--ratio", "0.5"]) == 0
    rows = capsys.readouterr().out.splitlines()[2:-1]
    assert [r.split()[1] for r in rows] == ["full"] * 16 + ["merge", "full"] * 7
    assert "with 15, t 0.6" in rows[16]


def test_plan_a_definition_file(real_shape, tmp_path, capsys):
    f = tmp_path / "q.yaml"
    f.write_text("name: q\neviction: {scorer: h2o}\nquant: {bits: 2}\n")
    assert cli.main(["plan", "--strategy", str(f), "--ratio", "0.5", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["strategy"] == "q" and got["layers"][0]["quant"]["bits"] == 2
    f.write_text("name: q\neviction: {scorer: h2o, window: -1}\n")
    assert cli.main(["plan", "--strategy", str(f), "--ratio", "0.5"]) == 2
    assert "definition.eviction.window: -1 is less than the minimum of 0" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--strategy", "nope", "--ratio", "0.5"], "unknown strategy 'nope'"),
    (["--strategy", "snapkv", "--ratio", "1.5"], "--ratio: must be in (0, 1], got 1.5"),
    (["--strategy", "snapkv", "--ratio", "0"], "--ratio: must be in (0, 1], got 0"),
    (["--strategy", "snapkv", "--kv-tokens", "0"], "--kv-tokens: must be >= 1"),
    (["--strategy", "xkv", "--ratio", "0.5"], "strategy xkv probes the prompt: give --prompt-file"),
])
def test_plan_bad_input_exits_2(real_shape, capsys, argv, words):
    assert cli.main(["plan", *argv]) == 2
    assert words in capsys.readouterr().err


def test_plan_probes_a_prompt_file_in_process(monkeypatch, tiny_model_dir, tmp_path, capsys):
    monkeypatch.setenv("KVPLAN_MODEL", str(tiny_model_dir))
    f = tmp_path / "prompt.txt"
    f.write_text(" ".join(f"word{i}" for i in range(300)))
    assert cli.main(["plan", "--strategy", "xkv", "--ratio", "0.3", "--prompt-file", str(f), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert len(got["layers"]) == 2 and 0.0 < got["predicted_retained_attention"] < 1.0
    assert all(lp["eviction"]["gqa_mode"] == "mean" for lp in got["layers"])


def test_plan_plot_draws_a_png(real_shape, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plan.png"
    assert cli.main(["plan", "--strategy", "spindlekv", "--ratio", "0.3", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"kvplan: wrote {out} (" in capsys.readouterr().err


def test_plan_warns_when_a_job_asking_its_budget_would_be_refused(real_shape, capsys):
    assert cli.main(["plan", "--strategy", "snapkv", "--ratio", "0.5", "--tokens", "300", "--new-tokens", "256"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0].startswith("snapkv v1: 300 prompt tokens")          # the plan is still shown
    assert ("kvplan: warning: a job asking this would be refused: budget.reserve_ratio: snapkv cannot hold reserve "
            "ratio 0.5 on this job (300 prompt tokens, 256 new tokens)") in err
    assert "reserve ratio 0.55 fits, or at most 206 new tokens fit reserve ratio 0.5" in err


def test_plan_plot_without_matplotlib_exits_2(real_shape, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)          # import matplotlib -> ImportError
    assert cli.main(["plan", "--strategy", "snapkv", "--ratio", "0.3", "--plot", str(tmp_path / "p.png")]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


def test_plan_predict_probes_any_strategy(monkeypatch, tiny_model_dir, tmp_path, capsys):
    monkeypatch.setenv("KVPLAN_MODEL", str(tiny_model_dir))
    f = tmp_path / "prompt.txt"
    f.write_text(" ".join(f"word{i}" for i in range(300)))
    assert cli.main(["plan", "--strategy", "snapkv", "--ratio", "0.3", "--prompt-file", str(f)]) == 0
    assert "retained attention" not in capsys.readouterr().out.splitlines()[0]     # not probed: not predicted
    assert cli.main(["plan", "--strategy", "snapkv", "--ratio", "0.3", "--prompt-file", str(f), "--predict"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    retained = float(head.split("retained attention ")[1].split(",")[0])
    copy = float(head.split("copy-aware ")[1])
    assert 0.0 < copy < 1.0 and 0.0 < retained < 1.0
    assert cli.main(["plan", "--strategy", "snapkv", "--ratio", "0.3", "--predict"]) == 2
    assert "--predict: probes the prompt: give --prompt-file" in capsys.readouterr().err


# ---- `kvplan plan` and `kvplan generate` agree (issue 41) ----------------------------------

SHORT = " ".join(__import__("kvplan.demo", fromlist=["DEMO_CONTEXT"]).DEMO_CONTEXT.split(" ")[:240])


@pytest.mark.parametrize("flags, refused", [
    (["--strategy", "auto", "--ratio", "0.3"], True),        # plan said 0.300 fits: its --new-tokens defaulted to 0
    (["--strategy", "auto", "--ratio", "0.2", "--question", "Who is the conductor?"], True),
    (["--strategy", "minicache", "--ratio", "0.5", "--max-new-tokens", "8"], True),
    (["--strategy", "auto", "--ratio", "0.5", "--max-new-tokens", "8"], False),
])
def test_plan_and_generate_refuse_and_hold_the_same_flags(embedded, real_shape, monkeypatch, tmp_path, capsys,
                                                          flags, refused):
    """Before: `kvplan plan --ratio 0.2` predicted 0.200 with no warning where `generate` with the
    same flags was refused (plan's --new-tokens defaulted to 0, generate's to 128), and generate's
    refusal came after its prefill."""
    monkeypatch.setenv("KVPLAN_EXECUTOR_ADDR", embedded.executor_addr)
    f = tmp_path / "doc.txt"
    f.write_text(SHORT)
    assert cli.main(["plan", "--prompt-file", str(f), *flags]) == 0
    planned = capsys.readouterr().err
    code = cli.main(["generate", "--prompt-file", str(f), "--no-progress", *flags])
    generated = capsys.readouterr().err
    assert code == (2 if refused else 0), generated
    warned = "kvplan: warning: a job asking this would be refused: budget.reserve_ratio: "
    assert (warned in planned) == refused, planned
    if refused:                       # the same why (what fits: generate's is found before the prefill)
        why = planned.split(warned)[1].split("; ")[0]
        assert f"kvplan: error: --ratio: {why}" in generated


def test_plan_defaults_to_the_new_tokens_generate_asks(real_shape, capsys):
    assert cli.main(["plan", "--strategy", "snapkv", "--ratio", "0.3", "--tokens", "300", "--new-tokens", "0"]) == 0
    assert capsys.readouterr().err == ""                                   # the prompt's cache alone fits
    assert cli.main(["plan", "--strategy", "snapkv", "--ratio", "0.3", "--tokens", "300"]) == 0
    assert "on this job (300 prompt tokens, 128 new tokens)" in capsys.readouterr().err
    assert cli.main(["plan", "--strategy", "snapkv", "--ratio", "0.5", "--tokens", "300", "--question", "Who?"]) == 2
    assert "--question: follows the prompt: give --prompt-file" in capsys.readouterr().err


def test_strategies_marks_what_the_model_cannot_compress(monkeypatch, tmp_path, real_shape, capsys):
    """Before: minicache was listed without a caveat and refused at every ratio below 1 on SmolLM2."""
    monkeypatch.delenv("KVPLAN_PLANNER_ADDR", raising=False)
    monkeypatch.setenv("KVPLAN_STATE_DIR", str(tmp_path))
    assert cli.main(["strategies"]) == 0
    marked = [line.split()[0] for line in capsys.readouterr().out.splitlines() if "[cannot compress this model" in line]
    assert marked == ["minicache"]
