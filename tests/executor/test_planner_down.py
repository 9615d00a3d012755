"""With the planner down, a job naming a strategy the planner never had is refused (before: it ran
as `full`); the executor checks names against the last list the planner gave."""
import dataclasses

import pytest

from executor import validation
from executor.planner_client import PlannerClient
from kvcore import serving
from kvcore.config import PlannerConfig, from_env
from kvcore.request import InvalidRequest
from planner.service import build_service


async def test_strategy_names_are_checked_against_the_last_list_while_the_planner_is_down():
    cfg = dataclasses.replace(from_env(PlannerConfig, {}), port=0, warm_probe=False)
    svc = build_service(cfg)
    server, port = await serving.start(svc, cfg, with_metrics=False)
    client = PlannerClient(f"127.0.0.1:{port}", deadline_s=1.0)
    try:
        assert await client.strategies() is not None
        await serving.shutdown(server, svc, 0.1)                 # the planner goes away
        known = await client.strategies()
        assert "snapkv" in known
        validation.check_strategy("snapkv", known)              # a name it had: queued (planned degraded)
        with pytest.raises(InvalidRequest, match="^strategy: unknown strategy 'no-such'"):
            validation.check_strategy("no-such", known)
        fresh = PlannerClient(f"127.0.0.1:{port}", 1.0)
        assert await fresh.strategies() is None                 # never heard from it: the planner decides later
        await fresh.close()
    finally:
        await client.close()
