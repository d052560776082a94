"""A job's warm start (`warm_start` in the spec): supervised fine-tuning on the environment's demonstrations,
before RL step 0, in place on the driver's model."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from rl_service.spec import WarmStartSpec
from rl_service.training.sft import warm_start as sft

# The warm start's tasks come from another seed than the job's training and held-out tasks.
WARM_START_SEED_OFFSET = 10_000


@dataclass
class WarmStartResult:
    steps: int
    final_loss: float
    seconds: float
    examples: int

    def metrics(self) -> dict[str, float]:
        return {"warm_start/steps": float(self.steps), "warm_start/loss": self.final_loss,
                "warm_start/seconds": self.seconds, "warm_start/examples": float(self.examples)}


def answer_without_tools(task: dict[str, Any], demonstration: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The demonstration's opening, then the task's answer stated directly (no tool call)."""
    if "answer" not in task:
        raise ValueError("warm_start.mixed_phase: the environment's tasks have no 'answer' to state without tools")
    opening = [m for m in demonstration if m.get("role") != "assistant"][:1]
    return [*opening, {"role": "assistant", "content": f"The answer is {task['answer']}."}]


def run_warm_start(model: nn.Module, tokenizer: Any, env: Any, tasks: list[dict[str, Any]], spec: WarmStartSpec,
                   seed: int, on_step: Callable[[str, int, float], None] | None = None) -> WarmStartResult:
    """Fine-tune `model` on demonstrations of `tasks` (then, with `mixed_phase`, on a mix where only part of
    them use tools). `on_step(phase, step, loss)` is called after every optimizer step."""
    start = time.perf_counter()
    gold = [env.demonstration(t) for t in tasks]
    phases = [("demonstrations", gold, spec.max_steps, spec.learning_rate, spec.until_loss)]
    if spec.mixed_phase is not None:
        pick = random.Random(seed)
        mixed = [g if pick.random() < spec.mixed_phase.tool_use_fraction else answer_without_tools(t, g)
                 for g, t in zip(gold, tasks, strict=True)]
        phases.append(("mixed", mixed, spec.mixed_phase.steps, spec.mixed_phase.learning_rate, None))
    losses: list[float] = []

    def step_done(phase: str, loss: float) -> None:
        if on_step is not None:
            on_step(phase, len(losses) + 1, loss)
        losses.append(loss)

    for phase, conversations, steps, lr, stop_at in phases:
        sft(model, tokenizer, conversations, steps=steps, lr=lr, batch_size=spec.batch_size, seed=seed + len(losses),
            tools=env.tools(), stop_at_loss=stop_at, on_step=lambda loss, phase=phase: step_done(phase, loss))
    tail = losses[-10:]
    return WarmStartResult(steps=len(losses), final_loss=sum(tail) / len(tail), seconds=time.perf_counter() - start,
                           examples=len(tasks))
