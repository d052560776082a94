"""The vLLM plugin's KDA layer functions, called outside vLLM with explicit state slots, against the HF
layer run over whole sequences. No vLLM needed: this same test runs on the GPU machine (Triton path)."""

from __future__ import annotations

import pytest
import torch

from model.config import TaperConfig
from model.layers.kda import KimiDeltaAttention
from model.vllm_plugin.kda_ops import (
    KDABatch,
    conv_state_shape,
    kda_forward_with_state,
    recurrent_state_shape,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = dict(rtol=1e-3, atol=1e-4) if DEVICE.type == "cuda" else dict(rtol=1e-4, atol=2e-5)
BF16_REL_TOL = 2e-2  # ||served - fp32 layer|| / ||fp32 layer|| with bf16 weights, activations and conv state

# Engine-like steps: (sequence, new tokens, state slot); decodes first, then prefills. Sequence 2's prompt
# is split over two steps (chunked prefill), sequence 3 starts while others decode, sequence 1's state
# moves to another slot before step 2 (as vLLM's prefix-cache alignment does), and in step 3 two turns
# continue with fewer new tokens than the conv window holds (W-1 = 3).
STEPS = [
    dict(num_decodes=0, entries=[(0, 5, 3), (1, 39, 0), (2, 64, 6)]),
    dict(num_decodes=2, entries=[(0, 1, 3), (1, 1, 0), (2, 26, 6), (3, 20, 1)]),
    dict(num_decodes=4, entries=[(0, 1, 3), (1, 1, 5), (2, 1, 6), (3, 1, 1)]),
    dict(num_decodes=1, entries=[(2, 1, 6), (1, 2, 5), (0, 6, 3), (3, 2, 1)]),
]
LENGTHS = [13, 43, 92, 23]


def _layer(gate: str) -> KimiDeltaAttention:
    torch.manual_seed(0)
    layer = KimiDeltaAttention(TaperConfig.preset("tiny", kda_gate=gate), layer_idx=0)
    layer.reset_gate_parameters()
    with torch.no_grad():  # non-trivial norm and conv weights, so every piece matters
        layer.o_norm.weight.uniform_(0.5, 1.5)
        for conv in (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d):
            conv.weight.uniform_(-0.6, 0.6)
    return layer.to(DEVICE).eval()


def _pool(num_slots: int, shape: tuple[int, ...], dtype: torch.dtype, paged: bool) -> torch.Tensor:
    """A random state pool [num_slots, *shape]; `paged`: each slot inside a larger page, as vLLM's hybrid cache
    lays them out (the slots lie apart)."""
    if not paged:
        return torch.randn(num_slots, *shape, device=DEVICE).to(dtype)
    size = int(torch.Size(shape).numel())
    pages = torch.randn(num_slots, size + 40, device=DEVICE).to(dtype)
    return pages[:, 8:8 + size].view(num_slots, *shape)


# (dtype, paged pools): fp32 as the CPU serves it; bf16 with an fp32 recurrent state and pools inside pages, as
# the GPU engine serves it (against the fp32 layer: bf16's rounding, not the HF layer's in bf16, is the bound).
CASES = [(torch.float32, False), (torch.float32, True)] + (
    [(torch.bfloat16, True)] if DEVICE.type == "cuda" else [])


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
@pytest.mark.parametrize(("dtype", "paged"), CASES)
def test_chunked_prefill_and_decode_on_state_slots_match_hf_layer(gate: str, dtype: torch.dtype,
                                                                   paged: bool) -> None:
    reference = _layer(gate)
    layer = _layer(gate).to(dtype)
    torch.manual_seed(1)
    seqs = [torch.randn(n, layer.q_proj.in_features, device=DEVICE) for n in LENGTHS]
    num_slots = 8
    # Stale garbage in the pools: fresh prefills must ignore it.
    conv = _pool(num_slots, conv_state_shape(layer), dtype, paged)
    rec = _pool(num_slots, recurrent_state_shape(layer), torch.float32, paged)
    done = [0] * len(seqs)
    slot_of: dict[int, int] = {}
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    for step in STEPS:
        entries = step["entries"]
        for i, _, slot in entries:
            if i in slot_of and slot_of[i] != slot:
                conv[slot], rec[slot] = conv[slot_of[i]].clone(), rec[slot_of[i]].clone()
                conv[slot_of[i]], rec[slot_of[i]] = torch.randn_like(conv[0]), torch.randn_like(rec[0])
            slot_of[i] = slot
        lens = [n for _, n, _ in entries]
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        batch = KDABatch(
            num_decodes=step["num_decodes"],
            query_start_loc=torch.tensor(starts, device=DEVICE, dtype=torch.int32),
            state_indices=torch.tensor([s for _, _, s in entries], device=DEVICE, dtype=torch.int32),
            has_initial_state=torch.tensor([done[i] > 0 for i, _, _ in entries], device=DEVICE),
        )
        batch.validate()
        x = torch.cat([seqs[i][done[i]:done[i] + n] for i, n, _ in entries]).to(dtype)
        padded = torch.cat([x, torch.randn(3, x.shape[1], device=DEVICE).to(dtype)])  # rows past the batch
        with torch.no_grad():
            y = kda_forward_with_state(layer, padded, conv, rec, batch)
        assert torch.equal(y[x.shape[0]:], torch.zeros_like(y[x.shape[0]:]))
        for (i, n, _), a in zip(entries, starts, strict=False):
            outs[i].append(y[a:a + n])
            done[i] += n
    assert done == LENGTHS
    for i, seq in enumerate(seqs):
        with torch.no_grad():
            ref, ref_conv, ref_rec = reference(seq.to(dtype).float()[None], output_states=True)
        if dtype == torch.float32:
            torch.testing.assert_close(torch.cat(outs[i]), ref[0], **TOL)
            torch.testing.assert_close(rec[slot_of[i]], ref_rec[0], **TOL)
            torch.testing.assert_close(conv[slot_of[i]], ref_conv[0], **TOL)
        else:  # bf16 activations and weights against the fp32 layer
            for got, want in ((torch.cat(outs[i]), ref[0]), (rec[slot_of[i]], ref_rec[0]),
                              (conv[slot_of[i]], ref_conv[0])):
                err = (got.float() - want).norm() / want.norm()
                assert err < BF16_REL_TOL, f"sequence {i}: relative error {err:.2e}"


def test_batch_validation_names_the_field() -> None:
    qsl = torch.tensor([0, 1, 5])
    with pytest.raises(ValueError, match="query_start_loc"):
        KDABatch(0, qsl, torch.tensor([0, 1, 2]), None).validate()
    with pytest.raises(ValueError, match="num_decodes"):
        KDABatch(2, qsl, torch.tensor([0, 1]), None).validate()
    with pytest.raises(ValueError, match="has_initial_state"):
        KDABatch(1, qsl, torch.tensor([0, 1]), torch.tensor([True])).validate()
