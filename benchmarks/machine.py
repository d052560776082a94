"""Where a benchmark ran: CPU model, core count, the instruction flags that decide its fast paths, load,
and the CPU compute dtype the Taper vLLM plugin picks there. Every benchmark's JSON records `machine_info()`."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

from model.vllm_plugin.cpu_dtype import cpu_compute_dtype, cpu_flags

# flags that change which kernels torch/oneDNN and vLLM's CPU backend can use
RELEVANT_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile", "amx_bf16",
                  "amx_int8", "asimd", "sve", "bf16", "i8mm")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    flags = cpu_flags()
    info: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "cpus": os.cpu_count(),
        "cpu_flags": None if flags is None else [f for f in RELEVANT_FLAGS if f in flags],
        "taper_cpu_compute_dtype_if_served_bf16": cpu_compute_dtype(torch.bfloat16).describe(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "load_avg_1m": os.getloadavg()[0],
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def describe(info: dict[str, Any]) -> str:
    """One line for tables and notes."""
    flags = " ".join(info["cpu_flags"] or []) or "no listed flags"
    return f"{info['cpu_model']}, {info['cpus']} CPUs ({flags}), load {info['load_avg_1m']:.1f}"

