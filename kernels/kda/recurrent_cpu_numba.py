"""The compiled loops of `recurrent_cpu.py` (numba). Their signatures are declared: importing this module
compiles them once (about 2 s) or loads them from numba's on-disk cache, and an argument of another type
is an error rather than a second compile."""

from __future__ import annotations

import numpy as np
from numba import boolean, float32, int64, njit, void

from kernels.kda.common import L2NORM_EPS

_VEC = float32[::1]


@njit(void(float32[:, ::1], _VEC, _VEC, _VEC, _VEC, _VEC, _VEC, _VEC), cache=True, fastmath=True, nogil=True)
def _sweep(S, a, bk, err, c, f, ks, qs):  # pragma: no cover - compiled
    """S <- Diag(a) S + bk err^T, then ks = S^T c and qs = S^T f (c, f: the next token's decayed k, q)."""
    ks[:] = 0.0
    qs[:] = 0.0
    for i in range(S.shape[0]):
        ai, bi, ci, fi = a[i], bk[i], c[i], f[i]
        row = S[i]
        for j in range(row.shape[0]):
            s = ai * row[j] + bi * err[j]
            row[j] = s
            ks[j] += ci * s
            qs[j] += fi * s


_ROWS = float32[:, :, ::1]
_INDEX = int64[::1]


@njit(void(_ROWS, _ROWS, _ROWS, _ROWS, float32[:, ::1], float32, boolean, _INDEX, _INDEX, _INDEX,
           float32[:, :, :, ::1], _ROWS), cache=True, fastmath=True, nogil=True)
def kda_rows(q, k, v, decay, beta, scale, l2norm, starts, ends, slots, pool, o):  # pragma: no cover - compiled
    """q, k, decay [R, HV, K]; v [R, HV, V]; beta [R, HV] (rows = tokens); sequence n is rows
    starts[n] .. ends[n]-1 and continues pool[slots[n]] ([HV, K, V], updated in place); slots[n] < 0 skips
    it. o [R, HV, V] gets the outputs of the sequences' rows. With `l2norm`, q and k are divided by
    sqrt(|x|^2 + L2NORM_EPS) here (fla's in-kernel l2norm)."""
    HV, K = q.shape[1], q.shape[2]
    V = v.shape[2]
    ks = np.empty(V, np.float32)
    qs = np.empty(V, np.float32)
    err = np.empty(V, np.float32)
    a = np.empty(K, np.float32)  # the pending update's decay
    bk = np.empty(K, np.float32)  # the pending update's beta k
    c = np.empty(K, np.float32)
    f = np.empty(K, np.float32)
    for n in range(slots.shape[0]):
        if slots[n] < 0:
            continue
        for h in range(HV):
            S = pool[slots[n], h]
            a[:] = 1.0
            bk[:] = 0.0
            err[:] = 0.0
            for t in range(starts[n], ends[n]):
                rq = np.float32(1.0)
                rk = np.float32(1.0)
                if l2norm:
                    sq = np.float32(0.0)
                    sk = np.float32(0.0)
                    for i in range(K):
                        sq += q[t, h, i] * q[t, h, i]
                        sk += k[t, h, i] * k[t, h, i]
                    rq = np.float32(1.0) / np.sqrt(sq + np.float32(L2NORM_EPS))
                    rk = np.float32(1.0) / np.sqrt(sk + np.float32(L2NORM_EPS))
                for i in range(K):
                    c[i] = decay[t, h, i] * k[t, h, i] * rk
                    f[i] = decay[t, h, i] * q[t, h, i] * rq
                _sweep(S, a, bk, err, c, f, ks, qs)
                b = beta[t, h]
                qbk = np.float32(0.0)
                for i in range(K):
                    a[i] = decay[t, h, i]
                    bk[i] = b * k[t, h, i] * rk
                    qbk += q[t, h, i] * rq * bk[i]
                for j in range(V):
                    e = v[t, h, j] - ks[j]
                    err[j] = e
                    o[t, h, j] = scale * (qs[j] + qbk * e)
            for i in range(K):  # the last token's update
                for j in range(V):
                    S[i, j] = a[i] * S[i, j] + bk[i] * err[j]
