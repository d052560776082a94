"""Supervised fine-tuning on gold conversations (e.g. `Environment.demonstration(task)`) with TRL's `SFTTrainer`
(`train_sft`; a job's warm start, `warm_start.py`, runs it): next-token cross-entropy on the assistant's tokens
only (TRL's completion-only loss over our masks), the conversations rendered and tokenised segment by segment
exactly as the rollouts see them."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from datasets import Dataset
from torch import nn
from transformers import PrinterCallback, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from trl import SFTConfig, SFTTrainer


def encode_conversation(tokenizer: Any, messages: Sequence[dict[str, Any]],
                        tools: list[dict[str, Any]] | None = None) -> tuple[list[int], list[int]]:
    """(ids, mask) for one conversation; mask 1 on assistant-written tokens (content, tool calls and the
    end-of-turn token) of turns without `weight: 0`, 0 on everything the template or the environment inserts. Segments are tokenised
    one by one, as the agent loop does."""
    template_tools = [{"type": "function", "function": t} for t in tools] if tools else None

    def render(msgs: Sequence[dict[str, Any]], gen: bool) -> str:
        if not msgs:
            return ""
        return tokenizer.apply_chat_template(list(msgs), tools=template_tools, tokenize=False,
                                             add_generation_prompt=gen)

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    ids: list[int] = []
    mask: list[int] = []
    done = ""
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        prefix = render(messages[:i], gen=True)
        full = render(messages[: i + 1], gen=False)
        if not prefix.startswith(done) or not full.startswith(prefix):
            raise ValueError(f"conversation[{i}]: the chat template does not render it as an extension of the prefix")
        turn = full[len(prefix):]
        tail = len(turn) - len(turn.rstrip("\n"))  # the newline after the end-of-turn token is inserted text
        context = encode(prefix[len(done):])
        answer = encode(turn[: len(turn) - tail])
        ids += context + answer
        learn = 0 if m.get("weight") == 0 else 1  # OpenAI's `weight: 0`: a turn shown, not learned from
        mask += [0] * len(context) + [learn] * len(answer)
        done = full[: len(full) - tail]
    rest = encode(render(messages, gen=False)[len(done):])
    ids += rest
    mask += [0] * len(rest)
    if not any(mask):
        raise ValueError("conversation has no assistant message to learn from")
    return ids, mask


class _Progress(TrainerCallback):
    """Per optimizer step: MoE balancing update, the step's loss to `on_step`, and the early stop on the mean
    loss of the last `window` steps."""

    def __init__(self, model: nn.Module, on_step: Callable[[float], None] | None, stop_at_loss: float | None,
                 window: int) -> None:
        self.model, self.on_step, self.stop_at_loss, self.window = model, on_step, stop_at_loss, window
        self.losses: list[float] = []

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        update = getattr(self.model, "update_balancing", None)
        if callable(update):
            update()

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if not logs or "loss" not in logs:  # the end-of-training summary has train_loss instead
            return
        self.losses.append(float(logs["loss"]))
        if self.on_step is not None:
            self.on_step(self.losses[-1])
        recent = self.losses[-self.window:]
        if self.stop_at_loss is not None and len(recent) == self.window and sum(recent) < self.stop_at_loss * self.window:
            control.should_training_stop = True


def train_sft(model: nn.Module, tokenizer: Any, conversations: list[list[dict[str, Any]]], steps: int,
               lr: float, batch_size: int, seed: int, *, tools: list[dict[str, Any]] | None = None,
               tools_of: Sequence[list[dict[str, Any]] | None] | None = None,
               weight_decay: float = 0.0, max_grad_norm: float = 1.0, warmup_steps: int = 10,
               on_step: Callable[[float], None] | None = None, stop_at_loss: float | None = None,
               stop_window: int = 10) -> list[float]:
    """Train `model` in place for at most `steps` AdamW steps of `batch_size` conversations (reshuffled every
    epoch) with TRL's SFTTrainer; returns the loss of each step. The learning rate warms up linearly over
    `warmup_steps`, then decays on a cosine to 5% of `lr`. `tools` (JSON-schema tool list) renders the same
    system block as the rollouts; `tools_of[i]`, where given, replaces it for conversation i. `on_step` is called with each step's loss (progress display). With
    `stop_at_loss`, training ends early once the mean loss of the last `stop_window` steps is below it."""
    if steps < 1 or batch_size < 1 or lr <= 0:
        raise ValueError("steps and batch_size must be >= 1 and lr > 0")
    if not conversations:
        raise ValueError("conversations must not be empty")
    own = list(tools_of) if tools_of is not None else [None] * len(conversations)
    encoded = [encode_conversation(tokenizer, c, t if t is not None else tools)
               for c, t in zip(conversations, own, strict=True)]
    data = Dataset.from_list([{"input_ids": ids, "completion_mask": mask} for ids, mask in encoded])
    if tokenizer.pad_token is None:
        raise ValueError("the tokenizer needs a pad token")
    cuda = next(model.parameters()).device.type == "cuda"
    progress = _Progress(model, on_step, stop_at_loss, stop_window)
    with tempfile.TemporaryDirectory(prefix="taper-sft-") as out:
        config = SFTConfig(
            output_dir=out, max_steps=steps, per_device_train_batch_size=batch_size, learning_rate=lr,
            weight_decay=weight_decay, max_grad_norm=max_grad_norm, optim="adamw_torch",
            warmup_steps=max(1, min(warmup_steps, steps // 2)), lr_scheduler_type="cosine_with_min_lr",
            lr_scheduler_kwargs={"min_lr_rate": 0.05}, completion_only_loss=True, max_length=None,
            gradient_checkpointing=False,  # SFTConfig turns it on; it recomputes every forward
            seed=seed, data_seed=seed, bf16=cuda, use_cpu=not cuda, logging_steps=1, save_strategy="no",
            report_to="none", disable_tqdm=True, dataloader_num_workers=0, dataset_num_proc=None,
        )
        trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                             callbacks=[progress])
        trainer.remove_callback(PrinterCallback)  # progress goes to `on_step`, not stdout
        try:
            trainer.train()
        finally:
            model.__dict__.pop("forward", None)  # SFTTrainer patched a fused LM head onto this instance
    return progress.losses
