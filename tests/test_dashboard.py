"""deploy/grafana/kvplan.json and deploy/prometheus.yml, checked statically (no Grafana or
Prometheus here): the dashboard is valid JSON of Grafana's dashboard shape, every panel queries
the templated Prometheus datasource, and every metric it reads is one the services export;
the scrape targets are the compose services' metrics ports. Each checker also rejects the
mistake it is for."""
from __future__ import annotations

import copy
import importlib
import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client import REGISTRY

from tests.test_docker_compose import configured, load_compose

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvplan.json"
SCRAPE = ROOT / "deploy" / "prometheus.yml"
METRIC = re.compile(r"\bkvplan_[a-z0-9_]+")
# the modules that define every service's metrics
MODULES = ("kvcore.serving", "kvplan.gateway", "planner.service", "cachestore.service", "executor.metrics")
# The executor engine's metrics (issue 21), checked against the registry as soon as
# executor.metrics exists; until then these names are what the engine promises.
ENGINE = {"kvplan_executor_running_sequences", "kvplan_executor_waiting_sequences", "kvplan_executor_queue_depth",
          "kvplan_executor_kv_bytes", "kvplan_executor_kv_reserved_bytes", "kvplan_executor_kv_budget_bytes",
          "kvplan_executor_ttft_seconds_bucket", "kvplan_executor_tpot_seconds_bucket",
          "kvplan_executor_itl_seconds_bucket", "kvplan_executor_jobs_total", "kvplan_jobs_degraded_total",
          "kvplan_executor_generated_tokens_total"}


def exported() -> set[str]:
    """Every sample name the services' metrics produce (counters' _total, histograms' _bucket ...)."""
    missing_engine = False
    for name in MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != "executor.metrics":
                raise
            missing_engine = True
    names = set()
    for family in REGISTRY.collect():
        names.add(family.name)
        names.update(s.name for s in family.samples)
        if family.type == "counter":
            names.add(family.name + "_total")
        if family.type == "histogram":
            names.update(family.name + x for x in ("_bucket", "_sum", "_count"))
    return names | (ENGINE if missing_engine else set())


def check_dashboard(d: dict, known: set[str]) -> list[str]:
    problems = []
    for key in ("title", "uid", "panels", "templating", "schemaVersion"):
        if key not in d:
            problems.append(f"no {key}")
    ds = {v["name"] for v in d.get("templating", {}).get("list", []) if v.get("type") == "datasource"}
    ids = [p.get("id") for p in d.get("panels", [])]
    if len(ids) != len(set(ids)):
        problems.append(f"panel ids repeat: {ids}")
    for p in d.get("panels", []):
        where = f"panel {p.get('id')} {p.get('title')!r}"
        g = p.get("gridPos", {})
        if not all(isinstance(g.get(k), int) for k in "hwxy") or g["x"] + g["w"] > 24:
            problems.append(f"{where}: gridPos {g} is not within Grafana's 24 columns")
        if p.get("type") == "row":
            continue
        if not p.get("targets"):
            problems.append(f"{where}: no targets")
        uid = p.get("datasource", {}).get("uid", "")
        if uid.removeprefix("${").removesuffix("}") not in ds:
            problems.append(f"{where}: datasource {uid!r} is not a templated datasource ({sorted(ds)})")
        for t in p.get("targets", []):
            expr = t.get("expr", "")
            if not expr or not t.get("refId"):
                problems.append(f"{where}: a target without expr or refId")
            if expr.count("(") != expr.count(")"):
                problems.append(f"{where}: unbalanced parentheses in {expr!r}")
            for m in METRIC.findall(expr):
                if m not in known:
                    problems.append(f"{where}: {m} is not a metric the services export")
    return problems


def check_scrape(cfg: dict, compose: dict) -> list[str]:
    services = compose["services"]
    want = {f"{name}:{configured(name, services[name], 'metrics_port')}" for name in ("planner", "executor", "cachestore")}
    want.add(f"http:{configured('http', services['http'], 'port')}")
    got = {t for job in cfg.get("scrape_configs", []) for sc in job.get("static_configs", []) for t in sc["targets"]}
    return [f"scrape targets {sorted(got)}, expected {sorted(want)}"] if got != want else []


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_the_dashboard_reads_only_exported_metrics(dashboard):
    assert check_dashboard(dashboard, exported()) == []


def test_the_dashboard_shows_what_an_operator_needs(dashboard):
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
    for name in ("kvplan_executor_running_sequences", "kvplan_executor_waiting_sequences",
                 "kvplan_executor_queue_depth", "kvplan_executor_kv_bytes", "kvplan_executor_kv_budget_bytes", "kvplan_executor_ttft_seconds_bucket",
                 "kvplan_executor_tpot_seconds_bucket", "kvplan_jobs_degraded_total", "kvplan_rpc_seconds_bucket"):
        assert name in exprs, name
    assert "sum by (strategy)" in exprs and 'degraded="true"' in exprs


def test_the_scrape_targets_are_the_compose_services():
    assert check_scrape(yaml.safe_load(SCRAPE.read_text()), load_compose()) == []


@pytest.mark.parametrize("mutate, words", [
    (lambda d: d["panels"][1]["targets"][0].__setitem__("expr", "sum(kvplan_executor_runing_sequences)"),
     "kvplan_executor_runing_sequences is not a metric"),
    (lambda d: d["panels"][1].__setitem__("datasource", {"type": "prometheus", "uid": "mine"}), "not a templated"),
    (lambda d: d["panels"][1]["gridPos"].__setitem__("x", 20), "24 columns"),
    (lambda d: d["panels"][2].__setitem__("id", d["panels"][1]["id"]), "panel ids repeat"),
    (lambda d: d["panels"][1]["targets"][0].__setitem__("expr", "sum(rate(kvplan_rpcs_total[5m])"), "unbalanced"),
])
def test_the_dashboard_checker_rejects(dashboard, mutate, words):
    bad = copy.deepcopy(dashboard)
    mutate(bad)
    assert any(words in p for p in check_dashboard(bad, exported()))


def test_the_scrape_checker_rejects_a_wrong_port():
    cfg = yaml.safe_load(SCRAPE.read_text())
    cfg["scrape_configs"][0]["static_configs"][0]["targets"] = ["planner:9999"]
    assert check_scrape(cfg, load_compose())
