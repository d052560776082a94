"""The project's small byte-level BPE tokenizer (trained by scripts/train_tokenizer.py, shipped here)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

TOKENIZER_DIR: Path = Path(__file__).resolve().parent

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_START, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"


def load_tokenizer() -> PreTrainedTokenizerBase:
    """Load the shipped tokenizer from disk (no network access)."""
    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)
