"""The MCP example end to end: the example MCP server on 127.0.0.1, registered over REST with a JSONL task file
and a `multi` grader, trained by a short RL job on the tiny model with a decaying process weight, after the
job's own warm start on an uploaded file of demonstrations (OpenAI's chat format with tool calls). The server
is killed in the middle of the job's episodes: those become infrastructure failures, excluded from the
advantages, and the job goes on to its last step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient

from api.app import create_app
from reward_models.graders import grade_trajectory, parse_grader
from rl_service.control.service import TaperService
from rl_service.control.settings import TaperSettings, get_settings
from rl_service.control.store import Store
from rl_service.hooks import InMemoryHooks
from rl_service.spec import JobSpec
from rl_service.training.runner import JobRunner
from rollout_workers.environments.policy import EnvironmentPolicy
from rollout_workers.storage import iter_trajectories, step_file
from rollout_workers.trajectory import Trajectory

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout_workers"))
from mcp_helpers import start_weather_server, stop  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mcp"
TEMPERATURES = {"Oslo": 4, "Paris": 12, "Cairo": 31, "Lima": 19, "Tokyo": 15, "Quito": 14}


@pytest.mark.slow
def test_mcp_example_trains_end_to_end_and_survives_its_server_dying(
    ray_local, redis_url: str, tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TAPER_HTTP_ALLOW", "127.0.0.1")  # the operator admits the local MCP server
    get_settings.cache_clear()
    # killed when a tool call looks up the 5th temperature: episodes of the first step get their answers
    proc, url = start_weather_server(die_at_lookup=5)
    try:
        store = Store(redis_url)
        service = TaperService(store, tmp_path / "data", env_policy=EnvironmentPolicy(http_allow=("127.0.0.1",)))
        key = store.create_api_key("acme")
        headers = {"Authorization": f"Bearer {key}"}
        with TestClient(create_app(service, TaperSettings(data_dir=tmp_path / "data"))) as client:
            tasks = (EXAMPLE / "weather_tasks.jsonl").read_bytes()
            r = client.post("/v1/files", files={"file": ("weather_tasks.jsonl", tasks)}, data={"purpose": "tasks"},
                            headers=headers)
            assert r.status_code == 200, r.text
            file_id = r.json()["id"]
            demos = (EXAMPLE / "weather_demonstrations.jsonl").read_bytes()  # OpenAI's chat format, tool_calls
            r = client.post("/v1/files", files={"file": ("weather_demonstrations.jsonl", demos)},
                            data={"purpose": "fine-tune"}, headers=headers)
            assert r.status_code == 200 and r.json()["demonstrations"] == 6, r.text
            demos_id = r.json()["id"]
            registration = yaml.safe_load((EXAMPLE / "weather_env.yaml").read_text()) | {"base_url": url}
            r = client.post("/v1/environments", json=registration, headers=headers)
            assert r.status_code == 201, r.text
            stored = r.json()["registration"]
            assert {t["name"] for t in stored["tools"]} == {"get_temperature", "list_cities"}
            assert stored["grader"]["type"] == "multi"
            job = yaml.safe_load((EXAMPLE / "weather_job.yaml").read_text())
            job["tasks"]["train_file"] = file_id
            job["warm_start"]["demonstrations"] = demos_id
            job |= {"total_steps": 4, "checkpoint_every": 4,
                    "reward_schedule": {"kind": "linear", "w_start": 1.0, "w_end": 0.0, "horizon": 3},
                    "rollout": {**job["rollout"], "num_generations": 2, "max_tokens_per_turn": 24,
                                "tool_timeout_s": 10}}
            r = client.post("/v1/jobs", json=job, headers=headers)
            assert r.status_code == 201, r.text
            job_id = r.json()["id"]
        spec = store.get_job(job_id, tenant="acme").spec
        assert spec.environment.registration is not None and spec.tasks.train_path
        assert spec.warm_start.demonstrations_path  # the job warm-starts itself from the uploaded file
        spec = JobSpec.model_validate(spec.model_dump() | {"model": {"checkpoint_dir": str(tiny_llama_dir)}})

        hooks = InMemoryHooks(schedule=spec.reward_schedule)
        work = tmp_path / "job"
        assert JobRunner(job_id, spec, hooks, work).run() == "succeeded"
        (done,) = hooks.events_of("warm_start_done")
        assert done["loss"] < 0.2, done
    finally:
        stop(proc)
        get_settings.cache_clear()

    assert proc.returncode == 1  # it died, as a crashed server does
    trajectories: list[Trajectory] = [t for s in range(4) for t in iter_trajectories(step_file(work / "trajectories", s))]
    assert len(trajectories) == 4 * 2 * 2

    # MCP tool calls with their results, inserted with loss mask 0
    answered = [(t, i, c) for t in trajectories for i, s in enumerate(t.steps) for c in s.tool_calls
                if c.name == "get_temperature" and c.error is None]
    assert answered, [t.steps[0].action_text for t in trajectories]
    for t, i, call in answered:
        assert call.result == str(TEMPERATURES[t.task["city"]]) or t.task["city"].lower() not in call.arguments["city"].lower()
        step = t.steps[i]
        start = sum(len(s.action_ids) + len(s.observation_ids) for s in t.steps[:i]) + len(step.action_ids)
        assert step.observation_ids and t.loss_mask()[start:start + len(step.observation_ids)] == [0] * len(step.observation_ids)
        assert set(t.loss_mask()[start - len(step.action_ids):start]) == {1}
        assert call.result in step.observation_text
        assert step.process_rewards["asked_weather"] == 1.0 and "right_city" in step.process_rewards

    # the outcome is the declared multi grader's
    grader = parse_grader(stored["grader"])
    scored = [t for t in trajectories if not t.excluded]
    assert scored
    for t in scored:
        assert t.outcome_reward == pytest.approx(grade_trajectory(grader, t))

    # the server died mid-episode: infrastructure failures, excluded, and the job went on
    failed = [t for t in trajectories if t.status.is_infra_failure]
    assert failed and all(t.outcome_reward is None for t in failed)
    assert any("MCP" in (t.error or "") or any(c.error for s in t.steps for c in s.tool_calls) for t in failed)
    mid_episode = [t for t in failed if any(c.name == "get_temperature" for s in t.steps for c in s.tool_calls)]
    assert mid_episode, [(t.status, t.error) for t in failed]
    rows = {step: m for step, m in hooks.metrics if "trajectories/excluded" in m}
    assert sum(m["trajectories/excluded"] for m in rows.values()) == len(failed)
    assert hooks.events_of("completed")[0]["step"] == 4
    # the process weight decayed over the run
    weights_seen = [m["schedule/weight"] for _, m in sorted(rows.items()) if "schedule/weight" in m]
    assert weights_seen[0] == 1.0 and weights_seen == sorted(weights_seen, reverse=True)
