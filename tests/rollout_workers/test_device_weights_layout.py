"""Where `DeviceWeights` puts each tensor of a state dict in its one buffer (pure logic; the CUDA IPC itself is
tests/gpu/test_device_weights_gpu.py)."""

from __future__ import annotations

import torch

from rollout_workers.device_weights import ALIGN_BYTES, layout


def test_every_tensor_starts_aligned_and_none_overlap() -> None:
    state = {"a": torch.zeros(3, 5, dtype=torch.bfloat16), "b": torch.zeros(7), "c": torch.zeros(0),
             "d": torch.zeros(2, 64, dtype=torch.bfloat16)}
    entries, size = layout(state)
    assert [e.name for e in entries] == list(state)
    spans = []
    for e in entries:
        t = state[e.name]
        assert e.offset % ALIGN_BYTES == 0 and e.shape == tuple(t.shape) and e.dtype == t.dtype
        spans.append((e.offset, e.offset + t.numel() * t.element_size()))
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))
    assert spans[-1][1] <= size and size % ALIGN_BYTES == 0
