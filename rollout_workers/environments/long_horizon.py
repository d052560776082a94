"""Long horizon: follow a chain of boxes; the answer is every letter found along the way, in order.

Each `open_box` result names one letter and the next box, so the final answer needs facts returned by
tools many turns earlier. `filler_words` pads every result to stretch the context.
"""

from __future__ import annotations

import random
import re
import string
from typing import TYPE_CHECKING, Any

from pydantic import Field, model_validator

from rollout_workers.environments.base import (
    Environment,
    EnvironmentOptions,
    ToolError,
    extract_answer,
    final_answer_text,
    task_messages,
    tool,
    tool_call_message,
)

if TYPE_CHECKING:
    from rollout_workers.trajectory import Trajectory

_NEXT = re.compile(r"Next: box (\d+)")
_LETTER = re.compile(r"holds the letter ([a-z])")
_FILLER = "the dusty shelves hold old maps jars of ink and a quiet clock that ticks".split()


class LongHorizonOptions(EnvironmentOptions):
    filler_words: int = Field(0, ge=0, le=4096, description="Words of padding in every tool result.")
    chain_length: int = Field(4, ge=1, le=256, description="Boxes to follow.")
    num_boxes: int = Field(20, ge=1, le=4096)

    @model_validator(mode="after")
    def _chain_fits(self) -> LongHorizonOptions:
        if self.chain_length > self.num_boxes:
            raise ValueError("chain_length: must be between 1 and num_boxes")
        return self


class LongHorizonEnv(Environment):
    name = "long_horizon"
    cooperative = True
    Options = LongHorizonOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.filler_words: int = self.Options.model_validate(options).filler_words  # type: ignore[attr-defined]

    def tools(self) -> list[dict[str, Any]]:
        return [tool("open_box", "Open a numbered box; it holds a letter and names the next box.",
                     {"box": {"type": "integer", "minimum": 0}})]

    async def call(self, tool: str, args: dict[str, Any]) -> str:
        if tool != "open_box":
            raise ToolError(f"unknown tool {tool!r}")
        return self.describe(self.task, int(args["box"]))

    def describe(self, task: dict[str, Any], box: int) -> str:
        if not 0 <= box < task["num_boxes"]:
            raise ToolError(f"there is no box {box}; boxes are numbered 0 to {task['num_boxes'] - 1}")
        filler = ""
        if self.filler_words:
            rng = random.Random(f"{task['id']}-{box}")
            filler = " " + " ".join(rng.choice(_FILLER) for _ in range(self.filler_words)) + "."
        chain = task["chain"]
        if box not in chain:
            return f"Box {box} is empty.{filler}"
        i = chain.index(box)
        where = f"Next: box {chain[i + 1]}." if i + 1 < len(chain) else "This is the last box."
        return f"Box {box} holds the letter {task['letters'][i]}. {where}{filler}"

    def outcome(self, trajectory: Trajectory) -> float:
        answer = extract_answer(final_answer_text(trajectory))
        return float(answer is not None and answer.replace(" ", "").lower() == trajectory.task["answer"])

    def process(self, trajectory: Trajectory, step_index: int) -> dict[str, float]:
        """Step consistency: each opened box is the one the previous result pointed to; the final answer
        is the letters the tools returned."""
        step = trajectory.steps[step_index]
        if step.is_final:
            seen = "".join(
                m.group(1)
                for s in trajectory.steps[:step_index]
                for c in s.tool_calls
                if (m := _LETTER.search(c.result or ""))
            )
            answer = extract_answer(step.action_text)
            return {"answer_matches_letters_seen": float(answer is not None and answer.replace(" ", "").lower() == seen)}
        if not step.tool_calls:
            return {}
        expected: int | None = trajectory.task["chain"][0]
        for s in trajectory.steps[:step_index]:
            for c in s.tool_calls:
                m = _NEXT.search(c.result or "")
                if m:
                    expected = int(m.group(1))
                elif c.result and "last box" in c.result:
                    expected = None
        got = (step.tool_calls[0].arguments or {}).get("box")
        return {"followed_chain": float(expected is not None and got == expected)}

    @classmethod
    def generate_tasks(cls, n: int, seed: int, **options: Any) -> list[dict[str, Any]]:
        o: Any = cls.Options.model_validate(options)
        chain_length, num_boxes = o.chain_length, o.num_boxes
        rng = random.Random(seed)
        tasks = []
        for i in range(n):
            chain = rng.sample(range(num_boxes), chain_length)
            letters = [rng.choice(string.ascii_lowercase) for _ in chain]
            tasks.append(
                {
                    "id": f"long_horizon-{seed}-{i}",
                    "question": (
                        f"Start at box {chain[0]} and follow the boxes until the last one. "
                        "What letters did you find, in order?"
                    ),
                    "num_boxes": num_boxes,
                    "chain": chain,
                    "letters": letters,
                    "answer": "".join(letters),
                }
            )
        return tasks

    def demonstration(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = task_messages(task)
        for box in task["chain"]:
            messages.append(tool_call_message("open_box", {"box": box}))
            messages.append({"role": "tool", "content": self.describe(task, box)})
        messages.append({"role": "assistant", "content": f"The answer is {task['answer']}."})
        return messages

