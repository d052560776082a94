"""Runs the Triton KDA kernels on CPU under TRITON_INTERPRET=1 (set before triton is imported) against
the naive reference; prints one JSON object of relative errors. Driven by test_kda_triton_interpret.py."""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from kda_inputs import make_inputs, rel_err  # noqa: E402

from kernels.attn_res import attn_res_mix, attn_res_mix_op  # noqa: E402
from kernels.kda import naive_recurrent_kda  # noqa: E402
from kernels.kda.triton_chunk import chunk_kda_fwd_op, chunk_kda_triton, config_key  # noqa: E402
from kernels.kda.triton_config import KDAKernelConfig  # noqa: E402
from kernels.kda.triton_recurrent import fused_recurrent_kda_triton  # noqa: E402
from kernels.short_conv import short_conv_silu, short_conv_silu_decode, short_conv_silu_op  # noqa: E402

GRAD_NAMES = ["q", "k", "v", "g", "beta", "initial_state", "dt_bias", "A_log"]


def chunk_case(B, T, H, HV, K, V, chunk, seed, config=None, lower_bound_given=False, **opts):
    x = make_inputs(B, T, H, HV, K, V, initial_state=True, seed=seed, **opts)
    kw = x.kwargs
    if lower_bound_given:  # precomputed g in [-2, 0]: the bound it keeps
        kw["lower_bound"] = -5.0
    names = [n for n in GRAD_NAMES[:6]] + [n for n in GRAD_NAMES[6:] if n in kw]
    leaves = [x.q, x.k, x.v, x.g, x.beta, kw["initial_state"]] + [kw[n] for n in GRAD_NAMES[6:] if n in kw]
    for t in leaves:
        t.requires_grad_(True)
    gen = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(B, T, HV, V, generator=gen)
    ds = torch.randn(kw["initial_state"].shape, generator=gen)
    o, s = chunk_kda_triton(
        *x.args(), scale=K**-0.5, initial_state=kw["initial_state"], output_final_state=True,
        use_qk_l2norm_in_kernel=kw["use_qk_l2norm_in_kernel"], use_gate_in_kernel=kw.get("use_gate_in_kernel", False),
        use_beta_sigmoid_in_kernel=kw.get("use_beta_sigmoid_in_kernel", False), lower_bound=kw.get("lower_bound"),
        A_log=kw.get("A_log"), dt_bias=kw.get("dt_bias"), cu_seqlens=kw.get("cu_seqlens"), chunk_size=chunk,
        config=config,
    )
    got = torch.autograd.grad((o * do).sum() + (s * ds).sum(), leaves)
    o_ref, s_ref = naive_recurrent_kda(*x.args(), output_final_state=True, **kw)
    ref = torch.autograd.grad((o_ref * do).sum() + (s_ref.float() * ds).sum(), leaves)
    out = {"o": rel_err(o.detach(), o_ref.detach()), "final_state": rel_err(s.detach(), s_ref.detach()),
           "finite": bool(torch.isfinite(o).all() and torch.isfinite(s).all())}
    out.update({f"d{n}": rel_err(a, b) for n, a, b in zip(names, got, ref, strict=True)})
    return out


PAGE_PAD = 24  # elements between two slots of a paged pool


