"""A state dict handed to another process on the same GPU by CUDA IPC (`DeviceWeights`): the other process reads
exactly the tensors, in their dtypes and shapes, from the sender's buffer."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from rollout_workers.device_weights import DeviceWeights


def _read(weights: DeviceWeights, out: dict) -> None:
    out.update({name: t.cpu() for name, t in weights.open().items()})


def test_another_process_reads_the_same_tensors() -> None:
    torch.manual_seed(0)
    state = {"w": torch.randn(300, 70, device="cuda").to(torch.bfloat16), "bias": torch.randn(13, device="cuda"),
             "ids": torch.randint(0, 9, (5, 3), device="cuda")}
    buffer, weights = DeviceWeights.pack(state)
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        out = manager.dict()
        child = ctx.Process(target=_read, args=(weights, out))
        child.start()
        child.join(120)
        assert child.exitcode == 0
        got = dict(out)
    assert set(got) == set(state)
    for name, t in state.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t.cpu()), name
    del buffer
