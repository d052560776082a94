"""Helpers of the learner/job tests: a tiny random causal LM and synthetic policy samples."""

from __future__ import annotations

import random

import torch


def make_tiny_llama(vocab: int = 48, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      attn_implementation="eager")
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).float()


def make_samples(n: int, vocab: int = 48, seed: int = 0, max_prompt: int = 6, max_completion: int = 10):
    """Random samples with random advantages; the last 2 completion tokens of odd samples are inserted."""
    from rl_service.learner import PolicySample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = rng.randint(1, max_prompt)
        c = rng.randint(2, max_completion)
        mask = [1] * c
        if i % 2 and c > 3:
            mask[-2:] = [0, 0]
        out.append(PolicySample(
            prompt_ids=[rng.randrange(vocab) for _ in range(p)],
            completion_ids=[rng.randrange(vocab) for _ in range(c)],
            loss_mask=mask,
            advantages=[rng.gauss(0, 1) for _ in range(c)],
            engine_logprobs=[-3.0 + rng.gauss(0, 0.1) for _ in range(c)],
        ))
    return out
