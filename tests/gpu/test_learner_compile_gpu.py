"""The learner's compiled step (`algorithm.compile_layers: auto` on a CUDA device: the layer stack as one graph,
shapes dynamic) against its eager step, on the same fp32 master weights under bf16 autocast: the `small` preset
with random weights, micro-batches of several shapes with right padding and masked tokens."""

from __future__ import annotations

import copy
import random

import torch

from model.config import TaperConfig
from model.modeling import TaperForCausalLM
from rl_service.training.learner import Learner, LearnerConfig, LossNorm, PolicySample

# Two bf16 computations of the same step (fused kernels round differently), against their own size.
LOSS_REL_TOL = 2e-2
GRAD_REL_TOL = 5e-2


def _samples(n: int, prompt: int, completion: int, vocab: int, seed: int) -> list[PolicySample]:
    """Random samples of lengths up to the given ones (so the micro-batch pads), the last quarter of every other
    completion masked out, random advantages."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p, c = rng.randint(prompt // 2, prompt), rng.randint(completion // 2, completion)
        mask = [1] * c
        if i % 2:
            mask[-(c // 4):] = [0] * (c // 4)
        out.append(PolicySample(prompt_ids=[rng.randrange(3, vocab) for _ in range(p)],
                                completion_ids=[rng.randrange(3, vocab) for _ in range(c)], loss_mask=mask,
                                advantages=[rng.gauss(0, 1) for _ in range(c)],
                                engine_logprobs=[-3.0 + rng.gauss(0, 0.1) for _ in range(c)]))
    return out


def _pass(learner: Learner, samples: list[PolicySample]) -> tuple[float, torch.Tensor]:
    """One forward + backward over the samples: the loss and every gradient as one fp32 vector."""
    learner.optimizer.zero_grad(set_to_none=True)
    metrics = learner.accumulate(learner.micro_batches(samples, LossNorm.of(samples)))
    grads = [p.grad.detach().float().flatten() for p in learner.model.parameters() if p.grad is not None]
    return metrics["loss"], torch.cat(grads)


def test_compiled_step_matches_eager_and_new_shapes_reuse_the_graph() -> None:
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    config = TaperConfig.preset("small")
    eager_model = TaperForCausalLM(config).cuda()
    compiled_model = copy.deepcopy(eager_model)
    cfg = LearnerConfig(learning_rate=1e-5, micro_batch_tokens=4 * 2048)
    eager = Learner(eager_model, cfg.model_copy(update={"compile_layers": "none"}))
    compiled = Learner(compiled_model, cfg)
    assert (eager.compiled_layers, compiled.compiled_layers) == (None, "stack")
    graphs = []
    for seed, (n, prompt, completion) in enumerate([(4, 300, 1200), (6, 64, 500), (3, 900, 1100)]):
        samples = _samples(n, prompt, completion, config.vocab_size, seed)
        loss_e, grad_e = _pass(eager, samples)
        loss_c, grad_c = _pass(compiled, samples)
        assert abs(loss_c - loss_e) <= LOSS_REL_TOL * abs(loss_e), (seed, loss_c, loss_e)
        rel = float((grad_c - grad_e).norm() / grad_e.norm())
        assert rel <= GRAD_REL_TOL, (seed, rel)
        graphs.append(counters["stats"]["unique_graphs"])
    # compiled with dynamic shapes: the second and third batch shapes compile nothing new
    assert graphs[0] > 0 and graphs[1] == graphs[0] == graphs[2], graphs
