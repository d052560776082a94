"""The KDA-hybrid Stable-LatentMoE causal LM: config, layers, HF model, tokenizer and the vLLM plugin."""
