import pytest

from kvcore.config import (ALL_CONFIGS, CachestoreConfig, ConfigError, ExecutorConfig, ModelConfig, PlannerConfig,
                           env_names, from_env)


def test_from_env_reads_typed_values_and_overrides_win():
    cfg = from_env(ExecutorConfig, {"KVPLAN_EXECUTOR_PORT": "6000", "KVPLAN_PLAN_DEADLINE_S": "2.5",
                                    "KVPLAN_REDIS_URL": "redis://x:1/0"}, executor_id="e1")
    assert (cfg.port, cfg.plan_deadline_s, cfg.redis_url, cfg.executor_id) == (6000, 2.5, "redis://x:1/0", "e1")
    assert from_env(PlannerConfig, {}).default_strategy == "full"


@pytest.mark.parametrize("env, needle", [
    ({"KVPLAN_EXECUTOR_PORT": "abc"}, "KVPLAN_EXECUTOR_PORT"),
    ({"KVPLAN_EXECUTOR_PORT": "70000"}, "port"),
    ({"KVPLAN_PLAN_DEADLINE_S": "0"}, "KVPLAN_PLAN_DEADLINE_S"),
    ({"KVPLAN_HEARTBEAT_MS": "20000"}, "KVPLAN_HEARTBEAT_MS"),
    ({"KVPLAN_LOG_LEVEL": "LOUD"}, "KVPLAN_LOG_LEVEL"),
])
def test_bad_values_name_the_variable(env, needle):
    with pytest.raises(ConfigError, match=needle):
        from_env(ExecutorConfig, env)


@pytest.mark.parametrize("device, ok", [("cpu", True), ("cuda", True), ("cuda:1", True), ("gpu", False),
                                        ("cuda:x", False), ("cpu:0", False), ("", False)])
def test_the_device_is_cpu_or_a_cuda_device(device, ok):
    if ok:
        assert from_env(ModelConfig, {"KVPLAN_DEVICE": device}).device == device
    else:
        with pytest.raises(ConfigError, match="KVPLAN_DEVICE"):
            from_env(ModelConfig, {"KVPLAN_DEVICE": device})
    assert from_env(ModelConfig, {}).device == "cpu"


def test_configs_are_frozen_and_env_names_unique_per_config():
    cfg = from_env(CachestoreConfig, {})
    with pytest.raises(Exception):
        cfg.port = 1
    for cls in ALL_CONFIGS:
        names = env_names(cls)
        assert names and len(names) == len(set(names)), cls
        assert all(n.startswith("KVPLAN_") for n in names)
