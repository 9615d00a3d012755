"""The CLI without any service up: `strategies` lists the shipped registry, `strategies set`
says there is nothing to switch (exit 1), bad input exits 2."""
from kvplan import cli
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
