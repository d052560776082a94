"""How deep a JSON text nests, measured before it is parsed: Python's parser recurses once per level, so a
100k-deep body ends in RecursionError, not in the ValueError callers handle. Request bodies (the API's
middleware) and task-file lines are measured first and refused past the operator's depth."""

from __future__ import annotations

import re

DEFAULT_MAX_DEPTH = 64
# A JSON string (what may hold brackets without nesting anything); every other byte but the four brackets goes.
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_OPEN = frozenset(b"[{")


def nesting_exceeds(raw: bytes, max_depth: int) -> bool:
    """Whether the arrays and objects of `raw` nest deeper than `max_depth` (exact for valid JSON; for text that
    is not, brackets outside well-formed strings count, so what a parser would recurse into is never missed)."""
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        return False
    depth = 0
    for b in _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS):
        if b in _OPEN:
            depth += 1
            if depth > max_depth:
                return True
        else:
            depth -= 1
    return False
