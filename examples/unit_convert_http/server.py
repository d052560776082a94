"""The guide's complete HTTP tool server (docs/http-protocol.md): unit conversion over Taper's protocol.

Self-contained (FastAPI only, nothing from Taper): run it with
    python examples/unit_convert_http/server.py --port 8701
and register it with `taper env register examples/unit_convert_http/register.yaml`.
"""

from __future__ import annotations

import argparse
import random
import re
from typing import Any

import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel

UNITS: dict[str, tuple[str, int]] = {
    "mm": ("length", 1), "cm": ("length", 10), "m": ("length", 1000), "km": ("length", 1_000_000),
    "g": ("mass", 1), "kg": ("mass", 1000),
    "s": ("time", 1), "min": ("time", 60), "h": ("time", 3600),
}
PAIRS = [("km", "m"), ("m", "cm"), ("m", "mm"), ("cm", "mm"), ("kg", "g"), ("h", "min"), ("min", "s")]
ANSWER = re.compile(r"answer\s*(?:is|:)\s*(-?\d+)", re.IGNORECASE)

app = FastAPI(title="unit-convert tool server")


class CallRequest(BaseModel):
    session: str | None = None
    tool: str
    arguments: dict[str, Any]


class TasksRequest(BaseModel):
    n: int
    seed: int
    options: dict[str, Any] = {}


class TaskRequest(BaseModel):
    task: dict[str, Any]


class OutcomeRequest(BaseModel):
    session: str | None = None
    task: dict[str, Any]
    final_answer: str | None = None
    trajectory: dict[str, Any]


class ProcessRequest(BaseModel):
    session: str | None = None
    task: dict[str, Any]
    trajectory: dict[str, Any]


def convert(value: int, from_unit: str, to_unit: str) -> int:
    for unit in (from_unit, to_unit):
        if unit not in UNITS:
            raise ValueError(f"unknown unit {unit!r}; known: {', '.join(UNITS)}")
    (q_from, f_from), (q_to, f_to) = UNITS[from_unit], UNITS[to_unit]
    if q_from != q_to:
        raise ValueError(f"cannot convert {q_from} ({from_unit}) to {q_to} ({to_unit})")
    if (value * f_from) % f_to:
        raise ValueError(f"{value} {from_unit} is not a whole number of {to_unit}")
    return value * f_from // f_to


@app.post("/call")
def call(req: CallRequest) -> dict[str, Any]:
    """A tool call: {"result"} or {"error"} (the error is shown to the model as the tool's answer)."""
    if req.tool != "convert":
        return {"error": f"unknown tool {req.tool!r}"}
    try:
        a = req.arguments
        return {"result": str(convert(int(a["value"]), str(a["from_unit"]), str(a["to_unit"])))}
    except (KeyError, TypeError, ValueError) as e:
        return {"error": str(e)}


@app.post("/tasks")
def tasks(req: TasksRequest) -> dict[str, Any]:
    rng = random.Random(req.seed)
    max_value = int(req.options.get("max_value", 99))
    out = []
    for i in range(req.n):
        from_unit, to_unit = rng.choice(PAIRS)
        value = rng.randint(1, max_value)
        out.append({"id": f"unit_convert-{req.seed}-{i}", "question": f"How many {to_unit} are in {value} {from_unit}?",
                    "value": value, "from_unit": from_unit, "to_unit": to_unit,
                    "answer": convert(value, from_unit, to_unit)})
    return {"tasks": out}


@app.post("/reset")
def reset(req: TaskRequest) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": req.task["question"]}], "session": None}


@app.post("/outcome")
def outcome(req: OutcomeRequest) -> dict[str, float]:
    ok = req.final_answer is not None and req.final_answer.strip().rstrip(".") == str(req.task["answer"])
    return {"reward": float(ok)}


@app.post("/process")
def process(req: ProcessRequest) -> dict[str, Any]:
    """One object per step: a call with the task's arguments; a final answer restating the last result."""
    wanted = {"value": req.task["value"], "from_unit": req.task["from_unit"], "to_unit": req.task["to_unit"]}
    steps, last_result = [], None
    for step in req.trajectory["steps"]:
        calls = step.get("tool_calls") or []
        if calls:
            steps.append({"call_matches_task": float(any(c.get("arguments") == wanted for c in calls))})
            last_result = next((c["result"] for c in reversed(calls) if c.get("result") is not None), last_result)
        elif step.get("is_final"):
            stated = ANSWER.search(step.get("action_text") or "")
            steps.append({"answer_matches_tool": float(stated is not None and stated.group(1) == last_result)})
        else:
            steps.append({})
    return {"steps": steps}


@app.post("/demonstration")
def demonstration(req: TaskRequest) -> dict[str, Any]:
    t = req.task
    args = {"value": t["value"], "from_unit": t["from_unit"], "to_unit": t["to_unit"]}
    result = convert(**args)
    return {"messages": [
        {"role": "user", "content": t["question"]},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "convert", "arguments": args}}]},
        {"role": "tool", "content": str(result)},
        {"role": "assistant", "content": f"The answer is {result}."},
    ]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8701)
    args = parser.parse_args()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
