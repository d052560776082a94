"""Token ids -> the text of each token, for the trajectory viewer's token strip (hover shows mask and logprob).

Jobs use the project's shipped tokenizer unless they start from a checkpoint directory that carries its own
`tokenizer.json`; either is loaded once and cached."""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlparse

MAX_IDS = 200_000


@lru_cache(maxsize=8)
def _tokenizer(path: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def tokenizer_file(checkpoint: str | None) -> Path:
    """The tokenizer.json of a job: its checkpoint's when it has one, else the shipped one."""
    if checkpoint:
        local = Path(urlparse(checkpoint).path if checkpoint.startswith("file://") else checkpoint)
        candidate = local / "tokenizer.json"
        if candidate.is_file():
            return candidate
    # found without importing `model` (its import pulls in torch and transformers)
    spec = importlib.util.find_spec("model")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the `model` package is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "tokenizer" / "tokenizer.json"


def token_pieces(ids: list[int], checkpoint: str | None = None) -> dict[int, str]:
    """The text of each distinct id (special tokens included; a byte that is only part of a character shows as
    U+FFFD). Raises ValueError naming `ids` for ids outside the vocabulary."""
    if len(ids) > MAX_IDS:
        raise ValueError(f"ids: at most {MAX_IDS} ids per request (got {len(ids)})")
    tok = _tokenizer(str(tokenizer_file(checkpoint)))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    out: dict[int, str] = {}
    for i in set(ids):
        if not 0 <= i < vocab:
            raise ValueError(f"ids: {i} is outside the vocabulary (0..{vocab - 1})")
        out[i] = tok.decode([i], skip_special_tokens=False)
    return out
