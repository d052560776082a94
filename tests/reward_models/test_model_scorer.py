"""The model-based process reward on a tiny random causal LM saved to a temp dir."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from reward_models.components import build_component
from reward_models.model_scorer import ModelScorerComponent, save_scorer
from reward_models.scoring import score_trajectories


def tiny_model(arch: str) -> Any:
    torch.manual_seed(0)
    if arch == "taper":
        from model import TaperConfig, TaperForCausalLM

        return TaperForCausalLM(TaperConfig.preset("tiny")).eval()
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module", params=["taper", "llama"])
def scorer_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny random causal LM (our TaperForCausalLM, and a stock HF Llama) with a random scalar head."""
    model = tiny_model(request.param)
    hidden = model.config.hidden_size
    weight, bias = torch.randn(hidden) / hidden**0.5, torch.tensor(0.1)
    path = save_scorer(model, weight, bias, tmp_path_factory.mktemp(request.param), name="judge")
    return path, model, weight, bias


def test_scores_each_step_from_its_last_action_token(b: Any, calc_env: Any, scorer_dir: Any) -> None:
    path, model, weight, bias = scorer_dir
    comp = build_component({"kind": "model_scorer", "path": str(path)})
    assert isinstance(comp, ModelScorerComponent) and not comp.loaded  # lazy
    steps = [
        b.step(n_action=4, n_obs=3, start_id=20),
        b.step(n_action=0, n_obs=2),
        b.step(n_action=2, n_obs=0),
    ]
    t = b.traj("g", None, steps, task={"question": "1+1?", "answer": 2})
    scores = comp.score(t, calc_env)
    assert comp.loaded
    assert scores[1] == {}  # no tokens written in that step: nothing to judge
    # slow reference: a separate forward pass on each step's prefix, head on its last position
    ids = t.prompt_ids + t.completion_ids()
    ends = {0: len(t.prompt_ids) + 3, 2: len(t.prompt_ids) + 4 + 3 + 0 + 2 + 1}
    for k, end in ends.items():
        with torch.no_grad():
            body = model.base_model
            h = body(input_ids=torch.tensor([ids[: end + 1]]), use_cache=False).last_hidden_state[0, -1]
        expected = float(torch.sigmoid(h @ weight + bias))
        assert scores[k]["judge"] == pytest.approx(expected, rel=1e-4, abs=1e-6)
        assert 0.0 < scores[k]["judge"] < 1.0


def test_pluggable_into_scoring_and_picklable_without_weights(b: Any, calc_env: Any, scorer_dir: Any) -> None:
    path = scorer_dir[0]
    comp = ModelScorerComponent(str(path), name="judge")
    t = b.traj(
        "g",
        None,
        [b.step(calls=[b.call("calculate", {"expression": "1+1"}, result="2")])],
        task={
            "question": "1+1?",
            "answer": 2,
        },
    )
    score_trajectories([t], calc_env, components=["format", comp])
    assert set(t.steps[0].process_rewards) == {"format", "judge"}
    clone = pickle.loads(pickle.dumps(comp))
    assert comp.loaded and not clone.loaded and clone.path == comp.path


def test_bad_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a scorer checkpoint"):
        build_component({"kind": "model_scorer", "path": str(tmp_path)})


def test_max_tokens_scores_from_the_last_window_and_skips_steps_before_it(
    b: Any, calc_env: Any, scorer_dir: Any
) -> None:
    path, model, weight, bias = scorer_dir
    comp = ModelScorerComponent(str(path), max_tokens=6)
    steps = [
        b.step(n_action=3, n_obs=2, start_id=30),
        b.step(n_action=2, n_obs=1),
        b.step(n_action=3, n_obs=0),
    ]
    t = b.traj("g", None, steps)
    scores = comp.score(t, calc_env)
    ids = t.prompt_ids + t.completion_ids()  # prompt 3, step 0 ends at 5, step 1 at 9, step 2 at 13
    offset = 14 - 6
    assert scores[0] == {}  # its last token is before the window
    for k, end in {1: 9, 2: 13}.items():
        with torch.no_grad():
            h = model.base_model(input_ids=torch.tensor([ids[offset : end + 1]]), use_cache=False)
        expected = float(torch.sigmoid(h.last_hidden_state[0, -1] @ weight + bias))
        assert scores[k]["judge"] == pytest.approx(expected, rel=1e-4, abs=1e-6)


def test_head_of_the_wrong_size_is_rejected(b: Any, calc_env: Any, tmp_path: Path) -> None:
    model = tiny_model("llama")
    path = save_scorer(model, torch.zeros(model.config.hidden_size + 1), torch.tensor(0.0), tmp_path)
    comp = ModelScorerComponent(str(path))
    with pytest.raises(ValueError, match="head weight has 33 entries, model hidden_size is 32"):
        comp.score(b.traj("g", None, [b.step()]), calc_env)
