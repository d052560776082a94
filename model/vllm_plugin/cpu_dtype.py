"""The dtype our layers compute in when served on CPU: the one switch for bf16 compute.

bf16 where the CPU has bf16 instructions (x86 `avx512_bf16` / `amx_bf16`, Arm `bf16`): oneDNN runs bf16
matmuls there with fp32 accumulation, ~3x the fp32 rate at prefill sizes on an AMX CPU. Without them
torch emulates bf16 and is several times slower than fp32, so fp32. Where the flags cannot be read (no
/proc/cpuinfo), a short bf16-vs-fp32 matmul timing decides. Never below the served dtype: an fp32 model
computes in fp32.

Override with TAPER_CPU_COMPUTE_DTYPE = auto (default) | bfloat16 | float32. Importable without vLLM.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ENV_VAR = "TAPER_CPU_COMPUTE_DTYPE"
SETTINGS = ("auto", "bfloat16", "float32")
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 AVX-512 BF16 / AMX-BF16; Arm's BF16 extension
CPUINFO = Path("/proc/cpuinfo")
# bf16 must beat fp32 by this much in the measured fallback (a tie is no reason to lose precision)
MIN_MEASURED_SPEEDUP = 1.2


@dataclass(frozen=True)
class CpuComputeDtype:
    dtype: torch.dtype
    reason: str  # why, for the engine's log and benchmark JSON

    def describe(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')} ({self.reason})"


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str] | None:
    """The CPU's instruction flags (x86 `flags`, Arm `Features`) from /proc/cpuinfo; None if unreadable."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return None


def bf16_flags(flags: frozenset[str]) -> list[str]:
    return [f for f in BF16_FLAGS if f in flags]


def measured_bf16_speedup(seconds: float = 0.05) -> float:
    """fp32 time / bf16 time of a prefill-sized matmul ([256, 512] x [512, 512]) on this thread."""
    times = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(256, 512).to(dtype), torch.randn(512, 512).to(dtype)
        a @ b  # first call: oneDNN picks and builds its kernel
        start, calls = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            a @ b
            calls += 1
        times[dtype] = (time.perf_counter() - start) / calls
    return times[torch.float32] / times[torch.bfloat16]


def read_setting(environ: os._Environ | dict[str, str] = os.environ) -> str:
    value = environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if value not in SETTINGS:
        raise ValueError(f"{ENV_VAR}={value!r}: expected one of {', '.join(SETTINGS)}")
    return value


def decide(
    model_dtype: torch.dtype, setting: str, flags: frozenset[str] | None, measure=measured_bf16_speedup,
) -> CpuComputeDtype:
    """The pure decision: `measure()` runs only when `flags` is None and the setting is auto."""
    if model_dtype == torch.float32:
        return CpuComputeDtype(torch.float32, "served in fp32")
    if setting != "auto":
        return CpuComputeDtype(getattr(torch, setting), f"{ENV_VAR}={setting}")
    if flags is not None:
        found = bf16_flags(flags)
        if found:
            return CpuComputeDtype(torch.bfloat16, "CPU flags " + " ".join(found))
        return CpuComputeDtype(torch.float32, "no bf16 instruction flags")
    speedup = measure()
    dtype = torch.bfloat16 if speedup >= MIN_MEASURED_SPEEDUP else torch.float32
    return CpuComputeDtype(dtype, f"CPU flags unreadable; bf16 matmul {speedup:.2f}x fp32")


@functools.cache
def _decided(model_dtype: torch.dtype, setting: str) -> CpuComputeDtype:
    return decide(model_dtype, setting, cpu_flags())


def cpu_compute_dtype(model_dtype: torch.dtype) -> CpuComputeDtype:
    """The compute dtype for a model served in `model_dtype` on this CPU (decided once per process)."""
    return _decided(model_dtype, read_setting())
