"""Job checkpoints: everything needed to continue a job exactly.

Layout of one checkpoint `<root>/step_00000003/`:
  config.json, model.safetensors   the policy (HF `save_pretrained`; MoE balancing biases are buffers in it),
                                   loadable by `AutoModelForCausalLM` and by the rollout engines
  configuration_taper.py, ...      the model's code (model.portable): with `trust_remote_code=True` the
                                   folder loads where this project is not installed
  tokenizer files                  when a tokenizer is given
  learner.pt                       optimizer + LR scheduler state, optimizer step count
  rng.pt                           Python / NumPy / torch (CPU and CUDA) RNG states
  state.json                       the job's JSON state (step, data cursor, schedule history, ...)
A checkpoint is written to a temporary directory, fsynced (files, then the directory) and renamed into
place, then the parent directory is fsynced: a crash or power loss never leaves a half-written `step_*`
directory. `keep_last` prunes the oldest; temporary directories a crashed writer left behind are removed by
`remove_stale_temporaries` when the job starts again.

Nothing is ever unpickled from a checkpoint: the `.pt` files hold tensors, numbers, strings and containers
only and are read with `torch.load(weights_only=True)`, which refuses any other object (docs/design.md section 10).
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from model.portable import write_portable_code

_STEP_DIR = re.compile(r"^step_(\d{8})$")
_TMP_PREFIX = ".tmp-step_"


@dataclass
class Checkpoint:
    path: Path
    step: int

    @property
    def state(self) -> dict[str, Any]:
        return json.loads((self.path / "state.json").read_text())

    def learner_state(self) -> dict[str, Any] | None:
        return load_tensors_file(self.path / "learner.pt")

    def rng_state(self) -> dict[str, Any] | None:
        return load_tensors_file(self.path / "rng.pt")


class UnsafeCheckpointFile(ValueError):
    """A checkpoint file holds something other than tensors, numbers, strings and containers."""


# what older checkpoints' rng.pt holds besides tensors: NumPy's MT19937 key array (rebuilding an array runs
# no code of the file's choosing)
_NUMPY_ARRAY_GLOBALS = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_tensors_file(path: Path) -> Any:
    """`torch.load(path, weights_only=True)` (None if the file does not exist): any object other than tensors,
    numbers, strings, containers (and NumPy arrays) is refused, never unpickled."""
    if not path.exists():
        return None
    try:
        with torch.serialization.safe_globals(_NUMPY_ARRAY_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's message opens with advice to load with weights_only=False: keep only what was refused
        refused = next((line for line in str(exc).splitlines() if "GLOBAL" in line), "").strip()
        raise UnsafeCheckpointFile(f"{path} holds objects other than tensors and plain data; refusing to load "
                                   f"it. {refused}".strip()) from None


def capture_rng_state() -> dict[str, Any]:
    """The RNG states as plain data (loadable with `weights_only=True`)."""
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"bit_generator": np_state["bit_generator"], "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                  "pos": int(np_state["state"]["pos"]), "has_gauss": int(np_state["has_gauss"]),
                  "gauss": float(np_state["gauss"])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    np_state = state["numpy"]
    if isinstance(np_state, dict):
        np.random.set_state({"bit_generator": np_state["bit_generator"], "has_gauss": np_state["has_gauss"],
                             "gauss": np_state["gauss"],
                             "state": {"key": np_state["key"].numpy().astype(np.uint32), "pos": np_state["pos"]}})
    else:  # an older checkpoint: NumPy's legacy tuple
        np.random.set_state(np_state)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_weights(model: nn.Module, path: Path, tokenizer: Any = None,
                 state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """`save_pretrained` as safetensors (+ tokenizer). `state_dict` overrides the model's (e.g. gathered
    from FSDP shards)."""
    path.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if state_dict is not None:
        kwargs["state_dict"] = state_dict
    model.save_pretrained(path, **kwargs)
    if getattr(model.config, "model_type", None) == "taper":  # our model's code goes with it: loads anywhere
        write_portable_code(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def load_weights(model: nn.Module, path: Path) -> None:
    """Load `path/model.safetensors` into `model` in place (strict, except weights tied to others)."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match the model: missing={missing[:5]} unexpected={unexpected[:5]}")
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def list_checkpoints(root: Path) -> list[Checkpoint]:
    root = Path(root)
    if not root.is_dir():
        return []
    out = [Checkpoint(p, int(m.group(1))) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(out, key=lambda c: c.step)


def latest_checkpoint(root: Path) -> Checkpoint | None:
    ckpts = list_checkpoints(root)
    return ckpts[-1] if ckpts else None


def save_checkpoint(root: Path, step: int, model: nn.Module, state: dict[str, Any],
                    learner_state: dict[str, Any] | None = None, tokenizer: Any = None,
                    keep_last: int | None = None, model_state_dict: dict[str, torch.Tensor] | None = None,
                    rng: bool = True) -> Checkpoint:
    """Write checkpoint `step` atomically; prune to the newest `keep_last`. Returns it."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f"{_TMP_PREFIX}{step:08d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    save_weights(model, tmp, tokenizer, model_state_dict)
    if learner_state is not None:
        torch.save(learner_state, tmp / "learner.pt")
    if rng:
        torch.save(capture_rng_state(), tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, **state}, indent=1, sort_keys=True))
    for f in tmp.iterdir():
        _fsync(f)
    _fsync(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(root)
    if keep_last is not None:
        for old in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old.path, ignore_errors=True)
    return Checkpoint(final, step)


def remove_stale_temporaries(root: Path) -> list[Path]:
    """Delete the temporary directories of checkpoint writes that never finished (a crashed writer's);
    call it only while no writer of this root runs. Returns what was removed."""
    root = Path(root)
    stale = [p for p in root.glob(f"{_TMP_PREFIX}*") if p.is_dir()] if root.is_dir() else []
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def _fsync(path: Path) -> None:
    """Flush a file's or a directory's contents to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
