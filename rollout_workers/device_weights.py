"""Weights handed to a rollout engine on the learner's own GPU without leaving it: one device buffer holding every
tensor, shared with the engine's process by CUDA IPC (torch's `reduce_tensor`), and where each tensor lies in it.
The sender keeps the buffer until its next push (a worker started in between opens the same one); the receiver
copies from it into the engine's weights and lets go."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

ALIGN_BYTES = 256  # each tensor's first byte: what CUDA's allocator gives a tensor of its own


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes into the buffer


def layout(state: Mapping[str, torch.Tensor]) -> tuple[list[Entry], int]:
    """Every tensor's place in one buffer (aligned starts) and the buffer's size in bytes."""
    entries, offset = [], 0
    for name, t in state.items():
        entries.append(Entry(name, t.dtype, tuple(t.shape), offset))
        offset += -(-t.numel() * t.element_size() // ALIGN_BYTES) * ALIGN_BYTES
    return entries, offset


def device_uuid(device: torch.device | int | None = None) -> str | None:
    """The GPU's UUID (the same in every process whatever its CUDA_VISIBLE_DEVICES), None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return str(torch.cuda.get_device_properties(torch.cuda.current_device() if device is None else device).uuid)


def _local_index(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    raise RuntimeError(f"device weights: GPU {uuid} is not visible in this process")


@dataclass(frozen=True)
class DeviceWeights:
    """A picklable handle to a state dict in one CUDA buffer of GPU `uuid`."""

    handle: tuple[Any, tuple]  # torch.multiprocessing.reductions.reduce_tensor(buffer)
    entries: tuple[Entry, ...]
    uuid: str

    @classmethod
    def pack(cls, state: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, DeviceWeights]:
        """Copy `state` (CUDA tensors of one device) into a new buffer there: (the buffer, its handle). The caller
        keeps the buffer alive while any process may open the handle."""
        from torch.multiprocessing.reductions import reduce_tensor

        entries, size = layout(state)
        device = next(iter(state.values())).device
        buffer = torch.empty(size, dtype=torch.uint8, device=device)
        for e in entries:
            t = state[e.name]
            nbytes = t.numel() * t.element_size()
            buffer[e.offset:e.offset + nbytes].view(t.dtype).view(t.shape).copy_(t)
        torch.cuda.current_stream(device).synchronize()  # filled before another process reads it
        return buffer, cls(reduce_tensor(buffer), tuple(entries), str(device_uuid(device)))

    def open(self) -> dict[str, torch.Tensor]:
        """The tensors, as views of the shared buffer on this process's index of the same GPU."""
        rebuild, args = self.handle
        args = list(args)
        args[6] = _local_index(self.uuid)  # reduce_tensor's storage_device: the sender's index of the GPU
        buffer = rebuild(*args)
        out = {}
        for e in self.entries:
            nbytes = e.dtype.itemsize * int(torch.Size(e.shape).numel())
            out[e.name] = buffer[e.offset:e.offset + nbytes].view(e.dtype).view(e.shape)
        return out
