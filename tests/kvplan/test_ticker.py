"""The status line of a slow start (issue 34: `kvplan up` 42 s, `kvplan plan --plot` 84 s and
`kvplan.pipeline()` 48 s said nothing): on a terminal one line redrawn with what it does, for how
long and the latest log message, cleared at the end, output printed above it; elsewhere a line
per step (or nothing); `kvplan up` says which service it waits for and the last line of its log."""
from __future__ import annotations

import io
import logging
import subprocess
import sys
import time
from collections import Counter

from cachestore.process import free_port
from kvplan import cluster
from kvplan import members as processes
from kvplan.ticker import Ticker


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_one_line_is_redrawn_and_cleared():
    term, out = Terminal(), io.StringIO()
    with Ticker("starting the executor", stream=term, interval_s=0.02) as t:
        t.say("loading the model", "SmolLM2-135M-Instruct-fp16")
        time.sleep(0.1)
        t.echo("planner    SERVING", stream=out)
        time.sleep(0.05)
    drawn = term.getvalue()
    assert "\r\x1b[Kkvplan: loading the model (0s) SmolLM2-135M-Instruct-fp16" in drawn
    assert drawn.endswith("\r\x1b[K")                         # cleared: nothing left on the line
    assert out.getvalue() == "planner    SERVING\n"


def test_elsewhere_a_line_per_step_or_nothing():
    log = io.StringIO()
    with Ticker("starting the cluster", stream=log) as t:
        t.say("waiting for the executor to serve")
        t.note("loading the model")                           # a detail: not a line of its own
        t.say("waiting for the executor to serve")
    assert log.getvalue() == "kvplan: starting the cluster ...\nkvplan: waiting for the executor to serve ...\n"
    quiet = io.StringIO()
    with Ticker("planning", stream=quiet, lines=False) as t:
        t.say("probing")
    assert quiet.getvalue() == ""


def test_the_latest_log_message_is_the_detail_and_the_level_comes_back():
    logger = logging.getLogger("kvplan")
    before = logger.level
    with Ticker("starting", stream=io.StringIO(), lines=False, follow_logs=True) as t:
        logging.getLogger("kvplan.model").info("loading %s", "SmolLM2")
        assert t.detail == "loading SmolLM2"
    assert logger.level == before and not any(type(h).__name__ == "_Latest" for h in logger.handlers)


def test_up_says_which_service_it_waits_for_and_what_its_log_says(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("KVPLAN_STATE_DIR", str(tmp_path))
    for name in ("PLANNER", "CACHESTORE", "EXECUTOR", "HTTP"):
        monkeypatch.setenv(f"KVPLAN_{name}_PORT", str(free_port()))
    for name in ("KVPLAN_API_KEY", "KVPLAN_AUTH_KEYS_FILE", "KVPLAN_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cluster.shutil, "which", lambda name: None)           # no redis-server: no Redis here
    procs = []

    def spawn(name, argv, env, d):
        (d / f"{name}.log").write_text(f"2026-11-27 01:02:03,456 INFO kvplan.{name}: loading the {name}\n")
        procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        return procs[-1]
    asked = Counter()

    def health(m):
        asked[m.name] += 1
        return "SERVING" if asked[m.name] > 1 else "NOT_SERVING"
    monkeypatch.setattr(processes, "spawn", spawn)
    monkeypatch.setattr(processes, "member_health", health)
    from kvcore.config import ClusterConfig, ModelConfig, from_env
    try:
        members = cluster.up(from_env(ClusterConfig), from_env(ModelConfig))
        out, err = capsys.readouterr()
        assert [m.name for m in members] == ["planner", "cachestore", "executor", "http"]
        for name in ("planner", "cachestore", "executor", "http"):
            assert f"kvplan: waiting for the {name} to serve ..." in err
            assert f"kvplan: {name:<10} SERVING" in out
        assert processes.last_line(tmp_path / "executor.log") == "INFO kvplan.executor: loading the executor"
    finally:
        for p in procs:
            p.kill()
            p.wait()
