"""API keys and tenants (issue 23) over real gRPC on 127.0.0.1: the keys file (hashes only), the
one server interceptor on the planner, the cachestore and the executor (real model), tenants
taken from the key, admin-only methods, a key added while the services run, `kvplan keys add`."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import stat
import threading

import grpc
import pytest

from kvplan import cli
from kvcore import keyfile, serving
from kvcore.config import (CachestoreConfig, ConfigError, ExecutorConfig, PlannerConfig, SecurityConfig, from_env)
from protos import cachestore_pb2 as cpb
from protos import cachestore_pb2_grpc, executor_pb2, executor_pb2_grpc, planner_pb2, planner_pb2_grpc
from kvplan.client import request

SHAPE = planner_pb2.ModelShape(num_layers=2, num_kv_heads=2, num_query_heads=4, head_dim=16)


@pytest.fixture
def keys(tmp_path):
    """A keys file with an admin key and user keys of tenants a and b -> (path, {name: key})."""
    path = tmp_path / "keys.yaml"
    made = {"admin": keyfile.add_key(path, "ops", "admin"), "a": keyfile.add_key(path, "a", "user"),
            "b": keyfile.add_key(path, "b", "user")}
    return path, made


def test_the_keys_file_holds_hashes_not_keys(keys):
    path, made = keys
    text = path.read_text()
    assert all(k not in text for k in made.values())
    assert all(keyfile.hash_key(k) in text for k in made.values())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    ring = keyfile.KeyRing(path)
    assert ring.lookup(made["a"]) == keyfile.Identity("a", "user") and ring.lookup("kvp_nope") is None


@pytest.mark.parametrize("content, words", [
    ("keys: [1, 2]", "must be a mapping"),
    ('{"keys": {"sha256:abc": {"tenant": "a", "role": "user"}}}', "is not sha256:<64 hex digits>"),
    ('{"keys": {"sha256:' + "0" * 64 + '": {"tenant": "a", "role": "root"}}}', "needs a tenant and a role"),
    ('{"keys": {"sha256:' + "0" * 64 + '": {"tenant": "a\\nb", "role": "user"}}}', "tenant: must match"),
])
def test_a_bad_keys_file_is_a_config_error(tmp_path, content, words):
    f = tmp_path / "k.json"
    f.write_text(content)
    with pytest.raises(ConfigError, match=words):
        keyfile.KeyRing(f)


def test_auth_on_without_a_keys_file_refuses_to_start():
    with pytest.raises(ConfigError, match="KVPLAN_AUTH_KEYS_FILE is not set"):
        keyfile.keyring(SecurityConfig(auth="on"))
    assert keyfile.keyring(SecurityConfig(auth="off")) is None


class Services:
    """Planner and cachestore (and optionally the executor) on one event loop in a thread, with
    authentication on; the executor calls the others with the admin key as its service key."""

    def __init__(self, keys_file, executor_model_cfg=None, service_key: str = ""):
        self.sec = SecurityConfig(auth="on", keys_file=str(keys_file))
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.servers, self.addr = [], {}
        self._run(self._start(executor_model_cfg, service_key))

    def _run(self, coro, timeout=300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, model_cfg, service_key) -> None:
        from cachestore.service import build_service as cachestore
        from planner.service import build_service as planner
        pcfg = dataclasses.replace(from_env(PlannerConfig, {}), port=0)
        await self._add("planner", planner(pcfg), pcfg)
        ccfg = CachestoreConfig(port=0, capacity_bytes=1 << 24)
        await self._add("cachestore", cachestore(ccfg), ccfg)
        if model_cfg is not None:
            from executor.service import build_service as executor
            ecfg = dataclasses.replace(from_env(ExecutorConfig, {}), port=0, metrics_port=0, redis_url="",
                                       planner_addr=self.addr["planner"], cachestore_addr=self.addr["cachestore"])
            await self._add("executor", executor(ecfg, model_cfg), ecfg)

    async def _add(self, name, svc, cfg):
        server, port = await serving.start(svc, cfg, with_metrics=False, security=self.sec)
        self.servers.append((server, svc))
        self.addr[name] = f"127.0.0.1:{port}"
        assert await svc.warm_task is None

    def stop(self):
        async def stop():
            for server, svc in reversed(self.servers):
                await serving.shutdown(server, svc, 0.5)
        self._run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)


def channel(addr: str, key: str = "") -> grpc.Channel:
    from kvcore.channels import client_channel
    return client_channel(addr, sec=SecurityConfig(auth="on", api_key=key))


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


@pytest.fixture
def services(keys):
    s = Services(keys[0])
    yield s
    s.stop()


def test_no_key_or_an_unknown_key_is_unauthenticated_and_health_stays_open(services, keys):
    _, made = keys
    for addr in services.addr.values():
        assert serving.check_health(addr) == "SERVING"
    for key in ("", "kvp_not-a-key"):
        stub = planner_pb2_grpc.PlannerStub(channel(services.addr["planner"], key))
        assert code_of(lambda: stub.ListStrategies(planner_pb2.ListStrategiesRequest(), timeout=5)) == \
            grpc.StatusCode.UNAUTHENTICATED
        cs = cachestore_pb2_grpc.CacheStoreStub(channel(services.addr["cachestore"], key))
        assert code_of(lambda: cs.Stats(cpb.StatsRequest(), timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
    ok = planner_pb2_grpc.PlannerStub(channel(services.addr["planner"], made["a"]))
    assert ok.ListStrategies(planner_pb2.ListStrategiesRequest(), timeout=5).active == "full"


def test_strategy_changes_need_an_admin_key(services, keys):
    _, made = keys
    user = planner_pb2_grpc.PlannerStub(channel(services.addr["planner"], made["a"]))
    admin = planner_pb2_grpc.PlannerStub(channel(services.addr["planner"], made["admin"]))
    mine = "name: mine\neviction: {scorer: snapkv}\n"
    for call in (lambda: user.SetStrategy(planner_pb2.SetStrategyRequest(name="snapkv"), timeout=5),
                 lambda: user.SetStrategy(planner_pb2.SetStrategyRequest(definition=mine), timeout=5),
                 lambda: user.DeleteStrategy(planner_pb2.DeleteStrategyRequest(name="mine"), timeout=5)):
        assert code_of(call) == grpc.StatusCode.PERMISSION_DENIED
    assert admin.SetStrategy(planner_pb2.SetStrategyRequest(definition=mine), timeout=5).name == "mine"
    assert admin.DeleteStrategy(planner_pb2.DeleteStrategyRequest(name="mine"), timeout=5).active == "full"
    # a user plans for its own tenant only
    assert len(user.Plan(planner_pb2.PlanRequest(tenant="a", model=SHAPE), timeout=5).layers) == 2
    assert code_of(lambda: user.Plan(planner_pb2.PlanRequest(tenant="b", model=SHAPE), timeout=5)) == \
        grpc.StatusCode.PERMISSION_DENIED


def test_cachestore_blocks_belong_to_the_key_s_tenant(services, keys):
    """Before: any client read or released any tenant's blocks, freeing a live job's accounting."""
    _, made = keys
    a = cachestore_pb2_grpc.CacheStoreStub(channel(services.addr["cachestore"], made["a"]))
    b = cachestore_pb2_grpc.CacheStoreStub(channel(services.addr["cachestore"], made["b"]))
    admin = cachestore_pb2_grpc.CacheStoreStub(channel(services.addr["cachestore"], made["admin"]))
    reg = dict(job_id="j", layers=1, kv_heads=2, head_dim=8, dtype="float16", max_tokens=16, top_k=2,
               shared_memory=True)
    b.Register(cpb.RegisterRequest(**reg), timeout=5)                  # no tenant field: the key's (b)
    assert admin.Stats(cpb.StatsRequest(tenant="b"), timeout=5).pinned_jobs == 1
    assert code_of(lambda: a.Release(cpb.ReleaseRequest(tenant="b", job_id="j"), timeout=5)) == \
        grpc.StatusCode.PERMISSION_DENIED
    assert code_of(lambda: a.Register(cpb.RegisterRequest(tenant="b", **reg), timeout=5)) == \
        grpc.StatusCode.PERMISSION_DENIED
    assert code_of(lambda: a.Get(cpb.GetRequest(key=cpb.BlockKey(tenant="b", job_id="j")), timeout=5)) == \
        grpc.StatusCode.PERMISSION_DENIED
    assert a.Release(cpb.ReleaseRequest(job_id="j"), timeout=5).freed_bytes == 0    # a's own "j": none
    assert a.Stats(cpb.StatsRequest(), timeout=5).jobs == 0                          # a sees its tenant only
    stats = admin.Stats(cpb.StatsRequest(), timeout=5)
    assert stats.jobs == 1 and stats.pinned_jobs == 1                                # b's job is intact
    assert admin.Release(cpb.ReleaseRequest(tenant="b", job_id="j"), timeout=5).freed_bytes > 0


def test_a_key_added_while_the_services_run_works_without_a_restart(services, keys, capsys):
    path, _ = keys
    stub_for = lambda key: planner_pb2_grpc.PlannerStub(channel(services.addr["planner"], key))  # noqa: E731
    assert cli.main(["keys", "add", "--tenant", "late", "--role", "user", "--file", str(path)]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith(keyfile.KEY_PREFIX) and key not in path.read_text()
    import time
    deadline = time.monotonic() + 5                       # the file is looked at once a second
    while True:
        try:
            stub_for(key).ListStrategies(planner_pb2.ListStrategiesRequest(), timeout=5)
            break
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED and time.monotonic() < deadline
            time.sleep(0.2)
    assert json.loads(path.read_text())["keys"][keyfile.hash_key(key)]["tenant"] == "late"


def test_keys_add_refuses_a_bad_tenant(tmp_path, capsys):
    assert cli.main(["keys", "add", "--tenant", "a b", "--file", str(tmp_path / "k.json")]) == 2
    assert "tenant: must match" in capsys.readouterr().err


@pytest.fixture(scope="module")
def executor_services(tmp_path_factory, model_cfg, real_model_dir):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    made = {"admin": keyfile.add_key(path, "ops", "admin"), "a": keyfile.add_key(path, "a", "user"),
            "b": keyfile.add_key(path, "b", "user")}
    mp = pytest.MonkeyPatch()
    mp.setenv("KVPLAN_API_KEY", made["admin"])           # the executor's key to the planner and the cachestore
    try:
        s = Services(path, executor_model_cfg=model_cfg)
    finally:
        mp.undo()
    yield s, made
    s.stop()


def test_a_job_belongs_to_the_tenant_of_its_key(executor_services):
    """Before: any client read or cancelled any job by id; the tenant was a request field."""
    s, made = executor_services
    stub = {name: executor_pb2_grpc.ExecutorStub(channel(s.addr["executor"], key)) for name, key in made.items()}
    assert code_of(lambda: executor_pb2_grpc.ExecutorStub(channel(s.addr["executor"])).SubmitJob(
        request("hi"), timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: stub["a"].SubmitJob(request("hi", tenant="b"), timeout=10)) == \
        grpc.StatusCode.PERMISSION_DENIED
    job = stub["a"].SubmitJob(request("Count to ten.", max_new_tokens=4), timeout=30)
    ref = executor_pb2.JobRef(job_id=job.job_id)
    for call in (lambda: stub["b"].GetJob(ref, timeout=5), lambda: stub["b"].CancelJob(ref, timeout=5),
                 lambda: list(stub["b"].WatchJob(ref, timeout=5))):
        assert code_of(call) == grpc.StatusCode.NOT_FOUND
    assert stub["a"].GetJob(ref, timeout=5).job_id == job.job_id
    assert stub["admin"].GetJob(ref, timeout=5).job_id == job.job_id
    events = list(stub["a"].WatchJob(ref, timeout=120))
    final = events[-1]
    assert final.WhichOneof("kind") in ("result", "status")
    got = stub["a"].GetJob(ref, timeout=5)
    assert got.state == executor_pb2.DONE, got.error
    assert not got.result.degraded                        # the service key reached the planner


def test_any_authorization_metadata_is_unauthenticated_or_admitted(services, keys):
    """Hypothesis over the `authorization` value (schemes, junk, near-misses of a real key):
    UNAUTHENTICATED unless it is a real key, never UNKNOWN or INTERNAL."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    _, made = keys
    ch = grpc.insecure_channel(services.addr["planner"])
    call = ch.unary_unary("/kvplan.v1.Planner/ListStrategies", request_serializer=None, response_deserializer=None)
    printable = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=80)
    values = st.one_of(printable, st.builds(lambda s, k: f"{s} {k}", st.sampled_from(["Bearer", "bearer", "Basic", ""]),
                                            st.one_of(printable, st.sampled_from(list(made.values())),
                                                      st.sampled_from([v[:-1] for v in made.values()]))))

    @settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(value=values)
    def check(value):
        try:
            call(b"", metadata=(("authorization", value),), timeout=5)
            scheme, _, key = value.partition(" ")
            assert scheme.lower() == "bearer" and key.strip() in made.values(), value
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED, (value, e.code(), e.details())

    try:
        check()
    finally:
        ch.close()


def test_the_sdk_raises_its_own_error_for_a_wrong_key(executor_services):
    """Before: a wrong key through `kvplan.Client` raised a raw grpc._channel._MultiThreadedRendezvous."""
    import kvplan
    s, made = executor_services
    for key in ("kvp_not-a-key", ""):
        with kvplan.Client(s.addr["executor"], api_key=key) as client:
            with pytest.raises(kvplan.AuthenticationError, match="refused the API key") as e:
                client.generate("hi", max_new_tokens=2)
            assert not isinstance(e.value, grpc.RpcError)
    with kvplan.Client(s.addr["executor"], api_key=made["a"]) as client:
        assert client.generate("Count to three.", max_new_tokens=4).generated_tokens > 0
