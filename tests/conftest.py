"""Shared fixtures: a real redis-server on a free port, the real model, a tiny random model."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

# Services started by tests (in process and as subprocesses) run without API keys unless a test
# turns authentication on itself (tests/kvcore/test_auth.py); production defaults to on.
os.environ.setdefault("KVPLAN_AUTH", "off")
# Tests never meet the developer's own `kvplan up` cluster (~/.cache/kvplan/cluster): an in-process
# CLI call would take its admin key into KVPLAN_API_KEY, which later tests' services do not know.
# A test that wants a cluster's state dir sets KVPLAN_STATE_DIR itself.
import tempfile  # noqa: E402
os.environ["KVPLAN_STATE_DIR"] = tempfile.mkdtemp(prefix="kvplan-test-state-")
# The suite's tolerances and exact replays (greedy tokens against transformers' own, byte counts) are
# fp32's: the model computes in fp32, in process and in the services tests start, unless the runner
# names a dtype (KVPLAN_COMPUTE_DTYPE=bfloat16 runs the suite in bf16). Production's default is `auto`
# (bf16 on CPUs with AVX512-BF16 or AMX: kvcore.host); tests/kvcore/test_model.py runs bf16 itself.
os.environ.setdefault("KVPLAN_COMPUTE_DTYPE", "float32")

from cachestore.process import free_port
from kvplan.members import wait_redis
from kvcore.config import ModelConfig, from_env


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real redis-server, started for this test session on its own port."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (apt-get install -y redis-server)")
    port = free_port()
    d = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(d)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_redis(port)
    except RuntimeError:
        proc.kill()
        pytest.fail("redis-server did not start")
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def redis_db(redis_url):
    """The session's Redis, flushed for this test."""
    import redis
    r = redis.Redis.from_url(redis_url)
    r.flushall()
    r.close()
    return redis_url


@pytest.fixture(scope="session")
def model_cfg() -> ModelConfig:
    """The real model's config (KVPLAN_CACHE_DIR as the developer or CI set it)."""
    return from_env(ModelConfig)


@pytest.fixture(scope="session")
def real_model_dir(model_cfg) -> Path:
    from kvcore import model
    return model.prepare(model_cfg)


@pytest.fixture(scope="session")
def real_model(model_cfg):
    from kvcore import model
    return model.load(model_cfg)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, real_model_dir) -> Path:
    """A 2-layer random Llama (GQA 4:2, head dim 16) with the real tokenizer: fast unit tests."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(real_model_dir)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    d = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir, model_cfg):
    import dataclasses
    from kvcore import model
    return model.load(dataclasses.replace(model_cfg, model=str(tiny_model_dir)))


@pytest.fixture(autouse=True)
def _api_key_restored():
    """KVPLAN_API_KEY as it was before the test: the CLI sets it (`keyfile.use_cluster_key`) when a
    test calls it in process, and a key one test's cluster made means nothing to the next."""
    before = os.environ.get("KVPLAN_API_KEY")
    yield
    if before is None:
        os.environ.pop("KVPLAN_API_KEY", None)
    else:
        os.environ["KVPLAN_API_KEY"] = before
