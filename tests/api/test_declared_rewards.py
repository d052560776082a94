"""A registration's declared grader and process components are checked at registration (422 naming the
field) and stored with it."""

from __future__ import annotations

from api_helpers import Api

CALC = {"kind": "python", "name": "graded-calc", "import_path": "rollout_workers.environments.calculator:CalculatorEnv"}
GRADER = {"type": "multi", "calculate_output": "0.9 * right + 0.1 * said",
          "graders": {"right": {"type": "numeric", "input": "{{sample.answer}}", "reference": "{{item.answer}}"},
                      "said": {"type": "string_check", "input": "{{sample.output_text}}", "reference": "answer",
                               "operation": "ilike"}}}
PROCESS = [{"kind": "tool_called", "name": "used_calculator", "tool": "calculator"}]


def test_declared_rewards_are_checked_and_stored(api: Api) -> None:
    r = api.client.post("/v1/environments", json=CALC | {"grader": GRADER, "process_rewards": PROCESS}, headers=api.h())
    assert r.status_code == 201, r.text
    assert r.json()["registration"]["grader"] == GRADER
    assert r.json()["registration"]["process_rewards"] == PROCESS
    bad = [
        ({"grader": {**GRADER, "calculate_output": "right + __import__('os')"}}, "grader.multi"),
        ({"grader": {"type": "numeric", "input": "x", "reference": "y", "tolerance": -1}}, "grader.numeric.tolerance"),
        ({"grader": {"type": "exec", "code": "1"}}, "grader"),
        ({"process_rewards": [{"kind": "tool_called", "name": "a"}]}, "process_rewards.0.tool_called.tool"),
        ({"process_rewards": [{"kind": "anything", "name": "a"}]}, "process_rewards.0"),
    ]
    for extra, field in bad:
        r = api.client.post("/v1/environments", json=CALC | {"name": "other"} | extra, headers=api.h())
        assert r.status_code == 422, (extra, r.text)
        assert r.json()["error"]["field"].startswith(field), (field, r.json())
    assert api.client.get("/v1/environments/other", headers=api.h()).status_code == 404


def test_a_job_may_declare_its_own_grader(api: Api) -> None:
    job = {"environment": {"name": "calculator", "grader": GRADER, "process_rewards": PROCESS}}
    r = api.client.post("/v1/jobs", json=job, headers=api.h())
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["environment"]["grader"] == GRADER
    bad = {"environment": {"name": "calculator", "grader": {**GRADER, "calculate_output": "nope"}}}
    r = api.client.post("/v1/jobs", json=bad, headers=api.h())
    assert r.status_code == 422 and r.json()["error"]["field"].startswith("environment.grader"), r.text
