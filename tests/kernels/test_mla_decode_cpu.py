"""MLA decode over a paged latent cache (`kernels.mla_decode_cpu`) against fp64 softmax attention over the
same latents, in both of vLLM's CPU value layouts (rows, and the AMX kernel's packed strips)."""

from __future__ import annotations

import pytest
import torch

from kernels.mla_decode_cpu import latent_decode_attention


def paged_cache(latents: list[torch.Tensor], block: int, dtype: torch.dtype, packed: bool,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache [pages, 1, block, 2r] holding each sequence's latents [len, r] as values on shuffled pages (the
    key rows and unused pages random), and its block table [n, max pages] (unused entries random too)."""
    r = latents[0].shape[1]
    needed = [(len(c) + block - 1) // block for c in latents]
    total = sum(needed) + 3
    cache = torch.randn(total, 2 * block, r, generator=generator).to(dtype)
    order = torch.randperm(total, generator=generator)
    table = torch.randint(0, total, (len(latents), max(needed)), generator=generator, dtype=torch.int32)
    used = 0
    for s, c in enumerate(latents):
        for p in range(needed[s]):
            page = int(order[used])
            used += 1
            table[s, p] = page
            rows = c[p * block: (p + 1) * block].to(dtype)
            values = cache[page, block:]  # [block, r]
            if packed:  # element (j, d) at ((d / 16) * (block / 2) + j / 2) * 32 + (d % 16) * 2 + j % 2
                strips = values.reshape(-1).view(r // 16, block // 2, 16, 2)
                full = torch.zeros(block, r, dtype=dtype)
                full[: len(rows)] = rows
                strips.copy_(full.view(block // 2, 2, r // 16, 16).permute(2, 0, 3, 1))
            else:
                values[: len(rows)] = rows
    return cache.view(total, 1, block, 2 * r), table


def reference(q: torch.Tensor, latents: list[torch.Tensor], scale: float) -> torch.Tensor:
    out = []
    for qs, c in zip(q.double(), latents, strict=True):
        weights = torch.softmax(scale * qs @ c.double().T, dim=-1)  # [H, len]
        out.append(weights @ c.double())
    return torch.stack(out)


# lengths: one token, inside one tile, across tiles and pages, a full page, many pages
@pytest.mark.parametrize("dtype,packed,tol", [(torch.float32, False, 2e-6), (torch.bfloat16, False, 1e-5),
                                              (torch.bfloat16, True, 1e-5)])
@pytest.mark.parametrize("block,r,H,lengths", [(32, 128, 8, [1, 5, 33]), (64, 32, 3, [64, 200, 130, 7]),
                                               (128, 128, 8, [1000, 129])])
def test_matches_softmax_attention_over_the_latents(cpu_threads: int, dtype: torch.dtype, packed: bool,
                                                    tol: float, block: int, r: int, H: int,
                                                    lengths: list[int]) -> None:
    generator = torch.Generator().manual_seed(block + r + sum(lengths))
    # latents and queries of a scale that makes the softmax far from uniform
    latents = [(torch.randn(n, r, generator=generator) * 2 + 0.5).to(dtype).float() for n in lengths]
    cache, table = paged_cache(latents, block, dtype, packed, generator)
    q = torch.randn(len(lengths), H, r, generator=generator)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    scale = r ** -0.5
    out = latent_decode_attention(q, cache, table, seq_lens, scale, packed)
    ref = reference(q, latents, scale)
    assert out.dtype == torch.float32 and out.shape == (len(lengths), H, r)
    # the latents are exact in the cache's dtype (rounded above), so only fp32 arithmetic differs
    assert ((out.double() - ref).norm() / ref.norm()).item() < tol
    torch.set_num_threads(1)
    assert torch.equal(latent_decode_attention(q, cache, table, seq_lens, scale, packed), out)


def test_pages_apart_in_a_padded_buffer() -> None:
    """A hybrid cache's attention pages sit in a buffer padded to the largest layer's page size."""
    generator = torch.Generator().manual_seed(3)
    latents = [torch.randn(n, 32, generator=generator) for n in (50, 17)]
    cache, table = paged_cache(latents, 32, torch.float32, False, generator)
    padded = torch.randn(cache.shape[0], cache[0].numel() + 40, generator=generator)
    padded[:, : cache[0].numel()] = cache.view(cache.shape[0], -1)
    spread = padded[:, : cache[0].numel()].view(cache.shape)
    q = torch.randn(2, 4, 32, generator=generator)
    out = latent_decode_attention(q, spread, table, torch.tensor([50, 17]), 0.2, False)
    ref = reference(q, latents, 0.2)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-6


def test_bf16_queries_and_a_longer_block_table() -> None:
    generator = torch.Generator().manual_seed(7)
    latents = [torch.randn(40, 64, generator=generator).bfloat16().float()]
    cache, table = paged_cache(latents, 32, torch.bfloat16, False, generator)
    wide = torch.cat([table, torch.zeros(1, 5, dtype=torch.int32)], dim=1)  # vLLM's table is as wide as the longest
    q = torch.randn(1, 4, 64, generator=generator)
    out = latent_decode_attention(q.bfloat16(), cache, wide.long(), torch.tensor([40]), 0.125, False)
    ref = reference(q.bfloat16().float(), latents, 0.125)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.parametrize("change,message", [
    (dict(cache=torch.zeros(4, 2, 32, 256)), "kv_cache must be"),
    (dict(cache=torch.zeros(4, 1, 32, 200)), "kv_cache must be"),
    (dict(cache=torch.zeros(4, 1, 32, 256, dtype=torch.float16)), "bf16 or fp32"),
    (dict(cache=torch.zeros(4, 1, 256, 32).transpose(2, 3)), "contiguous pages"),
    (dict(packed=True), "packed"),
    (dict(lens=torch.tensor([65])), "seq_lens must lie"),
    (dict(lens=torch.tensor([3, 4])), "seq_lens"),
])
def test_bad_input_is_refused(change: dict, message: str) -> None:
    args = dict(q=torch.randn(1, 2, 128), cache=torch.zeros(4, 1, 32, 256), table=torch.zeros(1, 2, dtype=torch.int32),
                lens=torch.tensor([3]), packed=False)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        latent_decode_attention(args["q"], args["cache"], args["table"], args["lens"], 0.1, args["packed"])
