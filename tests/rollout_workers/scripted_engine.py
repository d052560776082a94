"""A scripted engine for pure-logic loop tests: it "samples" text chosen by a script, one token per
step for every live sequence, behind the real continuous-batching scheduler.

Only for tests of the loop's control flow and of the scheduler (a random model cannot write tool
calls); token-exactness, masks and logprobs are tested on the real vLLM engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rollout_workers.engine import ContinuousBatchingEngine, FinishedTurn, TurnRequest
from rollout_workers.sampling import SamplingConfig

# script(prompt_text_so_far, turn_index) -> the text the "policy" writes (without the end token)
Script = Callable[[str, int], str]


@dataclass
class _Live:
    planned: list[int]
    truncated: bool
    emitted: int = 0


class ScriptedEngine(ContinuousBatchingEngine):
    def __init__(self, tokenizer: Any, script: Script, step_delay_s: float = 0.0) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.script = script
        self.step_delay_s = step_delay_s
        self._live: dict[str, _Live] = {}
        self.step_log: list[list[str]] = []  # the request ids live in every step
        self.weight_log: list[int] = []  # for every weight push: the number of steps run before it
        self.prompts: dict[str, list[int]] = {}  # request id -> prompt ids
        self.versions: dict[str, int] = {}  # request id -> weight version it was added under

    def _add(self, request_id: str, request: TurnRequest, sampling: SamplingConfig, stop_token_ids: list[int]) -> None:
        context = self.tokenizer.decode(request.prompt_ids, skip_special_tokens=False)
        turn = context.count("<|im_start|>assistant\n") - 1
        ids = self.tokenizer.encode(self.script(context, turn), add_special_tokens=False)
        ids.append(self.tokenizer.eos_token_id)
        self._live[request_id] = _Live(ids[: request.max_tokens], truncated=len(ids) > request.max_tokens)
        self.prompts[request_id] = list(request.prompt_ids)
        self.versions[request_id] = self.weight_version

    def _step(self) -> list[FinishedTurn]:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self.step_log.append(list(self._live))
        finished = []
        for rid, live in list(self._live.items()):
            live.emitted += 1
            if live.emitted == len(live.planned):
                del self._live[rid]
                reason = "length" if live.truncated else "stop"
                finished.append(FinishedTurn(rid, live.planned, [-0.5] * len(live.planned), reason))
        return finished

    def _num_unfinished(self) -> int:
        return len(self._live)

    def _apply_weights(self, state_dict: Mapping[str, Any]) -> None:
        self.weight_log.append(len(self.step_log))


def answer_script(context: str, turn: int) -> str:
    return "The answer is 7."


class _BreakingEngine(ScriptedEngine):
    """Its step loop raises at step `break_at` (as a crashed model forward would)."""

    def __init__(self, tokenizer: Any, break_at: int) -> None:
        super().__init__(tokenizer, answer_script, 0.02)
        self.break_at = break_at

    def _step(self) -> list[FinishedTurn]:
        if len(self.step_log) == self.break_at:
            raise RuntimeError("injected engine failure")
        return super()._step()


def make_engine_breaking_once(tokenizer_dir: str, marker: str, break_at: int) -> ScriptedEngine:
    """A picklable engine factory: the first engine built (across processes: `marker` is a file path that
    does not exist yet) breaks at step `break_at`; every later one works."""
    import os

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return ScriptedEngine(tokenizer, answer_script, 0.02)
    return _BreakingEngine(tokenizer, break_at)


def make_answering_engine(tokenizer_dir: str) -> ScriptedEngine:
    """A picklable engine factory: an engine that answers every turn at once (0.02 s a step)."""
    from transformers import AutoTokenizer

    return ScriptedEngine(AutoTokenizer.from_pretrained(tokenizer_dir), answer_script, 0.02)


def make_add_calling_engine(tokenizer_dir: str) -> ScriptedEngine:
    """A picklable engine factory: the "policy" calls `add` with a=3, b=4, then answers."""
    from transformers import AutoTokenizer

    from rollout_workers.chat import tool_call_text

    def script(context: str, turn: int) -> str:
        return tool_call_text("add", {"a": 3, "b": 4}) if turn == 0 else "The answer is 7."

    return ScriptedEngine(AutoTokenizer.from_pretrained(tokenizer_dir), script)
