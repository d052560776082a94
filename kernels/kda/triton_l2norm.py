"""Row-wise L2 normalisation of q/k for the Triton path: y = x * rsqrt(sum(x^2) + eps), one pass each way
(the plain-torch version cost ~9 ms of a 33 ms fwd+bwd step at T=32K, H=32, K=128 on an H200)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kda.common import L2NORM_EPS


@triton.jit
def l2norm_fwd_kernel(x, y, rstd, R, eps, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m = (rows < R)[:, None] & (o_d < D)[None, :]
    off = rows.to(tl.int64)[:, None] * D + o_d[None, :]
    b_x = tl.load(x + off, mask=m, other=0.0).to(tl.float32)
    b_r = tl.rsqrt(tl.sum(b_x * b_x, 1) + eps)
    tl.store(y + off, (b_x * b_r[:, None]).to(y.dtype.element_ty), mask=m)
    tl.store(rstd + rows, b_r, mask=rows < R)


@triton.jit
def l2norm_bwd_kernel(y, rstd, dy, dx, R, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    """dx = r (dy - y (y . dy)), y the normalised rows."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m = (rows < R)[:, None] & (o_d < D)[None, :]
    off = rows.to(tl.int64)[:, None] * D + o_d[None, :]
    b_r = tl.load(rstd + rows, mask=rows < R, other=0.0)
    b_y = tl.load(y + off, mask=m, other=0.0).to(tl.float32)
    b_dy = tl.load(dy + off, mask=m, other=0.0).to(tl.float32)
    b_dx = b_r[:, None] * (b_dy - b_y * tl.sum(b_y * b_dy, 1)[:, None])
    tl.store(dx + off, b_dx.to(dx.dtype.element_ty), mask=m)


def _launch_shape(x: torch.Tensor) -> tuple[int, int, int, int]:
    D = x.shape[-1]
    R = x.numel() // D
    BD = triton.next_power_of_2(D)
    BR = max(1, min(64, 4096 // BD))
    return R, D, BD, BR


def l2norm_fwd(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y in x's dtype, rstd fp32 per row)."""
    x = x.contiguous()
    R, D, BD, BR = _launch_shape(x)
    y = torch.empty_like(x)
    rstd = torch.empty(R, dtype=torch.float32, device=x.device)
    l2norm_fwd_kernel[(triton.cdiv(R, BR),)](x, y, rstd, R, L2NORM_EPS, D=D, BD=BD, BR=BR)
    return y, rstd


def l2norm_bwd(y: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    R, D, BD, BR = _launch_shape(y)
    dx = torch.empty(y.shape, dtype=out_dtype, device=y.device)
    l2norm_bwd_kernel[(triton.cdiv(R, BR),)](y, rstd, dy.contiguous(), dx, R, D=D, BD=BD, BR=BR)
    return dx
