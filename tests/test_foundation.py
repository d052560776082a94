"""The foundation is real: each shared fixture talks to a real service, and settings fail clearly."""

from __future__ import annotations

import os

import pytest


def test_redis_fixture_is_a_real_server(redis_url: str) -> None:
    import redis

    client = redis.Redis.from_url(redis_url)
    info = client.info("server")
    assert info["redis_version"].count(".") == 2
    assert info["process_id"] != os.getpid()
    client.set("taper:probe", "1")
    assert client.get("taper:probe") == b"1"


def test_ray_fixture_runs_an_actor_in_another_process(ray_local) -> None:
    ray = ray_local

    @ray.remote(num_cpus=0)
    class Probe:
        def pid(self) -> int:
            return os.getpid()

    actor = Probe.remote()
    assert ray.get(actor.pid.remote(), timeout=60) != os.getpid()
    ray.kill(actor)


def test_vllm_fixture_generates_with_logprobs(vllm_engine) -> None:
    from vllm import SamplingParams

    # the session's engine (the rollout worker tests share it): a real vLLM LLM on the tiny Llama, called on
    # the engine's own thread between its steps
    params = SamplingParams(max_tokens=8, temperature=1.0, logprobs=0, seed=1, ignore_eos=True)
    generated = vllm_engine.call(lambda: vllm_engine.llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params))
    out = generated[0].outputs[0]
    assert len(out.token_ids) == 8
    assert out.logprobs is not None and len(out.logprobs) == 8
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp[tok].logprob <= 0.0


def test_bad_setting_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from rl_service.control.settings import SettingsError, load_settings

    monkeypatch.setenv("TAPER_API_PORT", "not-a-port")
    with pytest.raises(SettingsError, match="TAPER_API_PORT"):
        load_settings()
    monkeypatch.setenv("TAPER_API_PORT", "8080")
    monkeypatch.setenv("TAPER_REDIS_URL", "http://example")
    with pytest.raises(SettingsError, match="TAPER_REDIS_URL"):
        load_settings()


def test_settings_read_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from rl_service.control.settings import load_settings

    monkeypatch.setenv("TAPER_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    s = load_settings()
    assert s.data_dir == tmp_path
    assert s.ray_address == "10.0.0.1:6379"
    assert s.redis_url is None
