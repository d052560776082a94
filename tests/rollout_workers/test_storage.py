from __future__ import annotations

from pathlib import Path

import pytest

from rollout_workers.storage import TrajectoryWriter, read_trajectories, render_text, step_file
from rollout_workers.trajectory import Step, ToolCall, Trajectory, TrajectoryStatus


def make(i: int, status: TrajectoryStatus = TrajectoryStatus.OK, reward: float | None = 1.0, step: int = 0) -> Trajectory:
    return Trajectory(
        env="calculator", task_id=f"t{i}", task={"id": f"t{i}", "answer": 3}, group_id=f"g{i // 2}",
        prompt_ids=[1, 2, 3], prompt_text="<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n",
        steps=[
            Step(action_ids=[7, 8], action_logprobs=[-0.1, -0.2], action_text='<tool_call>{"name": "calculator"}</tool_call>',
                 weight_version=2, observation_ids=[9], observation_text="\n<tool_response>3</tool_response>",
                 tool_calls=[ToolCall(raw="{}", name="calculator", arguments={"expression": "1 + 2"}, result="3", latency_s=0.002)],
                 process_rewards={"format": 1.0}),
            Step(action_ids=[10], action_logprobs=[-0.3], action_text="The answer is 3.", weight_version=3, is_final=True),
        ],
        status=status, outcome_reward=reward, train_step=step,
    )


def test_round_trip_filters_and_paging(tmp_path: Path) -> None:
    trajs = [make(i, step=0) for i in range(4)] + [make(4, TrajectoryStatus.TOOL_TIMEOUT, None, 1), make(5, reward=0.0, step=1)]
    with TrajectoryWriter(step_file(tmp_path, 0)) as w:
        assert w.write(trajs[:4]) == 4
    with TrajectoryWriter(step_file(tmp_path, 1)) as w:
        w.write(trajs[4])
        w.write(trajs[5])
    back = read_trajectories(tmp_path, limit=100)
    assert back == trajs  # the same objects, field for field
    assert back[0].completion_ids() == [7, 8, 9, 10] and back[0].loss_mask() == [1, 1, 0, 1]
    assert [t.task_id for t in read_trajectories(tmp_path, status="tool_timeout")] == ["t4"]
    assert [t.task_id for t in read_trajectories(tmp_path, max_reward=0.5)] == ["t5"]
    assert len(read_trajectories(tmp_path, min_reward=0.5)) == 4
    assert [t.task_id for t in read_trajectories(tmp_path, step=1)] == ["t4", "t5"]
    assert [t.task_id for t in read_trajectories(tmp_path, offset=1, limit=2)] == ["t1", "t2"]
    with pytest.raises(ValueError, match="offset"):
        read_trajectories(tmp_path, offset=-1)
    assert read_trajectories(tmp_path / "missing") == []


def test_appends_and_a_partial_last_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "job.jsonl"
    with TrajectoryWriter(path) as w:
        w.write(make(0))
    with TrajectoryWriter(path) as w:  # reopening appends
        w.write(make(1))
    with open(path, "a") as f:
        f.write(make(2).model_dump_json()[:50])  # a crash mid-append
    assert [t.task_id for t in read_trajectories(path)] == ["t0", "t1"]


def test_render_text_marks_policy_and_tool_spans() -> None:
    text = render_text(make(0))
    assert "[[policy]]<tool_call>" in text
    assert '[[tool 2.0 ms]] calculator({"expression": "1 + 2"}) -> 3' in text
    assert "[[inserted 1 tokens]]" in text and "policy v3" in text and "FINAL" in text and "format=1.00" in text
