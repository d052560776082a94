"""Block-AttnRes mix followed by the sub-layer's RMSNorm, as one compiled CPU loop (numba) for serving steps
of a few tokens, where the torch form's ~25 small ops per sub-layer cost more than their arithmetic. The math
is `model.layers.attn_res.BlockAttnRes` then `RMSNorm` (the reference the tests compare against), in fp32:

    s_i = <V_i, key> / sqrt(mean(V_i^2) + eps),  w = softmax(s),  m = sum_i w_i V_i,
    out = m / sqrt(mean(m^2) + norm_eps) * norm_weight,           with key = gamma * w_query.

The signature is declared: importing compiles it once or loads it from numba's on-disk cache."""

from __future__ import annotations

import numpy as np
from numba import float32, njit, void


@njit(void(float32[:, :, ::1], float32[::1], float32, float32[::1], float32, float32[:, ::1]),
      cache=True, fastmath=True, nogil=True, error_model="numpy")  # numpy's: no per-division zero check
def attn_res_rmsnorm_rows(candidates, key, eps, norm_weight, norm_eps, out):  # pragma: no cover - compiled
    """candidates [N, T, d] -> out [T, d]: each token's depth mix, RMS-normalised and scaled."""
    N, T, d = candidates.shape
    scores = np.empty(N, np.float32)
    mixed = np.empty(d, np.float32)
    for t in range(T):
        top = np.float32(-np.inf)
        for i in range(N):
            sq = np.float32(0.0)
            dot = np.float32(0.0)
            for j in range(d):
                x = candidates[i, t, j]
                sq += x * x
                dot += x * key[j]
            scores[i] = dot / np.sqrt(sq / d + eps)
            top = max(top, scores[i])
        total = np.float32(0.0)
        for i in range(N):
            scores[i] = np.exp(scores[i] - top)
            total += scores[i]
        for j in range(d):
            mixed[j] = 0.0
        for i in range(N):
            w = scores[i] / total
            for j in range(d):
                mixed[j] += w * candidates[i, t, j]
        sq = np.float32(0.0)
        for j in range(d):
            sq += mixed[j] * mixed[j]
        r = np.float32(1.0) / np.sqrt(sq / d + norm_eps)
        for j in range(d):
            out[t, j] = mixed[j] * r * norm_weight[j]
