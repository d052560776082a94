"""A warm start outside any job (`warm_started_model`, what the benchmarks share across runs): the job's phases
on a fresh tiny model, saved so that it loads as a checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from rl_service.training.warm_start import warm_started_model


def test_a_warm_started_model_is_saved_with_its_tokenizer_and_reports_each_step(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from model.modeling import TaperForCausalLM

    seen: list[tuple[str, int]] = []
    losses = warm_started_model("calculator", tmp_path / "warm", steps=2, examples=4, seed=0, mixed_steps=1,
                                tool_use_fraction=0.5, on_step=lambda phase, step, loss: seen.append((phase, step)))
    assert len(losses) == 3 and all(loss > 0 for loss in losses)
    assert seen == [("demonstrations", 1), ("demonstrations", 2), ("mixed", 3)]
    model = TaperForCausalLM.from_pretrained(tmp_path / "warm")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "warm")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokenizer("1 + 2")["input_ids"]])).logits
    assert logits.shape[-1] == model.config.vocab_size and torch.isfinite(logits).all()
