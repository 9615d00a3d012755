"""The import graph of kvplan's own packages, module-level and function-level imports alike
(read with `ast`, nothing imported), and its floors (`LAYERS`), each importing only from its own
floor and the ones below:

    ground     kvcore (config, model, plan, cost model, serving plumbing, auth, keys, channels),
               kernels, protos — what every service needs; imports nothing above it
    services   planner, executor, cachestore — each imports the ground and itself only; the
               executor, the cachestore's client, also its client side (`cachestore.client`,
               `cachestore.handle`); planner and executor never import each other
    front      kvplan — the CLI, SDK, gateway, HTTP API, `kvplan up`; imports the services
    tools      bench — may import anything (`kvplan bench serve` runs `bench.serve` from a checkout)

and no cycle anywhere, bench included.

An edge goes to the module an import names: `from a.b import c` is a.b.c when that is a module,
and a.b too, whose `__init__` runs first — a module of its own, reached whenever an import names
the package or imports from it (except a top-level package from inside itself: it is always
initialized before any of its modules). The checker is tested on a made-up tree too, so a rule that could never fail is caught."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GROUND = ("kvcore", "kernels", "protos")
SERVICES = ("planner", "executor", "cachestore")
FRONT = ("kvplan",)
TOOLS = ("bench",)
PACKAGES = (*SERVICES, "kernels", "kvplan", "kvcore", "protos", "bench")
APART = ("planner", "executor")          # neither imports the other
# what a module of each package may import besides its own package: the floors below it
ALLOWED = {
    **{pkg: GROUND for pkg in GROUND},
    "planner": GROUND,
    "cachestore": GROUND,
    "executor": (*GROUND, "cachestore.client", "cachestore.handle"),   # the cachestore's client side
}


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


def breaches(g: dict[str, set[str]], allowed=ALLOWED) -> list[str]:
    """'a -> b' for every import by a module of a package in `allowed` of a module outside its own
    package and outside what `allowed` names for it (a package, or a module and its submodules)."""
    top = lambda m: m.split(".")[0]                                           # noqa: E731
    ok = lambda t, names: any(t == n or t.startswith(n + ".") for n in names)  # noqa: E731
    return sorted(f"{m} -> {t}" for m, ts in g.items() if top(m) in allowed for t in ts
                  if top(t) != top(m) and not ok(t, allowed[top(m)]))


def test_no_import_cycles():
    assert cycles(graph(ROOT)) == []


def test_planner_and_executor_never_import_each_other():
    assert crossings(graph(ROOT)) == []


def test_each_floor_imports_only_itself_and_the_floors_below():
    """The ground (kvcore, kernels, protos) never imports a service, the front (kvplan) or bench;
    a service imports only the ground, itself, and (the executor) the cachestore's client side.
    Before issue 41 the services took config, plans, serving plumbing, auth… from the front door's
    package (`kvplan/`), and `kvcore.plan_cost` took the plan dataclasses from there."""
    g = graph(ROOT)
    assert {m.split(".")[0] for m in g} == set(PACKAGES), "a package of PACKAGES has no modules"
    assert set(ALLOWED) | set(FRONT) | set(TOOLS) == set(PACKAGES)
    assert breaches(g) == []


def test_kvplan_is_the_front_only():
    """Nothing but the tools imports the front: every module of kvcore, kernels, protos, planner,
    executor and cachestore is importable without `kvplan` on the path."""
    g = graph(ROOT)
    assert sorted(f"{m} -> {t}" for m, ts in g.items() for t in ts
                  if t.split(".")[0] in FRONT and m.split(".")[0] not in (*FRONT, *TOOLS)) == []


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
        "kvcore/__init__.py": "",
        "kvcore/config.py": "",
        "kvcore/late.py": "def f():\n    from planner import fit\n",          # the ground, function level: up
        "planner/__init__.py": "",
        "planner/fit.py": "from kvcore.config import X\n",                  # a service on the ground: fine
        "cachestore/__init__.py": "",
        "cachestore/client.py": "",
        "cachestore/store.py": "",
        "executor/__init__.py": "",
        "executor/service.py": "from kvplan import sdk\n",                 # a service through the facade: up
        "executor/worker.py": "from cachestore.client import C\n",           # the cachestore's client side: fine
        "executor/late.py": "def f():\n    from cachestore.store import S\n",    # its server side: not
    })
    g = graph(root, ("kvplan", "kvcore", "planner", "executor", "cachestore"))
    allowed = {"kvcore": ("kvcore",), "planner": ("kvcore",), "cachestore": ("kvcore",),
               "executor": ("kvcore", "cachestore.client")}
    assert breaches(g, allowed) == ["executor.late -> cachestore.store", "executor.service -> kvplan",
                                    "executor.service -> kvplan.sdk", "kvcore.late -> planner",
                                    "kvcore.late -> planner.fit"]
