"""A scripted Engine for pure-logic loop tests: it "samples" text chosen by a script.

Only for tests of the loop's control flow (a random model cannot write tool calls); token-exactness,
masks and logprobs are tested on the real vLLM engine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rollout_workers.engine import TurnOutput, TurnRequest
from rollout_workers.sampling import SamplingConfig

# script(prompt_text_so_far, turn_index) -> the text the "policy" writes (without the end token)
Script = Callable[[str, int], str]


class ScriptedEngine:
    def __init__(self, tokenizer: Any, script: Script) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.weight_version = 0
        self.calls: list[int] = []  # batch size of every generate call

    def generate(self, requests: list[TurnRequest], sampling: SamplingConfig, stop_token_ids: list[int]) -> list[TurnOutput]:
        self.calls.append(len(requests))
        outs = []
        for r in requests:
            context = self.tokenizer.decode(r.prompt_ids, skip_special_tokens=False)
            turn = context.count("<|im_start|>assistant\n") - 1
            ids = self.tokenizer.encode(self.script(context, turn), add_special_tokens=False)
            ids.append(self.tokenizer.eos_token_id)
            reason = "stop"
            if len(ids) > r.max_tokens:
                ids, reason = ids[: r.max_tokens], "length"
            outs.append(TurnOutput(ids, [-0.5] * len(ids), reason, self.weight_version))
        return outs

    def load_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        self.weight_version = version


class SlowScriptedEngine(ScriptedEngine):
    """Sleeps in every generate call, so a test can act while a batch is in flight."""

    def __init__(self, tokenizer: Any, script: Script, delay_s: float) -> None:
        super().__init__(tokenizer, script)
        self.delay_s = delay_s

    def generate(self, requests: list[TurnRequest], sampling: SamplingConfig, stop_token_ids: list[int]) -> list[TurnOutput]:
        import time

        time.sleep(self.delay_s)
        return super().generate(requests, sampling, stop_token_ids)


def answer_script(context: str, turn: int) -> str:
    return "The answer is 7."


def make_slow_engine(tokenizer_dir: str, delay_s: float) -> SlowScriptedEngine:
    """A picklable engine factory for Ray workers."""
    from transformers import AutoTokenizer

    return SlowScriptedEngine(AutoTokenizer.from_pretrained(tokenizer_dir), answer_script, delay_s)
