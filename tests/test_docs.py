"""The README is a front page and the docs stay true: README ≤ 10 KB with what kvplan is and the
two commands on its first screen; no link leaves the repository; every repository path the
README and docs/ name exists; every `KVPLAN_*` setting is in docs/configuration.md; every
benchmark results folder says what its runs were (NOTES.md)."""
from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

from kvplan import config as kc

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("docs", "deploy", "bench", "kvplan", "planner", "executor", "cachestore", "kernels", "protos", "kvcore", "tests")
PATH = re.compile(r"`((?:%s)/[^`\s:]*)`" % "|".join(TOP))
URL = re.compile(r"\bhttps?://([^/\s`'\")]+)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
MADE_BY_USERS = ("deploy/keys/",)     # the docs tell an operator to make these (API key files)


def test_the_readme_is_a_front_page():
    text = README.read_text()
    assert len(text.encode()) <= 10 * 1024, f"README.md is {len(text.encode())} bytes"
    first_screen = "\n".join(text.splitlines()[:45])
    assert "make run" in first_screen and "make test" in first_screen
    assert "KV cache" in first_screen.split("\n\n")[1]            # what it is, in its first paragraph


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_no_link_leaves_the_repository(page):
    text = page.read_text()
    hosts = {h.split(":")[0] for h in URL.findall(text)}
    assert hosts <= {"127.0.0.1", "localhost"}, f"{page.name} links outside the repository: {hosts}"
    for target in LINK.findall(text):
        resolved = (page.parent / target.split("#")[0]).resolve()
        assert resolved.is_relative_to(ROOT) and resolved.exists(), f"{page.name}: link {target}"


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_path_named_exists(page):
    missing = []
    for path in PATH.findall(page.read_text()):
        path = path.rstrip(".,;")
        if not glob.glob(str(ROOT / path)) and not path.startswith(MADE_BY_USERS):
            missing.append(path)
    assert not missing, f"{page.name} names paths that do not exist: {missing}"


def test_every_setting_is_documented():
    text = (ROOT / "docs" / "configuration.md").read_text()
    names = {n for cls in kc.ALL_CONFIGS for n in kc.env_names(cls)}
    assert sorted(n for n in names if f"`{n}`" not in text) == []


def test_every_results_folder_says_what_its_runs_were():
    folders = [d for d in (ROOT / "bench" / "results").iterdir() if d.is_dir()]
    assert folders and [d.name for d in folders if not (d / "NOTES.md").exists()] == []
    assert (ROOT / "bench" / "results" / "NOTES.md").exists()
