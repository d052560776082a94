"""The KDA-hybrid Stable-LatentMoE causal LM: config, layers, HF model, tokenizer and the vLLM plugin.

Importing `model` registers the "taper" architecture with AutoConfig / AutoModel / AutoModelForCausalLM.
"""

from model.cache import TaperCache
from model.config import TaperConfig
from model.modeling import TaperForCausalLM, TaperModel

__all__ = ["TaperCache", "TaperConfig", "TaperForCausalLM", "TaperModel"]
