"""Checkpoints: round trip of weights / optimizer / RNG / state, atomic layout, pruning."""

from __future__ import annotations

import os
import random

import pytest
import torch

from rl_service.training.checkpoint import (
    UnsafeCheckpointFile,
    latest_checkpoint,
    list_checkpoints,
    load_weights,
    remove_stale_temporaries,
    restore_rng_state,
    save_checkpoint,
)
from rl_service.training.learner import Learner, LearnerConfig
from tests.rl_service.training.learner_helpers import make_samples, make_tiny_llama


def test_round_trip_continues_training_identically(tmp_path) -> None:
    samples = make_samples(4, seed=1)
    a = Learner(make_tiny_llama(seed=0), LearnerConfig(learning_rate=1e-2, lr_scheduler_type="linear", max_steps=5))
    a.step(samples)
    save_checkpoint(tmp_path, 1, a.model, {"cursor": 7}, learner_state=a.state_dict())
    ck = latest_checkpoint(tmp_path)
    assert ck is not None and ck.step == 1 and ck.state == {"step": 1, "cursor": 7}

    b = Learner(make_tiny_llama(seed=99), LearnerConfig(learning_rate=1e-2, lr_scheduler_type="linear", max_steps=5))
    load_weights(b.model, ck.path)
    b.load_state_dict(ck.learner_state())
    ma, mb = a.step(samples), b.step(samples)
    assert ma["loss"] == mb["loss"] and ma["learning_rate"] == mb["learning_rate"]
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.equal(p, q), n


def test_rng_state_round_trip(tmp_path) -> None:
    import numpy as np

    ck = save_checkpoint(tmp_path, 1, make_tiny_llama(), {})
    x = (random.random(), np.random.rand(3), torch.rand(3))
    restore_rng_state(ck.rng_state())
    assert random.random() == x[0] and np.array_equal(np.random.rand(3), x[1]) and torch.equal(torch.rand(3), x[2])


def test_keep_last_prunes_and_no_partial_dirs(tmp_path) -> None:
    model = make_tiny_llama()
    for s in (1, 2, 3, 4):
        save_checkpoint(tmp_path, s, model, {}, keep_last=2, rng=False)
    assert [c.step for c in list_checkpoints(tmp_path)] == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]


def test_load_weights_rejects_a_different_model(tmp_path) -> None:
    save_checkpoint(tmp_path, 0, make_tiny_llama(), {}, rng=False)
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=2, num_key_value_heads=2, head_dim=16))
    with pytest.raises(ValueError, match="does not match"):
        load_weights(other, latest_checkpoint(tmp_path).path)


def test_checkpoint_files_and_directories_are_synced_before_and_after_the_rename(tmp_path, monkeypatch) -> None:
    synced: list[str] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    ck = save_checkpoint(tmp_path, 3, make_tiny_llama(), {"cursor": 1}, learner_state={"x": 1})
    tmp_dir = next(n for n in synced if n.rsplit("/", 1)[-1].startswith(".tmp-step_00000003"))
    files = [n for n in synced if n.startswith(tmp_dir + "/")]
    assert {n.rsplit("/", 1)[-1] for n in files} == {p.name for p in ck.path.iterdir()}
    assert synced.index(tmp_dir) > max(synced.index(n) for n in files)  # the directory after its files
    assert synced[-1] == str(tmp_path)  # the parent, after the rename made the checkpoint visible


def test_stale_temporary_directories_are_removed(tmp_path) -> None:
    save_checkpoint(tmp_path, 1, make_tiny_llama(), {}, rng=False)
    stale = tmp_path / ".tmp-step_00000002-4242"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    assert remove_stale_temporaries(tmp_path) == [stale]
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000001"]


class _WritesAMarker:
    """Unpickling this runs `touch marker`: what a tampered checkpoint file would do."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("name", ["learner.pt", "rng.pt"])
def test_a_checkpoint_file_with_a_pickled_object_is_refused_and_runs_nothing(tmp_path, name) -> None:
    ck = save_checkpoint(tmp_path / "ck", 1, make_tiny_llama(), {}, learner_state={"optimizer_steps": 1})
    marker = tmp_path / "marker"
    torch.save({"optimizer_steps": 1, "payload": _WritesAMarker(marker)}, ck.path / name)
    load = ck.learner_state if name == "learner.pt" else ck.rng_state
    with pytest.raises(UnsafeCheckpointFile, match=rf"{name} holds objects other than tensors.*posix\.system"):
        load()
    assert not marker.exists()


def test_learner_and_rng_state_load_with_weights_only(tmp_path) -> None:
    """What a checkpoint writes is plain data, and an older checkpoint's rng.pt (NumPy's legacy tuple with its
    key array) still loads: NumPy arrays are the one non-tensor type admitted."""
    import numpy as np

    learner = Learner(make_tiny_llama(seed=0), LearnerConfig(learning_rate=1e-2, lr_scheduler_type="linear",
                                                             max_steps=5))
    learner.step(make_samples(2, seed=3))
    ck = save_checkpoint(tmp_path, 1, learner.model, {}, learner_state=learner.state_dict())
    for name in ("learner.pt", "rng.pt"):
        torch.load(ck.path / name, weights_only=True)  # without any allow-list
    np.random.seed(5)
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
               ck.path / "rng.pt")
    expected = np.random.rand(4)
    restore_rng_state(ck.rng_state())
    assert np.array_equal(np.random.rand(4), expected)
