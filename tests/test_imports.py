"""The import graph of kvplan's own packages, module-level and function-level imports alike
(read with `ast`, nothing imported): no cycle; neither of `planner` and `executor` imports the
other — what both need lives in `kvcore`; and every arrow runs down: nothing under the ground
floor (`kvcore`, `planner`, `executor`, `cachestore`, `kernels`, and `kvplan`'s serving plumbing
— config, model, auth, keys, channels, plan, serving) imports the front door (`FRONT`: the SDK
facade `kvplan/__init__.py` and what it, the CLI and the HTTP API are made of, which import the
services).

An edge goes to the module an import names: `from a.b import c` is a.b.c when that is a module,
and a.b too, whose `__init__` runs first — a module of its own, reached whenever an import names
the package or imports from it (except a top-level package from inside itself: it is always
initialized before any of its modules). The checker is tested on a made-up tree too, so a rule that could never fail is caught."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("planner", "executor", "cachestore", "kernels", "kvplan", "kvcore")
APART = ("planner", "executor")          # neither imports the other
# The front door: `import kvplan` (the SDK facade), the SDK, the CLI, `kvplan up`, the embedded
# default and the HTTP API. They import the services; a service (or what it imports) never imports them.
FRONT = ("kvplan", *(f"kvplan.{m}" for m in (
    "sdk", "inprocess", "embedded", "client", "attempts", "ticker", "progress", "cli", "jobrun", "demo", "planview",
    "cluster", "members", "keyscmd", "gateway", "http_errors", "http_guard", "http_jobs", "http_keys",
    "http_protocol",
    "openai_api", "openai_errors", "openai_fields", "openai_shapes",
    "executor_pool")))


def modules(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of `packages` under `root`."""
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _known(name: str, mods: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is one of `mods` (None: outside them)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Every module of `mods` that `name` imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {_known(a.name, mods) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:                                   # relative: from the package up
                up = package
                for _ in range(node.level - 1):
                    up = up.rpartition(".")[0]
                base = f"{up}.{base}" if base else up
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in mods else _known(base, mods) for a in node.names}
            if not (base in PACKAGES and name.startswith(base + ".")):
                out.add(_known(base, mods))                  # the package's __init__ runs first
    return out - {None, name}


def graph(root: Path, packages=PACKAGES) -> dict[str, set[str]]:
    mods = modules(root, packages)
    return {name: imports(name, path, mods) for name, path in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), sorted."""
    index, low, on, stack, found, counter = {}, {}, set(), [], [], 0
    for root in g:
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root), on.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w), on.add(w)
                    work.append((w, iter(sorted(g.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return sorted(found)


def crossings(g: dict[str, set[str]], apart=APART) -> list[str]:
    """'a -> b' for every import from one of `apart`'s packages into another of them."""
    top = lambda m: m.split(".")[0]                                           # noqa: E731
    return sorted(f"{m} -> {t}" for m, ts in g.items() for t in ts
                  if top(m) in apart and top(t) in apart and top(m) != top(t))


def upward(g: dict[str, set[str]], front=FRONT) -> list[str]:
    """'a -> b' for every import of a front module `b` by a module `a` of the ground floor."""
    return sorted(f"{m} -> {t}" for m, ts in g.items() for t in ts if m not in front and t in front)


def test_no_import_cycles():
    assert cycles(graph(ROOT)) == []


def test_planner_and_executor_never_import_each_other():
    assert crossings(graph(ROOT)) == []


def test_nothing_under_the_ground_floor_imports_the_front():
    """Before issue 34 `planner.service` and `cachestore.service` ran `from kvplan import auth`:
    the facade, whose `kvplan.pipeline` starts the services."""
    g = graph(ROOT)
    assert set(FRONT) <= set(g), f"FRONT names modules that do not exist: {sorted(set(FRONT) - set(g))}"
    assert upward(g) == []


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_checker_finds_function_level_cycles_and_crossings(tmp_path):
    root = _tree(tmp_path, {
        "planner/__init__.py": "",
        "planner/a.py": "def f():\n    from planner.b import g\n    return g\n",      # function level
        "planner/b.py": "from planner import a\nimport kvcore.cost\n",
        "planner/c.py": "from . import b\n",                                           # relative
        "executor/__init__.py": "",
        "executor/x.py": "from kvcore.cost import rows\n",
        "executor/y.py": "def h():\n    from planner.c import b\n",                     # crossing, function level
        "executor/sub/__init__.py": "from executor.sub.m import f\n",
        "executor/sub/m.py": "from executor.sub import k\n",                          # through the package's __init__
        "executor/sub/k.py": "",
        "kvcore/__init__.py": "",
        "kvcore/cost.py": "import numpy\n",
    })
    g = graph(root, ("planner", "executor", "kvcore"))
    assert g["planner.c"] == {"planner.b"} and g["executor.x"] == {"kvcore.cost"} and g["kvcore.cost"] == set()
    assert cycles(g) == [["executor.sub", "executor.sub.m"], ["planner.a", "planner.b"]]
    assert crossings(g) == ["executor.y -> planner.c"]
    (root / "planner/a.py").write_text("import kvcore\n")                             # the cycles broken
    (root / "executor/sub/m.py").write_text("from executor.sub.k import f\n")
    assert cycles(graph(root, ("planner", "executor", "kvcore"))) == []


def test_the_checker_finds_an_arrow_up_through_a_package_or_a_function(tmp_path):
    root = _tree(tmp_path, {
        "kvplan/__init__.py": "def __getattr__(name):\n    from kvplan import sdk\n    return sdk\n",
        "kvplan/sdk.py": "import executor.service\n",                       # the front imports the services: down
        "kvplan/config.py": "",
        "executor/__init__.py": "",
        "executor/service.py": "from kvplan import config\n",             # through the facade's __init__: up
        "executor/worker.py": "from kvplan.config import X\n",            # the ground floor alone: fine
        "executor/late.py": "def f():\n    from kvplan.sdk import Client\n",   # function level: up
    })
    g = graph(root, ("kvplan", "executor"))
    assert upward(g, ("kvplan", "kvplan.sdk")) == ["executor.late -> kvplan.sdk", "executor.service -> kvplan"]
