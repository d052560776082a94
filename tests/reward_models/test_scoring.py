from __future__ import annotations

from typing import Any

import pytest

from reward_models.components import (
    ProcessComponent,
    StepComponent,
    build_component,
    claims_agree,
    numbers_in,
    register_component,
    registered_components,
)
from reward_models.scoring import build_components, score_trajectories


def calc_traj(b: Any, env: Any, calls_per_step: list[list[Any]], final_text: str, question: str, answer: int):
    steps = [b.step(calls=calls) for calls in calls_per_step]
    final = b.step(is_final=True, n_obs=0)
    final.action_text = final_text
    return b.traj("g", None, [*steps, final], task={"question": question, "answer": answer})


def test_components_on_a_calculator_trajectory(b: Any, calc_env: Any) -> None:
    t = calc_traj(
        b,
        calc_env,
        [
            [b.call("calculate", {"expression": "12*7"}, result="84")],  # all good
            [
                b.call(None),  # did not parse
                b.call(
                    "calculate", {"expr": "84+5"}, result=None, error="bad args", error_kind="bad_arguments"
                ),
            ],
            [b.call("search", {"q": "x"}, result=None, error="unknown", error_kind="unknown_tool")],
            [b.call("calculate", {"expression": "84-3"}, result="81")],  # 84 from step 0, 3 from the question
            [b.call("calculate", {"expression": "99*2"}, result="198")],  # 99 and 2 come from nowhere
        ],
        final_text="The answer is 81",
        question="What is 12*7 minus 3?",
        answer=81,
    )
    score_trajectories([t], calc_env)
    pr = [s.process_rewards for s in t.steps]
    assert pr[0] == {"format": 1.0, "tool_valid": 1.0, "tool_ok": 1.0, "consistency": 1.0, "calc_short": 1.0}
    assert pr[1]["format"] == 0.5 and pr[1]["tool_valid"] == 0.0 and pr[1]["tool_ok"] == 0.0
    assert pr[1]["consistency"] == 0.5  # 84 comes from step 0, 5 from nowhere
    assert pr[2]["format"] == 1.0 and pr[2]["tool_valid"] == 0.0 and pr[2]["tool_ok"] == 0.0
    assert pr[3]["consistency"] == 1.0
    assert pr[4]["consistency"] == 0.0
    assert pr[5] == {"calc_short": 1.0}  # final answer: no tool-call components, env's own still applies
    assert t.outcome_reward == 1.0


def test_consistency_counts_each_claimed_number() -> None:
    assert list(numbers_in({"a": "12-7", "b": [3.5, "x = -2"], "c": True})) == [12.0, 7.0, 3.5, -2.0]
    assert claims_agree([12, 7, 40], ["What is 12 - 7?", "result: 5"]) == pytest.approx(2 / 3)
    assert claims_agree(["doc-abc"], [{"hits": "doc-abc, doc-def"}]) == 1.0
    assert claims_agree([], ["1"]) is None


def test_consistency_absent_without_the_hook(b: Any, calc_env: Any) -> None:
    class NoHook(type(calc_env)):
        checkable_values = None

    t = calc_traj(b, calc_env, [[b.call("calculate", {"expression": "1+1"}, result="2")]], "2", "1+1?", 2)
    score_trajectories([t], NoHook())
    assert "consistency" not in t.steps[0].process_rewards and "format" in t.steps[0].process_rewards


def test_infrastructure_failures_have_missing_outcome_and_no_process_rewards(b: Any, calc_env: Any) -> None:
    t = calc_traj(b, calc_env, [[b.call("calculate", {"expression": "1+1"}, result="2")]], "2", "1+1?", 2)
    t.status = b.Status.TOOL_TIMEOUT
    t.steps[0].process_rewards = {"stale": 1.0}
    score_trajectories([t], calc_env)
    assert t.outcome_reward is None and t.excluded and all(not s.process_rewards for s in t.steps)


