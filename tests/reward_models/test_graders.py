"""Graders against hand-computed cases (the RFT grader semantics they mirror), and the declared process
components. The python grader runs in the real sandbox; the http grader talks to a real local server."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from reward_models.graders import GradeContext, GraderError, grade_trajectory, parse_grader, parse_process
from reward_models.graders.formula import FormulaError, evaluate, parse_formula
from reward_models.graders.process import score_declared
from reward_models.graders.template import render, sample_of
from rollout_workers.net_guard import AllowList
from rollout_workers.trajectory import Step, ToolCall, Trajectory


def traj(final: str, task: dict[str, Any], calls: list[ToolCall] | None = None) -> Trajectory:
    steps = []
    if calls:
        steps.append(Step(action_ids=[1], action_logprobs=[0.0], action_text="<tool_call>", weight_version=0,
                          tool_calls=calls))
    steps.append(Step(action_ids=[2], action_logprobs=[0.0], action_text=final + "<|im_end|>", weight_version=0,
                      is_final=True))
    return Trajectory(env="e", task_id="t", task=task, group_id="g", prompt_ids=[0], prompt_text="", steps=steps)


def score(spec: dict[str, Any], final: str, task: dict[str, Any], ctx: GradeContext | None = None) -> float:
    return grade_trajectory(parse_grader(spec), traj(final, task), ctx)


def test_templates_render_item_and_sample_fields() -> None:
    t = traj("The answer is 42.", {"answer": 42, "meta": {"city": "Oslo"}, "tags": ["a", "b"]})
    sample = sample_of(t)
    assert sample["output_text"] == "The answer is 42."
    assert sample["answer"] == "42"
    assert render("{{item.answer}}|{{ sample.answer }}|{{item.meta.city}}|{{item.tags.1}}|{{item.nope}}",
                  t.task, sample) == "42|42|Oslo|b|"
    assert render("{{item.meta}}", t.task, sample) == '{"city": "Oslo"}'


@pytest.mark.parametrize(("operation", "final", "expected"), [
    ("eq", "Paris", 1.0), ("eq", "paris", 0.0), ("ne", "paris", 1.0), ("ne", "Paris", 0.0),
    ("like", "It is Paris, France", 1.0), ("like", "it is paris", 0.0),
    ("ilike", "it is PARIS", 1.0), ("ilike", "London", 0.0),
])
def test_string_check_operations(operation: str, final: str, expected: float) -> None:
    spec = {"type": "string_check", "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
            "operation": operation}
    assert score(spec, final, {"answer": "Paris"}) == expected


def test_string_check_on_the_stated_answer() -> None:
    spec = {"type": "string_check", "input": "{{sample.answer}}", "reference": "{{item.answer}}"}
    assert score(spec, "The answer is 17.", {"answer": 17}) == 1.0
    assert score(spec, "The answer is 18.", {"answer": 17}) == 0.0


def test_text_similarity_hand_computed() -> None:
    fuzzy = {"type": "text_similarity", "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
             "evaluation_metric": "fuzzy_match"}
    assert score(fuzzy, "abcd", {"answer": "abce"}) == pytest.approx(0.75)  # 2 * 3 matches / 8 chars
    rouge = {**fuzzy, "evaluation_metric": "rouge_1"}
    assert score(rouge, "the cat sat", {"answer": "the cat ran"}) == pytest.approx(2 / 3)


@pytest.mark.parametrize(("final", "tolerance", "relative", "expected"), [
    ("The answer is 3.14159.", 0.01, 0.0, 1.0), ("The answer is 3.2.", 0.01, 0.0, 0.0),
    ("The answer is 1,000.", 0.0, 0.0, 1.0), ("The answer is 1,040.", 0.0, 0.05, 1.0),
    ("The answer is 1,060.", 0.0, 0.05, 0.0), ("The answer is many.", 1e6, 0.0, 0.0),
])
def test_numeric_tolerance(final: str, tolerance: float, relative: float, expected: float) -> None:
    spec = {"type": "numeric", "input": "{{sample.answer}}", "reference": "{{item.answer}}",
            "tolerance": tolerance, "relative_tolerance": relative}
    answer = 3.1416 if "3." in final else 1000
    assert score(spec, final, {"answer": answer}) == expected


def test_numeric_reference_that_is_not_a_number_is_a_grader_error() -> None:
    spec = {"type": "numeric", "input": "{{sample.answer}}", "reference": "{{item.answer}}"}
    with pytest.raises(GraderError, match="reference is not a number"):
        score(spec, "The answer is 3.", {"answer": "three"})


def test_regex_modes_and_bad_patterns() -> None:
    spec = {"type": "regex", "input": "{{sample.output_text}}", "pattern": r"\b\d{4}-\d{2}-\d{2}\b"}
    assert score(spec, "born on 1990-01-02, I think", {}) == 1.0
    assert score({**spec, "mode": "fullmatch"}, "born on 1990-01-02", {}) == 0.0
    assert score({**spec, "mode": "fullmatch"}, "1990-01-02", {}) == 1.0
    assert score({**spec, "pattern": "paris", "ignore_case": True}, "PARIS", {}) == 1.0
    assert score({**spec, "pattern": "paris"}, "PARIS", {}) == 0.0
    with pytest.raises(ValueError, match="grader.regex.pattern: not a valid regular expression"):
        parse_grader({**spec, "pattern": "(unclosed"})


def test_json_match_scores_the_share_of_fields() -> None:
    spec = {"type": "json_match", "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
            "fields": ["city", "temp.unit", "temp.value"]}
    task = {"answer": {"city": "Oslo", "temp": {"unit": "C", "value": 4}}}
    assert score(spec, json.dumps({"city": "Oslo", "temp": {"unit": "C", "value": 5}}), task) == pytest.approx(2 / 3)
    assert score(spec, json.dumps({"city": "Oslo", "temp": {"unit": "C", "value": 4}}), task) == 1.0
    assert score(spec, "not json", task) == 0.0
    with pytest.raises(GraderError, match="reference is not a JSON object"):
        score(spec, "{}", {"answer": "Oslo"})


def test_multi_weighted_formula() -> None:
    spec = {"type": "multi", "calculate_output": "0.7 * correct + 0.3 * polite",
            "graders": {"correct": {"type": "string_check", "input": "{{sample.answer}}", "reference": "{{item.answer}}"},
                        "polite": {"type": "regex", "input": "{{sample.output_text}}", "pattern": "(?i)please"}}}
    assert score(spec, "The answer is 5.", {"answer": 5}) == pytest.approx(0.7)
    assert score(spec, "Please: the answer is 5.", {"answer": 5}) == pytest.approx(1.0)
    assert score(spec, "Please: the answer is 6.", {"answer": 5}) == pytest.approx(0.3)
    # a formula reaching past [0, 1] is clipped into it
    assert score({**spec, "calculate_output": "2 * correct - 1"}, "The answer is 6.", {"answer": 5}) == 0.0


def test_formula_arithmetic_and_what_it_refuses() -> None:
    names = {"a", "b"}
    assert evaluate(parse_formula("max(a, b) ^ 2 / (1 + abs(-1))", names), {"a": 0.5, "b": 0.8}) == pytest.approx(0.32)
    assert evaluate(parse_formula("-a + sqrt(b)", names), {"a": 0.5, "b": 0.25}) == pytest.approx(0.0)
    for bad, why in [("__import__('os')", "only the functions"), ("a.real", "Attribute"),
                     ("a if b else 0", "IfExp"), ("c + 1", "names no grader"), ("a % b", "Mod"),
                     ("(lambda: 1)()", "only the functions"), ("'x'", "not a number"), ("max", "call it"),
                     ("a < b", "Compare")]:
        with pytest.raises(FormulaError, match=why):
            parse_formula(bad, names)
    with pytest.raises(FormulaError, match="no value"):
        evaluate(parse_formula("a / b", names), {"a": 1.0, "b": 0.0})
    with pytest.raises(FormulaError, match="exponent"):
        evaluate(parse_formula("9 ^ 9 ^ 9", names), {})
    with pytest.raises(ValueError, match="calculate_output: 'z' names no grader"):
        parse_grader({"type": "multi", "calculate_output": "z",
                      "graders": {"a": {"type": "string_check", "input": "", "reference": ""}}})


def test_grader_fields_are_declared_and_bounded() -> None:
    with pytest.raises(ValueError, match="grader.string_check.operation"):
        parse_grader({"type": "string_check", "input": "", "reference": "", "operation": "contains"})
    with pytest.raises(ValueError, match="grader.string_check.shell"):
        parse_grader({"type": "string_check", "input": "", "reference": "", "shell": "rm"})
    with pytest.raises(ValueError, match="grader.string_check.input"):
        parse_grader({"type": "string_check", "input": "x" * 5000, "reference": ""})
    with pytest.raises(ValueError, match="grader"):
        parse_grader({"type": "eval", "source": "1"})
    with pytest.raises(ValueError, match="multi.graders.inner"):  # no multi inside a multi
        parse_grader({"type": "multi", "calculate_output": "inner", "graders": {
            "inner": {"type": "multi", "calculate_output": "1", "graders": {}}}})


PYTHON_GRADER = '''
def grade(sample, item):
    return 1.0 if sample["answer"] == str(item["answer"]) else 0.25
'''


def test_python_grader_runs_in_the_sandbox() -> None:
    spec = {"type": "python", "source": PYTHON_GRADER}
    assert score(spec, "The answer is 9.", {"answer": 9}) == 1.0
    assert score(spec, "The answer is 8.", {"answer": 9}) == 0.25
    crashing = {"type": "python", "source": "def grade(sample, item):\n    raise KeyError('boom')\n"}
    with pytest.raises(GraderError, match="KeyError"):
        score(crashing, "x", {})
    host_file = Path(__file__).resolve()
    reader = {"type": "python", "source": f"def grade(sample, item):\n    return len(open({str(host_file)!r}).read())\n"}
    with pytest.raises(GraderError, match="FileNotFoundError"):  # host files are not in the sandbox
        score(reader, "x", {})
    looping = {"type": "python", "source": "def grade(sample, item):\n    while True: pass\n", "wall_seconds": 1.0,
               "cpu_seconds": 1}
    with pytest.raises(GraderError):
        score(looping, "x", {})


@pytest.fixture
def grader_server() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    seen: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server naming
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            reward = 1.0 if body["sample"]["answer"] == str(body["item"]["answer"]) else 0.0
            data = json.dumps({"reward": reward}).encode() if self.path == "/grade" else b""
            self.send_response(200 if self.path == "/grade" else 404)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", seen
    httpd.shutdown()


def test_http_grader_posts_item_and_sample_under_the_target_rules(grader_server: tuple[str, list]) -> None:
    url, seen = grader_server
    spec = {"type": "http", "base_url": url, "retries": 0}
    allowed = GradeContext(allow=AllowList.parse(["127.0.0.1"]))
    assert score(spec, "The answer is 3.", {"answer": 3}, allowed) == 1.0
    assert score(spec, "The answer is 4.", {"answer": 3}, allowed) == 0.0
    assert seen[0]["item"] == {"answer": 3} and seen[0]["sample"]["output_text"] == "The answer is 3."
    with pytest.raises(GraderError, match="loopback"):  # not on the operator's allow-list
        score(spec, "The answer is 3.", {"answer": 3})
    with pytest.raises(GraderError, match="has no /other"):
        score({**spec, "endpoint": "other"}, "x", {"answer": 3}, allowed)
    with pytest.raises(ValueError, match="grader.http.base_url"):
        parse_grader({"type": "http", "base_url": "file:///etc/passwd"})


def test_declared_process_components() -> None:
    specs = parse_process([
        {"kind": "tool_called", "name": "used_weather", "tool": "weather"},
        {"kind": "tool_args_match", "name": "right_city", "tool": "weather", "arguments": {"city": "{{item.city}}"}},
        {"kind": "tool_args_match", "name": "city_like", "tool": "weather", "arguments": {"city": "{{item.city}}",
                                                                                           "unit": "C"},
         "operation": "ilike"},
    ])
    calls = [ToolCall(raw="", name="weather", arguments={"city": "oslo, norway", "unit": "C"}, result="4")]
    t = traj("The answer is 4.", {"city": "Oslo"}, calls)
    assert score_declared(specs, t, 0) == {"used_weather": 1.0, "right_city": 0.0, "city_like": 1.0}
    assert score_declared(specs, t, 1) == {}  # the final answer makes no call: the components do not apply
    other = traj("x", {"city": "Oslo"}, [ToolCall(raw="", name="search", arguments={"q": "Oslo"}, result="r")])
    assert score_declared(specs, other, 0) == {"used_weather": 0.0}
    exact = traj("x", {"city": "Oslo"}, [ToolCall(raw="", name="weather", arguments={"city": "Oslo"}, result="4")])
    assert score_declared(specs, exact, 0) == {"used_weather": 1.0, "right_city": 1.0, "city_like": 0.5}
    with pytest.raises(ValueError, match="names must differ"):
        parse_process([{"kind": "tool_called", "name": "a", "tool": "x"}, {"kind": "tool_called", "name": "a", "tool": "y"}])
    with pytest.raises(ValueError, match=r"process_rewards\.0\.tool_called\.tool"):
        parse_process([{"kind": "tool_called", "name": "a", "tool": "bad name!"}])


def test_scoring_uses_an_environments_declared_grader_and_components() -> None:
    from reward_models.scoring import score_trajectories
    from rollout_workers.environments.registry import EnvironmentRegistration, make_env_factory
    from rollout_workers.trajectory import TrajectoryStatus

    reg = EnvironmentRegistration.model_validate({
        "kind": "python", "name": "calc", "import_path": "rollout_workers.environments.calculator:CalculatorEnv",
        "grader": {"type": "string_check", "input": "{{sample.answer}}", "reference": "{{item.answer}}"},
        "process_rewards": [{"kind": "tool_called", "name": "used_calculator", "tool": "calculator"}]})
    env = make_env_factory(reg)()
    call = ToolCall(raw="", name="calculator", arguments={"expression": "2+2"}, result="4")
    right, wrong = traj("The answer is 4.", {"answer": 4}, [call]), traj("The answer is 5.", {"answer": 4}, [call])
    score_trajectories([right, wrong], env, components=[])
    assert (right.outcome_reward, wrong.outcome_reward) == (1.0, 0.0)
    assert right.steps[0].process_rewards == {"used_calculator": 1.0} and right.steps[1].process_rewards == {}
    # a grader that cannot score marks the trajectory an environment failure (excluded), not a zero
    env.grader_spec = {"type": "numeric", "input": "{{sample.answer}}", "reference": "{{item.missing}}"}
    broken = traj("The answer is 4.", {"answer": 4})
    score_trajectories([broken], env, components=[])
    assert broken.status == TrajectoryStatus.ENV_ERROR and broken.outcome_reward is None
    assert "reference is not a number" in (broken.error or "")