def state_pool(slots, HV, K, V, gen, paged=False):
    """A random state pool [slots, HV, K, V]; `paged`: each slot in a page of its own with other data around it
    (as a serving engine's pages hold the conv state beside the recurrent one), and the pages' buffer."""
    if not paged:
        return torch.randn(slots, HV, K, V, generator=gen), None
    pages = torch.randn(slots, HV * K * V + PAGE_PAD, generator=gen)
    return pages[:, PAGE_PAD // 2:PAGE_PAD // 2 + HV * K * V].view(slots, HV, K, V), pages


def pad_untouched(pages, before_pages):
    """Whether the data between a paged pool's slots was left alone (True for an unpaged pool)."""
    if pages is None:
        return True
    H = PAGE_PAD // 2
    return bool(torch.equal(pages[:, :H], before_pages[:, :H]) and torch.equal(pages[:, -H:], before_pages[:, -H:]))


def decode_case(seed, config=None, paged=False):
    N, HV, slots = 4, 4, 6
    x = make_inputs(N, 1, 2, HV, 32, 16, gate="bounded", beta_logits=True, seed=seed)
    kw = {k: v for k, v in x.kwargs.items()}
    pool, pages = state_pool(slots, HV, 32, 16, torch.Generator().manual_seed(seed), paged)
    before_pages = None if pages is None else pages.clone()
    before = pool.clone()
    idx = torch.tensor([4, -1, 0, 2])
    o, final = fused_recurrent_kda_triton(
        *x.args(), scale=32**-0.5, initial_state=pool, output_final_state=False, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=kw["lower_bound"], A_log=None,
        dt_bias=kw["dt_bias"], cu_seqlens=None, ssm_state_indices=idx, inplace_final_state=True, config=config,
    )
    valid = idx >= 0
    o_ref, s_ref = naive_recurrent_kda(*(t[valid] for t in x.args()), initial_state=before[idx[valid]],
                                       output_final_state=True, **kw)
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[idx[valid]] = False
    return {"o": rel_err(o[valid], o_ref), "slots": rel_err(pool[idx[valid]], s_ref),
            "padded_zero": bool((o[~valid] == 0).all()),
            "others_untouched": bool(torch.equal(pool[untouched], before[untouched]))
            and pad_untouched(pages, before_pages), "returned_pool": final is pool}


def decode_varlen_case(seed, config=None):
    cu = [0, 1, 4, 6]
    x = make_inputs(1, 6, 1, 2, 32, 16, gate="unbounded", cu_seqlens=cu, seed=seed)
    kw = x.kwargs
    h0 = torch.randn(3, 2, 32, 16, generator=torch.Generator().manual_seed(seed))
    o, final = fused_recurrent_kda_triton(
        *x.args(), scale=32**-0.5, initial_state=h0.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=False, lower_bound=None, A_log=kw["A_log"],
        dt_bias=kw["dt_bias"], cu_seqlens=kw["cu_seqlens"], ssm_state_indices=None, inplace_final_state=False,
        config=config,
    )
    o_ref, s_ref = naive_recurrent_kda(*x.args(), initial_state=h0, output_final_state=True, **kw)
    return {"o": rel_err(o, o_ref), "final_state": rel_err(final, s_ref)}


def decode_step_case(seed, config, slots=True, inplace=True, with_state=True, paged=False):
    """The one-token-per-row decode kernel (recurrent_kda_step_kernel) against the fp64 recurrence: slots with a
    padded row, in place; or out of place with final states; or without an initial state; `paged`: the pool's
    slots apart in pages."""
    N, HV, n_slots = 5, 4, 7
    x = make_inputs(N, 1, 2, HV, 32, 16, gate="bounded", beta_logits=True, seed=seed)
    kw = dict(x.kwargs)
    gen = torch.Generator().manual_seed(seed)
    pool, pages = state_pool(n_slots if slots else N, HV, 32, 16, gen, paged)
    before, before_pages = pool.clone(), None if pages is None else pages.clone()
    idx = torch.tensor([4, -1, 0, 6, 2]) if slots else None
    o, final = fused_recurrent_kda_triton(
        *x.args(), scale=32**-0.5, initial_state=pool if with_state else None, output_final_state=not inplace,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        lower_bound=kw["lower_bound"], A_log=None, dt_bias=kw["dt_bias"], cu_seqlens=None, ssm_state_indices=idx,
        inplace_final_state=inplace, config=config,
    )
    valid = idx >= 0 if slots else torch.ones(N, dtype=torch.bool)
    rows = idx[valid] if slots else torch.arange(N)
    h0 = before[rows] if with_state else torch.zeros(int(valid.sum()), HV, 32, 16)
    o_ref, s_ref = naive_recurrent_kda(*(t[valid] for t in x.args()), initial_state=h0, output_final_state=True, **kw)
    res = {"o": rel_err(o[valid], o_ref), "padded_zero": bool((o[~valid] == 0).all())}
    if inplace:
        untouched = torch.ones(pool.shape[0], dtype=torch.bool)
        untouched[rows] = False
        res.update(state=rel_err(pool[rows], s_ref),
                   others_untouched=bool(torch.equal(pool[untouched], before[untouched]))
                   and pad_untouched(pages, before_pages))
    else:
        res.update(state=rel_err(final[valid], s_ref), others_untouched=bool(torch.equal(pool, before)),
                   padded_state_zero=bool((final[~valid] == 0).all()))
    return res


TMA = dict(decode_step_tma_min_bytes=0)  # the one-token kernel's TMA path at these small sizes


def decode_step_varlen_case(seed, config, cu, padded=1, inplace=True, paged=False):
    """The one-token kernel on [1, T, ...] inputs with cu_seqlens and T == N sequences, against the fp64
    recurrence: slots with a padded sequence; lengths other than 1 go through the kernel's token-by-token loop."""
    N, HV, T = len(cu) - 1, 4, cu[-1]
    x = make_inputs(1, T, 2, HV, 32, 16, gate="bounded", beta_logits=True, cu_seqlens=cu, seed=seed)
    kw = dict(x.kwargs)
    gen = torch.Generator().manual_seed(seed)
    pool, pages = state_pool(N + 2, HV, 32, 16, gen, paged)
    before, before_pages = pool.clone(), None if pages is None else pages.clone()
    idx = torch.randperm(N + 2, generator=gen)[:N]
    idx[padded] = -1
    o, final = fused_recurrent_kda_triton(
        *x.args(), scale=32**-0.5, initial_state=pool, output_final_state=not inplace, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=kw["lower_bound"], A_log=None,
        dt_bias=kw["dt_bias"], cu_seqlens=kw["cu_seqlens"], ssm_state_indices=idx, inplace_final_state=inplace,
        config=config,
    )
    kw.pop("initial_state", None)
    o_ref, s_ref = naive_recurrent_kda(*x.args(), initial_state=before[idx.clamp(min=0)],
                                       **{**kw, "output_final_state": True})
    valid = idx >= 0
    tok_valid = torch.repeat_interleave(valid, torch.tensor(cu[1:]) - torch.tensor(cu[:-1]))
    res = {"o": rel_err(o[0, tok_valid], o_ref[0, tok_valid]), "padded_zero": bool((o[0, ~tok_valid] == 0).all())}
    if inplace:
        untouched = torch.ones(pool.shape[0], dtype=torch.bool)
        untouched[idx[valid]] = False
        res.update(state=rel_err(pool[idx[valid]], s_ref[valid]),
                   others_untouched=bool(torch.equal(pool[untouched], before[untouched]))
                   and pad_untouched(pages, before_pages))
    else:
        res.update(state=rel_err(final[valid], s_ref[valid]), others_untouched=bool(torch.equal(pool, before)),
                   padded_state_zero=bool((final[~valid] == 0).all()))
    return res


def custom_op_case(seed):
    """The chunk op as torch.compile sees it: torch.library's opcheck (schema, fake shapes against the real
    outputs, autograd registration) with and without cu_seqlens, and a compiled function through the op
    (fullgraph: no graph break) against eager, value and gradients."""
    checks = {}
    for name, cu in (("fixed", None), ("varlen", [0, 7, 40])):
        x = make_inputs(1 if cu else 2, 40, 1, 2, 32, 16, initial_state=True, seed=seed, gate="bounded",
                        beta_logits=True, cu_seqlens=cu)
        q, k, v, g, beta = x.args()
        B, T, H, K = q.shape
        HV, V = v.shape[2:]
        args = (q.reshape(B * T, H, K), k.reshape(B * T, H, K), v.reshape(B * T, HV, V), g.reshape(B * T, HV, K),
                torch.sigmoid(beta).reshape(B * T, HV), None, x.kwargs["dt_bias"], x.kwargs["initial_state"],
                x.kwargs.get("cu_seqlens"), B, K**-0.5, True, True, x.kwargs["lower_bound"], True,
                config_key(KDAKernelConfig().for_inputs(torch.float32)))
        args = tuple(a.detach().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a
                     for a in args)
        torch.library.opcheck(chunk_kda_fwd_op, args,
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
        checks[f"opcheck_{name}"] = True
    x = make_inputs(2, 40, 1, 2, 32, 16, initial_state=True, seed=seed, gate="bounded", beta_logits=True)
    kw = x.kwargs

    def loss(q, k, v, g, beta, h0):
        o, s = chunk_kda_triton(q, k, v, g, beta, scale=32**-0.5, initial_state=h0, output_final_state=True,
                                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                use_beta_sigmoid_in_kernel=True, lower_bound=kw["lower_bound"], A_log=None,
                                dt_bias=kw["dt_bias"], cu_seqlens=None, chunk_size=64)
        return (o * torch.sigmoid(q[..., :1])).sum() + s.square().sum()

    leaves = [t.detach().clone().requires_grad_(True) for t in (*x.args(), kw["initial_state"])]
    eager = loss(*leaves)
    eager_grads = torch.autograd.grad(eager, leaves)
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")(*leaves)
    compiled_grads = torch.autograd.grad(compiled, leaves)
    checks["compiled_loss"] = rel_err(compiled.detach(), eager.detach())
    checks["compiled_grads"] = max(rel_err(a, b) for a, b in zip(compiled_grads, eager_grads, strict=True))
    return checks


def expanded_grads_case(seed):
    """Gradients of plain sums: autograd hands the op stride-0 (expanded) output gradients."""
    x = make_inputs(1, 70, 1, 2, 32, 16, initial_state=True, seed=seed, gate="bounded", beta_logits=True,
                    cu_seqlens=[0, 30, 70])
    kw = x.kwargs
    leaves = [t.detach().clone().requires_grad_(True) for t in (*x.args(), kw["initial_state"])]
    o, s = chunk_kda_triton(*leaves[:5], scale=32**-0.5, initial_state=leaves[5], output_final_state=True,
                            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                            lower_bound=kw["lower_bound"], A_log=None, dt_bias=kw["dt_bias"],
                            cu_seqlens=kw["cu_seqlens"], chunk_size=32)
    got = torch.autograd.grad(o.sum() + s.sum(), leaves)
    ref_leaves = [t.detach().clone().requires_grad_(True) for t in (*x.args(), kw["initial_state"])]
    ref_kw = {n: v for n, v in kw.items() if n != "initial_state"}
    o_ref, s_ref = naive_recurrent_kda(*ref_leaves[:5], initial_state=ref_leaves[5], output_final_state=True,
                                       **ref_kw)
    ref = torch.autograd.grad(o_ref.sum() + s_ref.sum(), ref_leaves)
    return {f"d{n}": rel_err(a, b) for n, a, b in zip(["q", "k", "v", "g", "beta", "initial_state"], got, ref,
                                                        strict=True)}


def no_grad_case(seed, chunk=32, config=None, gate="bounded", cu_seqlens=(0, 37, 70), T=70, K=32):
    """A forward without autograd skips the states and new values only the backward reads and, with bounded
    gates, runs the solve and w/u as one kernel (triton_chunk_infer.py): its
    output and final state equal those of a forward that saves them (to fp32 rounding; exactly with the
    separate kernels), and the fp64 reference's."""
    x = make_inputs(1, T, 1, 2, K, 16, initial_state=True, seed=seed, gate=gate, l2norm=gate != "precomputed",
                    cu_seqlens=list(cu_seqlens))
    kw = x.kwargs
    if gate == "precomputed":
        kw["lower_bound"] = -5.0

    def run():
        return chunk_kda_triton(
            *x.args(), scale=K**-0.5, initial_state=kw["initial_state"], output_final_state=True,
            use_qk_l2norm_in_kernel=kw["use_qk_l2norm_in_kernel"], use_gate_in_kernel=kw.get("use_gate_in_kernel", False),
            use_beta_sigmoid_in_kernel=False, lower_bound=kw.get("lower_bound"), A_log=kw.get("A_log"),
            dt_bias=kw.get("dt_bias"), cu_seqlens=kw.get("cu_seqlens"), chunk_size=chunk, config=config)

    with torch.no_grad():
        o_fast, s_fast = run()
    x.q.requires_grad_(True)
    o_saved, s_saved = run()
    x.q.requires_grad_(False)
    with torch.no_grad():
        o_ref, s_ref = naive_recurrent_kda(*x.args(), **{**kw, "output_final_state": True})
    return {"o_vs_saved": rel_err(o_fast, o_saved), "state_vs_saved": rel_err(s_fast, s_saved),
            "o_vs_ref": rel_err(o_fast, o_ref), "state_vs_ref": rel_err(s_fast, s_ref)}


def attn_res_reference(candidates, gamma, query, eps):
    """Block AttnRes as model/layers/attn_res.py computes it on CPU, in fp64."""
    stacked = torch.stack(candidates).double()
    normed = stacked * torch.rsqrt(stacked.pow(2).mean(-1, keepdim=True) + eps)
    weights = torch.softmax((normed * (gamma.double() * query.double())).sum(-1), dim=0)
    return (weights.unsqueeze(-1) * stacked).sum(0)


def attn_res_case(seed):
    """The fused AttnRes mix and its backward (candidates, gamma and the query) against the fp64 reference:
    token counts that leave a partial block, widths that leave a partial chunk (d=300: 256 + 44) or fit one
    (d=96), 1 to 8 candidates, and more token blocks than one (the key gradient's partial sums)."""
    torch.manual_seed(seed)
    checks = {}
    for n, shape, d in ((1, (2, 37), 96), (3, (2, 37), 300), (5, (70,), 96), (8, (1, 33), 40)):
        cands = [torch.randn(*shape, d) * (0.5 + i) for i in range(n)]
        gamma, query = torch.rand(d) + 0.5, torch.randn(d) * 0.3
        weight = torch.randn(*shape, d)
        leaves = [t.clone().requires_grad_(True) for t in (*cands, gamma, query)]
        out = attn_res_mix(leaves[:-2], leaves[-2], leaves[-1], 1e-6)
        got = torch.autograd.grad((out * weight).sum(), leaves)
        ref_leaves = [t.double().requires_grad_(True) for t in (*cands, gamma, query)]
        ref = attn_res_reference(ref_leaves[:-2], ref_leaves[-2], ref_leaves[-1], 1e-6)
        want = torch.autograd.grad((ref * weight.double()).sum(), ref_leaves)
        checks[f"n{n}_d{d}_out"] = rel_err(out, ref)
        checks[f"n{n}_d{d}_grads"] = max(rel_err(a, b) for a, b in zip(got, want, strict=True))
    cands = [torch.randn(3, 5, 40) for _ in range(3)]
    torch.library.opcheck(attn_res_mix_op, ([c.requires_grad_(True) for c in cands],
                                            torch.randn(40).requires_grad_(True), torch.randn(40).requires_grad_(True),
                                            1e-6),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    checks["opcheck"] = True
    return checks


def short_conv_reference(x, weight):
    """SiLU(causal depthwise conv) with zero history, in fp64: F.conv1d over the left-padded sequence."""
    W = weight.shape[-1]
    padded = torch.nn.functional.pad(x.double().transpose(1, 2), (W - 1, 0))
    y = torch.nn.functional.conv1d(padded, weight.double(), groups=x.shape[-1])
    return torch.nn.functional.silu(y).transpose(1, 2)


def short_conv_case(seed):
    """The fused short conv + SiLU and its backward (input and weight) against the fp64 reference: 1 to 4 taps,
    sequences shorter than the taps, token counts that leave a partial tile and several time chunks per sequence
    (the weight gradient's partial sums), output widths that share a channel block or not, an input that is a
    column slice of a wider tensor; then opcheck and the op under torch.compile (fullgraph) against eager."""
    import kernels.short_conv as sc

    torch.manual_seed(seed)
    checks = {}
    saved = sc.FWD_LAUNCH, sc.BWD_LAUNCH, sc.BWD_TOKENS
    sc.FWD_LAUNCH, sc.BWD_LAUNCH, sc.BWD_TOKENS = (8, 16, 1), (8, 16, 1), 16
    cases = (((2, 37), [16, 16, 24], 4), ((1, 70), [8, 8, 8], 3), ((3, 5), [4, 12, 20], 2), ((1, 2), [3, 3, 3], 4),
             ((2, 19), [16, 16, 16], 1))
    for (B, T), split, W in cases:
        C = sum(split)
        wide = torch.randn(B, T, C + 8)
        weight = torch.randn(C, 1, W)
        leaves = [wide.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
        outs = short_conv_silu(leaves[0][..., :C], leaves[1], split)
        probes = [torch.randn_like(o) for o in outs]
        got = torch.autograd.grad(sum((o * p).sum() for o, p in zip(outs, probes, strict=True)), leaves)
        ref_leaves = [wide[..., :C].double().requires_grad_(True), weight.double().requires_grad_(True)]
        ref = short_conv_reference(*ref_leaves)
        want = torch.autograd.grad((ref * torch.cat(probes, -1).double()).sum(), ref_leaves)
        name = f"B{B}_T{T}_W{W}_C{C}"
        checks[f"{name}_out"] = rel_err(torch.cat(outs, -1), ref)
        checks[f"{name}_dx"] = rel_err(got[0][..., :C], want[0])
        checks[f"{name}_dw"] = rel_err(got[1], want[1])
        checks[f"{name}_slice_grad_zero"] = float(got[0][..., C:].abs().max())
        assert all(o.is_contiguous() for o in outs)
    x, weight = torch.randn(2, 21, 24, requires_grad=True), torch.randn(24, 1, 4, requires_grad=True)
    torch.library.opcheck(short_conv_silu_op, (x, weight, [8, 8, 8]),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    checks["opcheck"] = True

    def loss(x, weight):
        q, k, v = short_conv_silu(x, weight, [8, 8, 8])
        return (q * 1.5 + k * k + v.sin()).sum()

    eager_loss = loss(x, weight)
    eager = torch.autograd.grad(eager_loss, [x, weight])
    compiled_loss = torch.compile(loss, backend="aot_eager", fullgraph=True)(x, weight)
    compiled = torch.autograd.grad(compiled_loss, [x, weight])
    checks["compiled_loss"] = rel_err(compiled_loss, eager_loss)
    checks["compiled_grads"] = max(rel_err(a, b) for a, b in zip(compiled, eager, strict=True))
    sc.FWD_LAUNCH, sc.BWD_LAUNCH, sc.BWD_TOKENS = saved
    return checks


def short_conv_decode_case(seed):
    """The decode step of the conv over a pool of states whose slots lie apart in pages, against the fp64 window
    sum: rows of live slots (in no order), a padded row (slot -1), 1 and 3 state inputs, channel blocks that leave a
    partial one."""
    import kernels.short_conv as sc

    torch.manual_seed(seed)
    checks = {}
    saved, sc.DECODE_BLOCK_C = sc.DECODE_BLOCK_C, 32
    for W, C in ((4, 70), (2, 40)):
        pages = torch.randn(6, C * (W - 1) + 24)
        pool = pages[:, 8:8 + C * (W - 1)].view(6, C, W - 1)
        before = pages.clone()
        slots = torch.tensor([3, -1, 0, 5], dtype=torch.int32)
        x, weight = torch.randn(4, C), torch.randn(C, 1, W)
        y = short_conv_silu_decode(x, weight, pool, slots)
        live = [i for i, s in enumerate(slots.tolist()) if s >= 0]
        window = torch.cat([before[:, 8:8 + C * (W - 1)].view(6, C, W - 1)[slots[live].long()].double(),
                            x[live].double()[:, :, None]], dim=-1)  # [live, C, W]
        want = torch.nn.functional.silu((window * weight.double().squeeze(1)).sum(-1))
        checks[f"W{W}_out"] = rel_err(y[live], want)
        checks[f"W{W}_state"] = rel_err(pool[slots[live].long()], window[:, :, 1:])
        checks[f"W{W}_padded_zero"] = float(y[1].abs().max())
        untouched = [s for s in range(6) if s not in slots.tolist()]
        margins = torch.ones_like(pages, dtype=torch.bool)
        margins[:, 8:8 + C * (W - 1)] = False
        checks[f"W{W}_others_untouched"] = float(max((pages[untouched] - before[untouched]).abs().max(),
                                                     (pages[margins] - before[margins]).abs().max()))
    sc.DECODE_BLOCK_C = saved
    return checks


def main() -> None:
    results = {
        "bounded": chunk_case(2, 45, 1, 2, 32, 16, 32, 1, gate="bounded", beta_logits=True),
        "unbounded_varlen": chunk_case(1, 70, 1, 2, 32, 16, 32, 2, gate="unbounded", cu_seqlens=[0, 7, 40, 70]),
        # value tiles of 16: the w/u and backward-inter loops over V take two steps
        "precomputed": chunk_case(1, 40, 2, 2, 16, 32, 32, 3, gate="precomputed", l2norm=False,
                                  config=KDAKernelConfig(block_v=16)),
        # every gate at the bound: the diagonal-block factors reach e^75..e^80, still finite
        "at_bound_chunk64": chunk_case(1, 64, 1, 1, 16, 16, 64, 4, gate="bounded", f_shift=30.0),
        # short last chunks of varlen sequences; the gate kernels and backward inter on two K slices
        "varlen_short_chunks": chunk_case(1, 150, 1, 2, 32, 16, 64, 7, gate="bounded", cu_seqlens=[0, 37, 130, 150],
                                          config=KDAKernelConfig(gate_block_k=16, bwd_inter_block_k=16)),
        # the backward-intra kernel on all of K in one program (the default splits K=32 in two)
        "bwd_intra_whole_k": chunk_case(1, 70, 1, 2, 32, 16, 32, 8, gate="bounded", cu_seqlens=[0, 37, 70],
                                        config=KDAKernelConfig(bwd_intra_k_split=1)),
        # a precomputed g with its promised lower bound: the all-tl.dot path without the in-kernel gate, 4 x 16 rows
        "precomputed_bounded": chunk_case(1, 100, 2, 2, 16, 32, 64, 15, gate="precomputed", l2norm=False,
                                          lower_bound_given=True),
        # the general kernel (one program per unit) on rows of one token; the one-token kernel is the default there
        "decode_slots": decode_case(5, KDAKernelConfig(decode_step=False)),
        "decode_varlen": decode_varlen_case(6),
        # value tiles of 8: two programs per head
        "decode_slots_bv8": decode_case(5, KDAKernelConfig(decode_block_v=8, decode_step=False)),
        # slots apart in pages, as vLLM's hybrid cache lays them out: the general kernel, the one-token kernel
        # (pointer loads: TMA needs a contiguous pool) and its token-by-token loop for other lengths
        "decode_slots_paged": decode_case(7, KDAKernelConfig(decode_step=False), paged=True),
        "decode_step_slots_paged": decode_step_case(27, KDAKernelConfig(**TMA), paged=True),
        "decode_step_varlen_mixed_paged": decode_step_varlen_case(28, KDAKernelConfig(), [0, 0, 2, 3, 3, 5],
                                                                  padded=4, paged=True),
        "decode_varlen_bv8": decode_varlen_case(6, KDAKernelConfig(decode_block_v=8)),
        # the persistent one-token decode kernel: pointer loads in two value tiles; TMA descriptors (the default);
        # out of place, without slots, without an initial state
        "decode_step_slots": decode_step_case(18, KDAKernelConfig(decode_step_tma=False, decode_step_block_v=8)),
        "decode_step_slots_tma": decode_step_case(19, KDAKernelConfig(**TMA)),
        "decode_step_out_of_place": decode_step_case(20, KDAKernelConfig(**TMA), inplace=False),
        "decode_step_no_slots": decode_step_case(21, KDAKernelConfig(), slots=False, inplace=False),
        "decode_step_no_state": decode_step_case(22, KDAKernelConfig(), slots=False, inplace=False, with_state=False),
        # cu_seqlens over as many tokens as sequences: one token each (TMA and pointer loads, two value tiles), or
        # lengths 0 and 2 among them (the kernel's token-by-token loop), in place and out of place
        "decode_step_varlen_ones": decode_step_varlen_case(23, KDAKernelConfig(**TMA), [0, 1, 2, 3, 4, 5]),
        "decode_step_varlen_ones_bv8": decode_step_varlen_case(24, KDAKernelConfig(decode_step_block_v=8),
                                                               [0, 1, 2, 3, 4, 5]),
        "decode_step_varlen_mixed": decode_step_varlen_case(25, KDAKernelConfig(**TMA), [0, 0, 2, 3, 3, 5],
                                                            padded=4),
        "decode_step_varlen_mixed_out": decode_step_varlen_case(26, KDAKernelConfig(), [0, 2, 2, 3, 5, 5],
                                                                inplace=False),
        "custom_op": custom_op_case(9),
        "expanded_grads": expanded_grads_case(10),
        "attn_res": attn_res_case(11),
        "short_conv": short_conv_case(13),
        "short_conv_decode": short_conv_decode_case(14),
        "no_grad": no_grad_case(12),
        # chunks of 4 sub-blocks with short ones, the w/u columns in two slices, the scores grid row blocks first
        "no_grad_chunk64": no_grad_case(16, 64, KDAKernelConfig(infer_wu_block=16, scores_row_block_first=True),
                                        cu_seqlens=(0, 37, 130, 150), T=150),
        "no_grad_precomputed": no_grad_case(17, 64, gate="precomputed", cu_seqlens=(0, 100), T=100, K=16),
        "no_grad_separate": no_grad_case(12, config=KDAKernelConfig(infer_kernels=False)),
        # Akk's blocks above the diagonal written, as the training path does
        "no_grad_chunk64_upper_akk": no_grad_case(16, 64, KDAKernelConfig(infer_skip_upper_akk=False),
                                                  cu_seqlens=(0, 37, 130, 150), T=150),
    }
    print(json.dumps(results))


if __name__ == "__main__":
    main()