def test_crashing_verifier_or_hook_marks_env_error(b: Any, calc_env: Any) -> None:
    final = b.step(is_final=True)
    final.action_text = "42"
    t = b.traj("g", None, [final], task={})  # no "answer": the verifier raises KeyError
    score_trajectories([t], calc_env)
    assert t.status == b.Status.ENV_ERROR and t.outcome_reward is None and "outcome verifier" in t.error
    # the consistency hook raises (no "question"): scored as an environment failure, not a crash of the batch
    t2 = b.traj(
        "g", None, [b.step(calls=[b.call("calculate", {"expression": "1"})]), b.step()], task={"answer": 1}
    )
    ok = calc_traj(b, calc_env, [], "2", "1+1?", 2)
    score_trajectories([t2, ok], calc_env)
    assert (
        t2.status == b.Status.ENV_ERROR and t2.outcome_reward is None and "'consistency' failed" in t2.error
    )
    assert all(not s.process_rewards for s in t2.steps)
    assert ok.outcome_reward == 1.0 and ok.status == b.Status.OK


def test_truncated_is_scored_not_excluded(b: Any, calc_env: Any) -> None:
    t = calc_traj(b, calc_env, [], "no idea", "1+1?", 2)
    t.status = b.Status.TRUNCATED
    score_trajectories([t], calc_env)
    assert t.outcome_reward == 0.0 and not t.excluded


def test_out_of_range_values_name_the_culprit(b: Any, calc_env: Any) -> None:
    class BadEnv(type(calc_env)):
        def process(self, trajectory: Any, step_index: int) -> dict[str, float]:
            return {"calc_short": 1.5}

    class BadOutcome(type(calc_env)):
        def outcome(self, trajectory: Any) -> float:
            return 2.0

    t = calc_traj(b, calc_env, [], "2", "1+1?", 2)
    with pytest.raises(ValueError, match="calc_short.*'env'.*'calc'"):
        score_trajectories([t], BadEnv())
    with pytest.raises(ValueError, match="outcome reward of environment 'calc'"):
        score_trajectories([t], BadOutcome())

    class Clash(type(calc_env)):
        def process(self, trajectory: Any, step_index: int) -> dict[str, float]:
            return {"format": 1.0}

    t2 = calc_traj(b, calc_env, [[b.call("calculate", {"expression": "1+1"}, result="2")]], "2", "1+1?", 2)
    with pytest.raises(ValueError, match="'format' is produced by both"):
        score_trajectories([t2], Clash())


def test_registry_builds_custom_components_and_rejects_unknown(b: Any, calc_env: Any) -> None:
    @register_component("answer_len_test")
    class AnswerLen(StepComponent):
        name = "answer_len"

        def __init__(self, limit: int = 3) -> None:
            self.limit = limit

        def score_step(self, trajectory: Any, index: int, step: Any, env: Any) -> float | None:
            return float(len(step.action_ids) <= self.limit)

    assert "answer_len_test" in registered_components() and "model_scorer" in registered_components()
    comp = build_component({"kind": "answer_len_test", "limit": 2})
    assert isinstance(comp, ProcessComponent) and comp.limit == 2
    t = calc_traj(b, calc_env, [], "2", "1+1?", 2)
    score_trajectories([t], calc_env, components=["format", comp])
    assert t.steps[0].process_rewards == {"answer_len": 0.0}
    with pytest.raises(ValueError, match="unknown process component kind 'nope'"):
        build_components(["nope"])
    with pytest.raises(ValueError, match="bad options for process component 'format'"):
        build_component({"kind": "format", "bogus": 1})


def test_openai_style_tool_entries_validate(b: Any, calc_env: Any) -> None:
    class OpenAIStyle(type(calc_env)):
        def tools(self) -> list[dict[str, Any]]:
            return [{"type": "function", "function": t} for t in super().tools()]

    t = calc_traj(b, calc_env, [[b.call("calculate", {"expression": "1+1"}, result="2")]], "2", "1+1?", 2)
    score_trajectories([t], OpenAIStyle())
    assert t.steps[0].process_rewards["tool_valid"] == 1.0
