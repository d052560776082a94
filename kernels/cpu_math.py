"""Scalar helpers that the compiled CPU loops (numba) inline: a vectorisable exp, and bf16 <-> fp32 through
the values' bits. numba's np.exp calls libm once per value (~16 ns on an AVX2 CPU); inside a loop these
compile to packed instructions.

numba caches each loop with its inlined helpers and checks only the loop's own file for changes: after
editing this file, delete the callers' cache files (`__pycache__/*.nbi`, `*.nbc`) or they keep the old code."""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

# numpy's error model: a division by zero gives inf instead of raising, and without that check on every
# division LLVM can vectorise the loops that divide
COMPILE = dict(cache=True, fastmath=True, nogil=True, error_model="numpy")

# exp(x) = 2^k e^f with k the integer nearest x / ln 2 and f = x - k ln 2 (|f| <= ln2 / 2), e^f by its Taylor
# polynomial to degree 7 (relative error < 1e-8), 2^k built in the float's exponent bits. ln 2 is split in two
# (Cody-Waite): k * LN2_HI is exact in fp32, so f keeps its precision even where |x| is large.
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI, _LN2_LO = np.float32(0.693359375), np.float32(-2.12194440e-4)


@njit(inline="always", **COMPILE)
def exp_parts(x):  # pragma: no cover - compiled
    """exp(x) = p * 2^k for x clamped to [-87, 87]: p, and 2^k's float bits (the caller stores them in an int32
    array and reads them back through a float32 view, which LLVM turns into a register bitcast)."""
    x = min(max(x, np.float32(-87.0)), np.float32(87.0))
    k = np.floor(x * _LOG2E + np.float32(0.5))
    f = (x - k * _LN2_HI) - k * _LN2_LO
    p = np.float32(1.0) + f * (np.float32(1.0) + f * (np.float32(0.5) + f * (np.float32(1.0 / 6.0) + f * (
        np.float32(1.0 / 24.0) + f * (np.float32(1.0 / 120.0) + f * (np.float32(1.0 / 720.0) + f * np.float32(
            1.0 / 5040.0)))))))
    return p, (np.int32(k) + np.int32(127)) << np.int32(23)


@njit(inline="always", **COMPILE)
def bf16_to_f32_bits(value):  # pragma: no cover - compiled
    """The fp32 bits of a bf16 value given as its int16 bits (bf16 is the top half of the fp32)."""
    return np.int32(value) << np.int32(16)


@njit(inline="always", **COMPILE)
def f32_bits_to_bf16(bits):  # pragma: no cover - compiled
    """The bf16 (int16 bits) nearest to an fp32 given as its int32 bits, ties to even."""
    return np.int16((bits + np.int32(0x7FFF) + ((bits >> np.int32(16)) & np.int32(1))) >> np.int32(16))


@njit(inline="always", **COMPILE)
def load_row(values, bf16_bits, from_bf16, r, out, bits):  # pragma: no cover - compiled
    """out <- row r of `values` (fp32) or, with from_bf16, of `bf16_bits` (bf16 as int16 bits); bits: int32
    scratch of out's length."""
    if from_bf16:
        for c in range(out.shape[0]):
            bits[c] = bf16_to_f32_bits(bf16_bits[r, c])
        as_float = bits.view(np.float32)
        for c in range(out.shape[0]):
            out[c] = as_float[c]
    else:
        for c in range(out.shape[0]):
            out[c] = values[r, c]


@njit(inline="always", **COMPILE)
def store_row(row, values, bf16_bits, to_bf16, r, bits):  # pragma: no cover - compiled
    """Row r of `values` (fp32) or, with to_bf16, of `bf16_bits` (rounded to nearest even) <- row; bits:
    int32 scratch of row's length."""
    if to_bf16:
        as_float = bits.view(np.float32)
        for c in range(row.shape[0]):
            as_float[c] = row[c]
        for c in range(row.shape[0]):
            bf16_bits[r, c] = f32_bits_to_bf16(bits[c])
    else:
        for c in range(row.shape[0]):
            values[r, c] = row[c]


NO_F32 = np.empty((0, 0), np.float32)
NO_BF16 = np.empty((0, 0), np.int16)


def f32_or_bf16_bits(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray, bool]:
    """A 2-d CPU tensor as the compiled loops take it: (fp32 values, bf16 bits, is_bf16), the unused one
    empty. bf16 stays where it lies (any strides), read as its int16 bits; other dtypes are cast to fp32."""
    if x.requires_grad:  # (a decode step calls this a few times per layer: no needless tensor ops)
        x = x.detach()
    if x.dtype == torch.bfloat16:
        return NO_F32, x.view(torch.int16).numpy(), True
    return (x if x.dtype == torch.float32 else x.float()).numpy(), NO_BF16, False


def empty_f32_or_bf16(rows: int, cols: int, bf16: bool) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """A new [rows, cols] CPU tensor for a compiled loop to fill, bf16 or fp32, with its arrays as
    `f32_or_bf16_bits` gives them: allocated by numpy, so no tensor op hands it over."""
    if bf16:
        bits = np.empty((rows, cols), np.int16)
        return torch.from_numpy(bits).view(torch.bfloat16), NO_F32, bits
    values = np.empty((rows, cols), np.float32)
    return torch.from_numpy(values), values, NO_BF16
