"""SFT warm-start: assistant-only masks rendered like the rollouts, and the loss goes down."""

from __future__ import annotations

import pytest
import torch

from rl_service.training.sft import encode_conversation, sft_loss, warm_start
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


def _small_llama(tokenizer) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=48, intermediate_size=96,
                                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                        head_dim=24))


def test_warm_start_lowers_the_assistant_loss(tokenizer) -> None:
    model = _small_llama(tokenizer)
    convs, tools = _demos(4)
    batch = [encode_conversation(tokenizer, c, tools) for c in convs]
    with torch.no_grad():
        before = float(sft_loss(model, batch))
    losses = warm_start(model, tokenizer, convs, steps=8, lr=5e-3, batch_size=2, seed=0, tools=tools)
    with torch.no_grad():
        after = float(sft_loss(model, batch))
    assert len(losses) == 8 and after < before - 1.0


def test_warm_start_stops_once_the_recent_loss_is_under_the_target(tokenizer) -> None:
    model = _small_llama(tokenizer)
    convs, tools = _demos(4)
    first = warm_start(model, tokenizer, convs, steps=6, lr=5e-3, batch_size=2, seed=0, tools=tools)
    target = 0.5 * sum(first[-3:]) / 3  # reachable: the loss keeps falling on these four conversations
    losses = warm_start(model, tokenizer, convs, steps=200, lr=5e-3, batch_size=2, seed=1, tools=tools,
                        stop_at_loss=target, stop_window=3)
    assert 3 < len(losses) < 200
    windows = [sum(losses[i - 3:i]) / 3 for i in range(3, len(losses) + 1)]
    assert windows[-1] < target <= min(windows[:-1])
