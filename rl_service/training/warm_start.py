"""Warm starts, in one home: a job's (`warm_start` in the spec: supervised fine-tuning on demonstrations, the
environment's or an uploaded file's in OpenAI's chat format, before RL step 0, in place on the job's model; a
supervised job is this alone; `run_warm_start`) and the same phases outside any job, on a fresh tiny model saved
as a checkpoint (`warm_started_model`, which the benchmarks share across runs). The SFT loop itself is
`sft.train_sft` (TRL's SFTTrainer)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from rl_service.spec import WarmStartSpec
from rl_service.task_files import load_demonstrations, task_of
from rl_service.training.sft import encode_conversation, train_sft

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


@dataclass
class Demonstration:
    """One conversation to learn from, the task it solves (for the mixed phase's direct answers) and, for a
    file's line that declares them, its own tools (function descriptions)."""

    messages: list[dict[str, Any]]
    task: dict[str, Any]
    tools: list[dict[str, Any]] | None = None


def environment_demonstrations(env: Any, tasks: list[dict[str, Any]]) -> list[Demonstration]:
    return [Demonstration(env.demonstration(t), t) for t in tasks]


def file_demonstrations(path: str, env_tools: list[dict[str, Any]]) -> list[Demonstration]:
    """An uploaded file's demonstrations. A line without `tools` uses the environment's; every tool call must
    name one of the tools offered (a model taught to call a tool the environment lacks learns nothing useful)."""
    out = []
    for line in load_demonstrations(path):
        tools = [t["function"] for t in line["tools"]] if line.get("tools") else None
        names = {t.get("name") for t in (tools if tools is not None else env_tools)}
        for m in line["messages"]:
            for call in m.get("tool_calls", []):
                if call["function"]["name"] not in names:
                    raise ValueError(f"warm_start.demonstrations: line {line['id']!r} calls tool "
                                     f"{call['function']['name']!r}, which is not among its tools {sorted(names)}")
        out.append(Demonstration(line["messages"], task_of(line), tools))
    return out


def mean_assistant_tokens(tokenizer: Any, demonstrations: list[Demonstration]) -> float:
    """The mean number of assistant tokens (what the loss trains on) of a sample of the demonstrations."""
    sample = demonstrations[:64]
    counts = [sum(encode_conversation(tokenizer, d.messages, d.tools)[1]) for d in sample]
    return sum(counts) / max(len(counts), 1)


def run_warm_start(model: nn.Module, tokenizer: Any, demonstrations: list[Demonstration], tools: list[dict[str, Any]],
                   spec: WarmStartSpec, seed: int,
                   on_step: Callable[[str, int, float], None] | None = None) -> WarmStartResult:
    """Fine-tune `model` on `demonstrations` (then, with `mixed_phase`, on a mix where only part of them use
    tools), rendered with `tools` unless a demonstration has its own. `on_step(phase, step, loss)` is called
    after every optimizer step."""
    start = time.perf_counter()
    gold = [d.messages for d in demonstrations]
    tasks = [d.task for d in demonstrations]
    own = [d.tools for d in demonstrations]
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
        train_sft(model, tokenizer, conversations, steps=steps, lr=lr, batch_size=spec.batch_size, seed=seed + len(losses),
                  tools=tools, tools_of=own, stop_at_loss=stop_at, on_step=lambda loss, phase=phase: step_done(phase, loss))
    tail = losses[-10:]
    return WarmStartResult(steps=len(losses), final_loss=sum(tail) / len(tail), seconds=time.perf_counter() - start,
                           examples=len(demonstrations))


def warm_started_model(env_name: str, out: Path, *, steps: int, examples: int, seed: int,
                       target_loss: float | None = None, mixed_steps: int = 0, tool_use_fraction: float = 1.0,
                       task_options: dict[str, Any] | None = None,
                       on_step: Callable[[str, int, float], None] | None = None) -> list[float]:
    """A fresh tiny model warm-started on `env_name`'s demonstrations outside any job (the phases a job's
    `warm_start` runs), saved with its tokenizer to `out`. Returns every step's loss."""
    import torch

    from model.config import TaperConfig
    from model.modeling import TaperForCausalLM
    from model.tokenizer import load_tokenizer
    from rollout_workers.environments.registry import generate_tasks, make_env_factory

    torch.manual_seed(seed)
    tokenizer = load_tokenizer()
    model = TaperForCausalLM(TaperConfig.preset("tiny", vocab_size=len(tokenizer)))
    spec = WarmStartSpec(num_examples=examples, max_steps=steps, until_loss=target_loss, mixed_phase=(
        {"steps": mixed_steps, "tool_use_fraction": tool_use_fraction} if mixed_steps else None))
    tasks = generate_tasks(env_name, examples, seed=seed + WARM_START_SEED_OFFSET, options=task_options)
    losses: list[float] = []

    def step_done(phase: str, step: int, loss: float) -> None:
        losses.append(loss)
        if on_step is not None:
            on_step(phase, step, loss)

    env = make_env_factory(env_name)()
    run_warm_start(model, tokenizer, environment_demonstrations(env, tasks), env.tools(), spec, seed, step_done)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return losses
