"""SFT warm-start (TRL's SFTTrainer): assistant-only masks rendered like the rollouts, the loss on exactly those
tokens goes down, the early stop and the progress callback."""

from __future__ import annotations

import pytest
import torch

from rl_service.training.sft import encode_conversation, train_sft
from rollout_workers.environments.calculator import CalculatorEnv


@pytest.fixture(scope="module")
def tokenizer():
    from model.tokenizer import load_tokenizer

    return load_tokenizer()


def _demos(n: int):
    env = CalculatorEnv()
    return [env.demonstration(t) for t in CalculatorEnv.generate_tasks(n, seed=1)], env.tools()


def test_mask_covers_exactly_the_assistant_turns(tokenizer) -> None:
    (conv, *_), tools = _demos(1)
    ids, mask = encode_conversation(tokenizer, conv, tools)
    full = tokenizer.apply_chat_template(conv, tools=[{"type": "function", "function": t} for t in tools], tokenize=False)
    assert tokenizer.decode(ids) == full
    learned = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    want = conv[1]["content"] or ""
    assert '<tool_call>{"name": "calculator"' in learned and conv[-1]["content"] in learned
    assert learned.count("<|im_end|>") == 2 and "<tool_response>" not in learned and "# Tools" not in learned
    assert want in learned
    with pytest.raises(ValueError, match="no assistant"):
        encode_conversation(tokenizer, [{"role": "user", "content": "hi"}])


def sft_loss(model: torch.nn.Module, batch, pad_id: int = 0) -> torch.Tensor:
    """Mean next-token cross-entropy over the masked (assistant) tokens of a right-padded batch: the quantity
    TRL's completion-only loss must lower, written out independently."""
    t = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), t), pad_id, dtype=torch.long)
    attention = torch.zeros((len(batch), t), dtype=torch.long)
    labels = torch.full((len(batch), t), -100, dtype=torch.long)
    for r, (ids, mask) in enumerate(batch):
        input_ids[r, : len(ids)] = torch.tensor(ids)
        attention[r, : len(ids)] = 1
        labels[r, : len(ids)] = torch.tensor([x if m else -100 for x, m in zip(ids, mask, strict=True)])
    logits = model(input_ids=input_ids, attention_mask=attention, use_cache=False).logits.float()
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def _small_llama(tokenizer) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=48, intermediate_size=96,
                                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                        head_dim=24))


def test_sft_lowers_the_assistant_loss(tokenizer) -> None:
    model = _small_llama(tokenizer)
    convs, tools = _demos(4)
    batch = [encode_conversation(tokenizer, c, tools) for c in convs]
    with torch.no_grad():
        before = float(sft_loss(model, batch))
    losses = train_sft(model, tokenizer, convs, steps=8, lr=5e-3, batch_size=2, seed=0, tools=tools)
    with torch.no_grad():
        after = float(sft_loss(model, batch))
    assert len(losses) == 8 and after < before - 1.0


def test_sft_stops_once_the_recent_loss_is_under_the_target(tokenizer) -> None:
    model = _small_llama(tokenizer)
    convs, tools = _demos(4)
    first = train_sft(model, tokenizer, convs, steps=6, lr=5e-3, batch_size=2, seed=0, tools=tools)
    target = 0.5 * sum(first[-3:]) / 3  # reachable: the loss keeps falling on these four conversations
    losses = train_sft(model, tokenizer, convs, steps=200, lr=5e-3, batch_size=2, seed=1, tools=tools,
                        stop_at_loss=target, stop_window=3)
    assert 3 < len(losses) < 200
    windows = [sum(losses[i - 3:i]) / 3 for i in range(3, len(losses) + 1)]
    assert windows[-1] < target <= min(windows[:-1])


def test_trl_trains_on_exactly_the_assistant_tokens_and_reports_every_step(tokenizer) -> None:
    """One batch holds all four conversations, so TRL's first logged loss is the masked loss of the untouched
    model on them; the progress callback sees every step and the MoE balancing hook runs after each."""
    model = _small_llama(tokenizer)
    balanced: list[int] = []
    model.update_balancing = lambda: balanced.append(1)
    convs, tools = _demos(4)
    with torch.no_grad():
        before = float(sft_loss(model, [encode_conversation(tokenizer, c, tools) for c in convs]))
    seen: list[float] = []
    losses = train_sft(model, tokenizer, convs, steps=3, lr=5e-3, batch_size=4, seed=0, tools=tools,
                        on_step=seen.append)
    assert losses[0] == pytest.approx(before, rel=1e-4)
    assert seen == losses and len(losses) == 3 and len(balanced) == 3
    assert "forward" not in model.__dict__  # TRL's fused LM head is taken off the model again
