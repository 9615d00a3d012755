"""The README is a front page and the docs stay true: README ≤ 10 KB with what kvplan is and the
two commands on its first screen; no link leaves the repository; every repository path the
README and docs/ name exists, and every file and module the code's docstrings and comments cite
(and docker-compose.yml's, the Makefile's, the Dockerfile's); every `KVPLAN_*` setting is in
docs/configuration.md; every benchmark results folder says what its runs were (NOTES.md)."""
from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

from kvcore import config as kc

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("docs", "deploy", "bench", "kvplan", "planner", "executor", "cachestore", "kernels", "protos", "kvcore", "tests")
PATH = re.compile(r"`((?:%s)/[^`\s:]*)`" % "|".join(TOP))
URL = re.compile(r"\bhttps?://([^/\s`'\")]+)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
MADE_BY_USERS = ("deploy/keys",)     # the docs tell an operator to make these (API key files)


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


SOURCES = [p for top in ("kvplan", "planner", "executor", "kvcore", "cachestore", "kernels", "bench", "protos", "tests")
           for p in sorted((ROOT / top).rglob("*.py")) if "results" not in p.parts]
CITED_PATH = re.compile(r"(?<![\w/.-])((?:%s)/[\w./-]*\w)" % "|".join(TOP))
CITED_MODULE = re.compile(r"`((?:kvplan|planner|executor|kvcore|cachestore|kernels|bench)(?:\.\w+)+)")
MADE_UP = {"tests/test_imports.py"}          # its checker's own made-up tree


def _defines(module: Path, name: str) -> bool:
    """Whether `module` (a file) defines, assigns, imports or lazily exports `name`."""
    text = module.read_text()
    return re.search(rf"^\s*(?:async def|def|class)\s+{name}\b|^\s*{name}\s*[:=]|^\s*self\.{name}\b|"
                     rf"import[^\n]*\b{name}\b|[\"']{name}[\"']", text, re.M) is not None


def _resolves(dotted: str) -> bool:
    """`pkg.module[.name]`: the module is a file of the repository and defines the name."""
    parts = dotted.split(".")
    if parts[:2] == ["kvplan", "v1"]:                 # the protos' package
        return True
    for i in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:i])
        module = base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
        if module.exists():
            return i == len(parts) or _defines(module, parts[i])
    return False


@pytest.mark.parametrize("source", [*SOURCES, ROOT / "docker-compose.yml", ROOT / "Makefile", ROOT / "Dockerfile"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_and_module_the_code_cites_exists(source):
    """Before: docker-compose.yml named a test file long renamed (test_compose, now test_docker_compose)."""
    text = source.read_text()
    rel = str(source.relative_to(ROOT))
    paths = [] if rel in MADE_UP else [p.rstrip(".") for p in CITED_PATH.findall(text)]
    missing = [p for p in paths if not glob.glob(str(ROOT / p)) and not glob.glob(str(ROOT / p) + ".py")
               and not p.startswith(MADE_BY_USERS)]
    missing += [m for m in CITED_MODULE.findall(text) if not _resolves(m)]
    assert not missing, f"{rel} cites what does not exist: {missing}"
