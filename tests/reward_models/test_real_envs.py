"""Scoring and credit on trajectories through the built-in environments (real tools, real verifiers)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from reward_models.credit import compute_advantages
from reward_models.scoring import score_trajectories
from rollout_workers.environments.calculator import CalculatorEnv
from rollout_workers.environments.long_horizon import LongHorizonEnv
from rollout_workers.trajectory import Step, ToolCall, Trajectory


def run_episode(
    env: Any, task: dict[str, Any], calls: list[tuple[str, dict[str, Any]]], answer: str
) -> Trajectory:
    """A trajectory whose tool calls really ran in `env` (token ids are placeholders)."""
    asyncio.run(env.reset(task))
    steps = []
    for name, args in calls:
        raw = json.dumps({"name": name, "arguments": args})
        try:
            call = ToolCall(raw=raw, name=name, arguments=args, result=asyncio.run(env.call(name, args)))
        except Exception as e:  # the tool refused the call: its message is the answer the model sees
            call = ToolCall(raw=raw, name=name, arguments=args, error=str(e), error_kind="tool_error")
        steps.append(
            Step(
                action_ids=[5, 6, 7],
                action_logprobs=[-1.0] * 3,
                action_text=f"<tool_call>{raw}</tool_call>",
                weight_version=0,
                tool_calls=[call],
                observation_ids=[8, 9],
                observation_text=call.result or call.error or "",
            )
        )
    steps.append(
        Step(
            action_ids=[1, 2],
            action_logprobs=[-1.0, -1.0],
            action_text=answer,
            weight_version=0,
            is_final=True,
        )
    )
    return Trajectory(
        env=env.name,
        task_id=task["id"],
        task=task,
        group_id=task["id"],
        prompt_ids=[0],
        prompt_text="",
        steps=steps,
    )


def test_calculator_group_credit() -> None:
    env = CalculatorEnv()
    task = CalculatorEnv.generate_tasks(1, seed=3)[0]
    good = run_episode(
        env, task, [("calculator", {"expression": task["expression"]})], f"The answer is {task['answer']}."
    )
    wrong_call = run_episode(env, task, [("calculator", {"expression": "1 + 1"})], "The answer is 2.")
    bad_args = run_episode(env, task, [("calculator", {"expr": task["expression"]})], "The answer is 0.")
    trajs = [good, wrong_call, bad_args]
    score_trajectories(trajs, env)
    assert [t.outcome_reward for t in trajs] == [1.0, 0.0, 0.0]
    assert good.steps[0].process_rewards == {
        "format": 1.0,
        "tool_valid": 1.0,
        "tool_ok": 1.0,
        "call_matches_task": 1.0,
    }
    assert good.steps[1].process_rewards == {"answer_matches_tool": 1.0}
    assert wrong_call.steps[0].process_rewards["call_matches_task"] == 0.0
    assert wrong_call.steps[1].process_rewards == {"answer_matches_tool": 1.0}  # consistent, but wrong
    assert bad_args.steps[0].process_rewards["tool_valid"] == 0.0
    batch = compute_advantages(trajs, 0.5)
    a = batch.outcome_advantages
    assert a[0] > 0 > a[1] and a[1] == a[2]
    # the process part ranks the failed attempts: the wrong-but-consistent call beats the invalid one
    assert batch.process_advantages[1][0] > batch.process_advantages[2][0]


def test_long_horizon_chain_following() -> None:
    env = LongHorizonEnv()
    task = LongHorizonEnv.generate_tasks(1, seed=1, chain_length=3, num_boxes=10)[0]
    chain = task["chain"]
    follows = run_episode(
        env, task, [("open_box", {"box": b}) for b in chain], f"The answer is {task['answer']}."
    )
    wanders = run_episode(
        env,
        task,
        [("open_box", {"box": chain[0]}), ("open_box", {"box": (chain[1] + 1) % 10})],
        "The answer is x.",
    )
    score_trajectories([follows, wanders], env)
    assert follows.outcome_reward == 1.0 and wanders.outcome_reward == 0.0
    assert [s.process_rewards.get("followed_chain") for s in follows.steps[:3]] == [1.0, 1.0, 1.0]
    assert [s.process_rewards.get("followed_chain") for s in wanders.steps[:2]] == [1.0, 0.0]


def test_tool_chain_scores_each_node_against_the_task() -> None:
    from rollout_workers.environments.tool_chain import ToolChainEnv

    env = ToolChainEnv()
    task = {"id": "t", "question": "Start with 37, then + 5, then * 3. What is the result?", "start": 37,
            "steps": [["+", 5], ["*", 3]], "answer": 126}
    chained = run_episode(env, task, [("calculator", {"expression": "37 + 5"}),
                                      ("calculator", {"expression": "42 * 3"})], "The answer is 126.")
    # the warm start's habit: one call, then restate it (consistent, but the chain is unfinished)
    stops_early = run_episode(env, task, [("calculator", {"expression": "37 + 5"})], "The answer is 42.")
    # second call ignores the first result (uses the start value again)
    restarts = run_episode(env, task, [("calculator", {"expression": "37 + 5"}),
                                       ("calculator", {"expression": "37 * 3"})], "The answer is 111.")
    malformed = run_episode(env, task, [("calculator", {"expression": "(37 + 5) * 3"})], "The answer is 126.")
    trajs = [chained, stops_early, restarts, malformed]
    score_trajectories(trajs, env)
    assert [t.outcome_reward for t in trajs] == [1.0, 0.0, 0.0, 1.0]
    nodes = [[s.process_rewards for s in t.steps] for t in trajs]
    assert nodes[0] == [
        {"format": 1.0, "tool_valid": 1.0, "tool_ok": 1.0, "call_is_one_step": 1.0, "call_uses_intermediate": 1.0},
        {"format": 1.0, "tool_valid": 1.0, "tool_ok": 1.0, "call_is_one_step": 1.0, "call_uses_intermediate": 1.0},
        {"answer_restates_result": 1.0},
    ]
    assert nodes[1][0]["call_uses_intermediate"] == 1.0 and nodes[1][1] == {"answer_restates_result": 1.0}
    assert nodes[2][1]["call_is_one_step"] == 1.0 and nodes[2][1]["call_uses_intermediate"] == 0.0
    assert nodes[2][2] == {"answer_restates_result": 1.0}
    # a refused call earns no call component, and an answer with no tool result behind it restates nothing
    assert nodes[3][0]["tool_ok"] == 0.0 and nodes[3][0]["call_is_one_step"] == 0.0
    assert nodes[3][0]["call_uses_intermediate"] == 0.0 and nodes[3][1] == {"answer_restates_result": 0.0}
