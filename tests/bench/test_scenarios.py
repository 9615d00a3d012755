"""The burst scenario's `as_full`: a job is compared with full's job at the same place of the same
phase, so a case that comes more than once in a run is never compared with another phase's text."""
from bench.scenarios import as_full


def _run(kind: str, texts: dict[str, list[str]]) -> dict:
    return dict(kind=kind, phases={p: dict(jobs=[dict(id="niah-0", text=t) for t in ts]) for p, ts in texts.items()})


def test_jobs_are_compared_with_fulls_at_the_same_place_of_the_same_phase():
    full = _run("full", {"quiet": ["a"], "burst": ["b", "c"]})
    other = _run("adaptive", {"quiet": ["a"], "burst": ["c", "c"]})     # one id throughout, as a reused case
    as_full([full, other])
    assert [ph["as_full"] for ph in full["phases"].values()] == [1, 2]
    assert [ph["as_full"] for ph in other["phases"].values()] == [1, 1]
