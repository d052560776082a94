"""Shared fixtures for the real services the tests talk to: Redis, Ray and a vLLM engine on CPU."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# vLLM on CPU: in-process engine, eager mode, a small KV cache and caches under a private temp dir (or the
# VLLM_CACHE_ROOT the caller set: scripts/test.sh shares one between its pytest processes, so the model-class
# inspection vLLM otherwise runs in a fresh interpreter at each engine's first start, ~13 s of CPU, is done
# once per run; vLLM keys that cache by the model module's file hash).
# Set at import time so Ray workers started later inherit them too.
_SCRATCH = Path(tempfile.mkdtemp(prefix="taper-tests-"))
VLLM_TEST_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT") or str(_SCRATCH / "vllm-cache"),
    "VLLM_CONFIGURE_LOGGING": "0",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
}
for _k, _v in VLLM_TEST_ENV.items():
    os.environ.setdefault(_k, _v)


@pytest.fixture(scope="session")
def scratch_dir() -> Path:
    return _SCRATCH


@pytest.fixture(scope="session")
def redis_server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server: the one CI started (TAPER_TEST_REDIS_URL), else a private one for this run."""
    url = os.environ.get("TAPER_TEST_REDIS_URL")
    if url:
        yield url
        return
    from rl_service.control.local_services import start_private_redis

    server = start_private_redis(tmp_path_factory.mktemp("redis"), persist=False)
    yield server.url
    server.stop()


@pytest.fixture
def redis_url(redis_server_url: str) -> str:
    """The test Redis, emptied before the test."""
    import redis

    redis.Redis.from_url(redis_server_url).flushdb()
    return redis_server_url


@pytest.fixture(scope="session")
def ray_local() -> Iterator[object]:
    """A real local Ray (2 CPUs, small object store), shared by the session."""
    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=2,
            object_store_memory=256 * 1024 * 1024,
            include_dashboard=False,
            log_to_driver=False,
            namespace="taper-tests",
            runtime_env={"env_vars": dict(VLLM_TEST_ENV)},
        )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def vllm_env() -> dict[str, str]:
    """The environment the vLLM CPU engine needs in tests (already applied to os.environ)."""
    return dict(VLLM_TEST_ENV)


@pytest.fixture(scope="session")
def vllm_engine(tiny_llama_dir: Path, vllm_env: dict[str, str]) -> Any:
    """One real in-process vLLM engine on the tiny Llama, shared by the session (a start costs ~10 s of CPU).
    Closing another in-process engine tears down vLLM's process-wide state, so a group uses this one before
    any test builds and closes its own (tests/test_foundation.py runs first in its group)."""
    from rollout_workers.engine import EngineConfig
    from rollout_workers.vllm_engine import VLLMEngine

    return VLLMEngine(EngineConfig(model_dir=str(tiny_llama_dir), max_model_len=1024, kv_cache_gib=0.25, seed=0))


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    from model.tokenizer import TOKENIZER_DIR

    return Path(TOKENIZER_DIR)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A tiny random Llama checkpoint with our tokenizer: a plain vLLM model for engine tests."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    out = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
