"""The guide's two example environments (examples/unit_convert as a Python package, examples/unit_convert_http
as a tool server) judge the same episodes the same way, through the real agent loop and the real HTTP protocol
(/reset, /call, /outcome, /process, /demonstration, /tasks)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from scripted_engine import ScriptedEngine

from rollout_workers.agent import AgentLoop, EpisodeSpec, run_groups
from rollout_workers.chat import tool_call_text
from rollout_workers.environments import EnvironmentRegistration, make_env_factory, validate_registration
from rollout_workers.environments.policy import EnvironmentPolicy
from rollout_workers.environments.registry import check_reachable
from rollout_workers.sampling import SamplingConfig
from rollout_workers.trajectory import TrajectoryStatus

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LOCAL = EnvironmentPolicy(http_allow=("127.0.0.1",))
_QUESTION = re.compile(r"How many (\w+) are in (\d+) (\w+)\?")
_RESULT = re.compile(r"<tool_response>\s*(-?\d+)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, str(EXAMPLES / "unit_convert_http" / "server.py"), "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(url, timeout=1)
            break
        except httpx.TransportError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("the example tool server did not start") from None
            time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def python_env() -> Any:
    sys.path.insert(0, str(EXAMPLES / "unit_convert"))
    try:
        from taper_unit_convert import UnitConvertEnv
    finally:
        sys.path.remove(str(EXAMPLES / "unit_convert"))
    return UnitConvertEnv


def _registration(url: str) -> EnvironmentRegistration:
    data = yaml.safe_load((EXAMPLES / "unit_convert_http" / "register.yaml").read_text())
    return validate_registration({**data, "base_url": url}, LOCAL)


def _script(wrong_units: set[int]) -> Any:
    """Episode i converts as asked, or (i in wrong_units) with swapped units; then restates the tool result."""

    def script(ctx: str, turn: int) -> str:
        to_unit, value, from_unit = _QUESTION.search(ctx).groups()  # type: ignore[union-attr]
        if turn == 0:
            episode = int(re.search(r"episode (\d+)", ctx).group(1))  # type: ignore[union-attr]
            if episode in wrong_units:
                from_unit, to_unit = to_unit, from_unit
            return tool_call_text("convert", {"value": int(value), "from_unit": from_unit, "to_unit": to_unit})
        results = _RESULT.findall(ctx)
        return f"The answer is {results[-1] if results else 0}."

    return script


def _run(tokenizer: Any, factory: Any, tasks: list[dict[str, Any]], wrong_units: set[int]) -> list[Any]:
    engine = ScriptedEngine(tokenizer, _script(wrong_units))
    loop = AgentLoop(engine, factory, SamplingConfig(tool_timeout_s=5.0, max_total_tokens=2048), env_name="unit")
    specs = [EpisodeSpec(task={**t, "question": f"{t['question']} (episode {i})"}, group_id=f"g{i}")
             for i, t in enumerate(tasks)]
    try:
        return [g[0] for g in run_groups(loop, [[s] for s in specs])]
    finally:
        loop.close()
        engine.close()


def test_python_and_http_examples_agree_on_tasks_rewards_and_demonstrations(
        tokenizer: Any, server_url: str, python_env: Any) -> None:
    reg = _registration(server_url)
    check_reachable(reg, LOCAL)
    http_factory = make_env_factory(reg, policy=LOCAL)
    http_cls = type(http_factory())
    tasks = http_cls.generate_tasks(6, seed=3)
    assert tasks == python_env.generate_tasks(6, seed=3)

    trajectories = _run(tokenizer, http_factory, tasks, wrong_units={1, 4})
    assert all(t.status == TrajectoryStatus.OK for t in trajectories)
    local, remote = python_env(), http_factory()
    for i, traj in enumerate(trajectories):
        right = i not in {1, 4}
        assert remote.outcome(traj) == local.outcome(traj) == float(right)
        steps = remote.process_steps(traj)
        assert steps == local.process_steps(traj)
        assert steps[0] == {"call_matches_task": float(right)}
        got_result = traj.steps[0].tool_calls[0].result is not None  # swapped units: mostly a tool error
        assert steps[-1] == {"answer_matches_tool": float(got_result)}  # restating the result, right or not
        assert got_result or not right

    for task in tasks[:2]:
        assert remote.demonstration(task) == local.demonstration(task)


def test_an_http_server_that_does_not_answer_is_named_at_registration(server_url: str) -> None:
    closed = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(ValueError, match=r"^base_url: http://127\.0\.0\.1:\d+ does not answer"):
        check_reachable(_registration(closed), LOCAL)
    with pytest.raises(ValueError, match="^base_url: target refused"):
        check_reachable(_registration(server_url), EnvironmentPolicy())  # loopback without the operator's allow


def test_process_answers_are_checked(server_url: str) -> None:
    from rollout_workers.environments.http_env import _process_answer

    assert _process_answer({"steps": [{"a": 2.0}, {"b": -1}]}, 2) == [{"a": 1.0}, {"b": 0.0}]
    for bad in ({"steps": [{}]}, {"steps": [{"a": "x"}, {}]}, {"steps": [{"a": True}, {}]}, {}):
        with pytest.raises(RuntimeError, match="/process"):
            _process_answer(bad, 2)
