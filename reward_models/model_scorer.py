"""A model-based process reward: a causal LM with a scalar head scores each step.

Checkpoint layout (a directory):
- the causal LM in Hugging Face format (``config.json`` + safetensors; any ``AutoModelForCausalLM``,
  e.g. ``TaperForCausalLM`` once the ``model`` package has registered it);
- ``scorer_head.safetensors``: ``weight`` [hidden_size] and ``bias`` [] of the scalar head;
- ``scorer.json``: ``{"name": ...}`` (the component name the scores are stored under).

The score of step k is ``sigmoid(head(h))`` with ``h`` the base model's last hidden state (after the
final norm) at the last token the policy wrote in step k, reading the prompt and everything before it (one forward pass per trajectory: the
model is causal). The model loads on first use, so building the component is cheap and picklable.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from reward_models.components import ProcessComponent, StepScores, register_component
from rollout_workers.trajectory import Trajectory

HEAD_FILE = "scorer_head.safetensors"
META_FILE = "scorer.json"


def save_scorer(
    model: Any, head_weight: Any, head_bias: Any, path: str | Path, name: str = "model_score"
) -> Path:
    """Save a causal LM and a scalar head (weight [hidden], bias []) as a scorer checkpoint."""
    import torch
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    weight = torch.as_tensor(head_weight, dtype=torch.float32).reshape(-1).contiguous()
    bias = torch.as_tensor(head_bias, dtype=torch.float32).reshape(()).contiguous()
    save_file({"weight": weight, "bias": bias}, str(out / HEAD_FILE))
    (out / META_FILE).write_text(json.dumps({"name": name}))
    return out


@register_component("model_scorer")
class ModelScorerComponent(ProcessComponent):
    def __init__(
        self, path: str, name: str | None = None, device: str = "cpu", max_tokens: int | None = None
    ):
        self.path = str(path)
        self.device = device
        self.max_tokens = max_tokens
        meta_file = Path(self.path) / META_FILE
        if not meta_file.is_file():
            raise ValueError(f"model_scorer path {self.path!r} has no {META_FILE} (not a scorer checkpoint)")
        self.meta = json.loads(meta_file.read_text())
        self.name = name or self.meta.get("name", "model_score")
        self._model: Any = None
        self._head: tuple[Any, Any] | None = None

    @property
    def loaded(self) -> bool:
        return self._model is not None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_model"] = None  # ship the path, not the weights
        state["_head"] = None
        return state

    def _load(self) -> None:
        import torch
        from safetensors.torch import load_file
        from transformers import AutoConfig, AutoModelForCausalLM

        config = (
            AutoConfig.from_pretrained(self.path) if _is_hf_known(self.path) else _register_taper(self.path)
        )
        model = AutoModelForCausalLM.from_pretrained(self.path, config=config, dtype=torch.float32)
        # The transformer body (HF's base_model_prefix): its last_hidden_state feeds the head.
        model = model.base_model.to(self.device).eval()
        head = load_file(str(Path(self.path) / HEAD_FILE), device=self.device)
        hidden = getattr(model.config, "hidden_size", None)
        if hidden is not None and head["weight"].numel() != hidden:
            raise ValueError(
                f"model_scorer head weight has {head['weight'].numel()} entries, model hidden_size is {hidden}"
            )
        self._model = model
        self._head = (head["weight"], head["bias"])

    def score(self, trajectory: Trajectory, env: Any) -> StepScores:
        import torch

        out: StepScores = [{} for _ in trajectory.steps]
        ends: list[tuple[int, int]] = []  # (step index, position of its last action token)
        pos = len(trajectory.prompt_ids)
        for k, step in enumerate(trajectory.steps):
            if step.action_ids:
                ends.append((k, pos + len(step.action_ids) - 1))
            pos += len(step.action_ids) + len(step.observation_ids)
        if not ends:
            return out
        if self._model is None:
            self._load()
        assert self._head is not None
        ids = trajectory.prompt_ids + trajectory.completion_ids()
        ids = ids[: ends[-1][1] + 1]
        offset = 0
        if self.max_tokens is not None and len(ids) > self.max_tokens:
            offset = len(ids) - self.max_tokens
            ids = ids[offset:]
        with torch.inference_mode():
            x = torch.tensor([ids], dtype=torch.long, device=self.device)
            hidden = self._model(input_ids=x, use_cache=False).last_hidden_state[0]
            weight, bias = self._head
            for k, p in ends:
                if p - offset < 0:
                    continue  # this step fell outside the scorer's window
                logit = hidden[p - offset].float() @ weight + bias
                out[k] = {self.name: float(torch.sigmoid(logit))}
        return out


def _is_hf_known(path: str) -> bool:
    model_type = json.loads((Path(path) / "config.json").read_text()).get("model_type")
    from transformers import CONFIG_MAPPING

    return model_type in CONFIG_MAPPING


def _register_taper(path: str) -> Any:
    """Our own model type: importing the ``model`` package registers it with the Auto classes."""
    from transformers import AutoConfig

    import model  # noqa: F401  (heavy: only scorers of our own checkpoints need it)

    try:
        return AutoConfig.from_pretrained(path)
    except (KeyError, ValueError) as e:
        raise ValueError(
            f"model_scorer checkpoint {path!r}: model type not registered with transformers: {e}"
        ) from e
