"""Supervised warm-start on gold conversations (e.g. `Environment.demonstration(task)`): next-token
cross-entropy on the assistant's tokens only, rendered with the same chat template as the rollouts."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn


def encode_conversation(tokenizer: Any, messages: Sequence[dict[str, Any]],
                        tools: list[dict[str, Any]] | None = None) -> tuple[list[int], list[int]]:
    """(ids, mask) for one conversation; mask 1 on assistant-written tokens (content, tool calls and the
    end-of-turn token), 0 on everything the template or the environment inserts. Segments are tokenised
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
        mask += [0] * len(context) + [1] * len(answer)
        done = full[: len(full) - tail]
    rest = encode(render(messages, gen=False)[len(done):])
    ids += rest
    mask += [0] * len(rest)
    if not any(mask):
        raise ValueError("conversation has no assistant message to learn from")
    return ids, mask


def sft_loss(model: nn.Module, batch: Sequence[tuple[list[int], list[int]]], pad_id: int = 0) -> torch.Tensor:
    """Mean next-token cross-entropy over the masked (assistant) tokens of a right-padded batch."""
    device = next(model.parameters()).device
    t = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), t), pad_id, dtype=torch.long)
    attention = torch.zeros((len(batch), t), dtype=torch.long)
    labels = torch.full((len(batch), t), -100, dtype=torch.long)
    for r, (ids, mask) in enumerate(batch):
        input_ids[r, : len(ids)] = torch.tensor(ids)
        attention[r, : len(ids)] = 1
        labels[r, : len(ids)] = torch.tensor([x if m else -100 for x, m in zip(ids, mask, strict=True)])
    input_ids, attention, labels = input_ids.to(device), attention.to(device), labels.to(device)
    logits = model(input_ids=input_ids, attention_mask=attention, use_cache=False).logits.float()
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def warm_start(model: nn.Module, tokenizer: Any, conversations: list[list[dict[str, Any]]], steps: int,
               lr: float, batch_size: int, seed: int, *, tools: list[dict[str, Any]] | None = None,
               weight_decay: float = 0.0, max_grad_norm: float = 1.0, warmup_steps: int = 10,
               on_step: Callable[[float], None] | None = None, stop_at_loss: float | None = None,
               stop_window: int = 10) -> list[float]:
    """Train `model` in place for `steps` AdamW steps on random batches of `conversations`; returns the loss
    of each step. The learning rate warms up linearly over `warmup_steps`, then decays to 5% of `lr` on a
    cosine. `tools` (JSON-schema tool list) renders the same system block as the rollouts. `on_step` is
    called with each step's loss (progress display). With `stop_at_loss`, training ends early once the mean
    loss of the last `stop_window` steps is below it (`steps` is then the cap)."""
    if steps < 1 or batch_size < 1 or lr <= 0:
        raise ValueError("steps and batch_size must be >= 1 and lr > 0")
    if not conversations:
        raise ValueError("conversations must not be empty")
    encoded = [encode_conversation(tokenizer, c, tools) for c in conversations]
    rng = random.Random(seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                                  weight_decay=weight_decay)
    warmup = max(1, min(warmup_steps, steps // 2))
    lr_schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * max(
        0.05, 0.5 * (1 + math.cos(math.pi * s / steps))))
    model.train()
    losses = []
    update = getattr(model, "update_balancing", None)
    for _ in range(steps):
        batch = [encoded[rng.randrange(len(encoded))] for _ in range(batch_size)]
        loss = sft_loss(model, batch, pad_id)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        lr_schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if callable(update):
            update()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(losses[-1])
        if stop_at_loss is not None and len(losses) >= stop_window and sum(losses[-stop_window:]) < stop_at_loss * stop_window:
            break
    return losses
