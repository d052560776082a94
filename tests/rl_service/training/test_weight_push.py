"""Weights pushed to the rollout engines travel out of band (zero-copy in Ray's object store, which pickles
with protocol 5 and keeps the out-of-band buffers) and arrive as plain, equal torch tensors. Through a real
Ray pool into a real engine they are exercised by tests/rl_service/training/test_job.py (the engine's logprobs
match the learner's after every push)."""

from __future__ import annotations

import pickle

import torch

from rl_service.training.learner.weight_push import ShippedTensor, shippable_state_dict


def _tiny_taper():
    from model import TaperConfig, TaperForCausalLM

    torch.manual_seed(0)
    return TaperForCausalLM(TaperConfig.preset("tiny")).float()


def test_the_payload_travels_out_of_band_and_comes_back_equal() -> None:
    model = _tiny_taper()
    state = shippable_state_dict(model)
    assert all(type(v) is ShippedTensor for v in state.values())
    buffers: list[pickle.PickleBuffer] = []
    in_band = pickle.dumps(state, protocol=5, buffer_callback=buffers.append)
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    assert sum(b.raw().nbytes for b in buffers) == nbytes
    assert len(in_band) < nbytes / 20  # names and headers only: the weights themselves are not copied in band
    back = pickle.loads(in_band, buffers=buffers)
    for k, v in model.state_dict().items():
        assert type(back[k]) is torch.Tensor and back[k].dtype == v.dtype
        torch.testing.assert_close(back[k], v, rtol=0, atol=0, msg=k)
    # a plain state dict, for comparison, is copied in band whole
    assert len(pickle.dumps({k: v.detach() for k, v in model.state_dict().items()}, protocol=5,
                            buffer_callback=lambda b: None)) > nbytes


def test_engine_dtype_push_keeps_balancing_biases_fp32() -> None:
    model = _tiny_taper()
    state = shippable_state_dict(model, torch.bfloat16)
    biases = [k for k in state if k.endswith("bias_correction")]
    assert biases and all(state[k].dtype == torch.float32 for k in biases)
    weights = [k for k in state if not k.endswith("bias_correction")]
    assert all(state[k].dtype == torch.bfloat16 for k in weights)
    back = pickle.loads(pickle.dumps(state, protocol=5))
    for k in weights:
        assert type(back[k]) is torch.Tensor and back[k].dtype == torch.bfloat16
        torch.testing.assert_close(back[k], model.state_dict()[k].to(torch.bfloat16), rtol=0, atol=0, msg=k)

