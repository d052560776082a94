"""Host paths stay in the control plane: text tenants read (events, a job's error and warning) shows a path
under one of the service's roots (its data dir, a job's work dir, the installed code and interpreter) as
`…/` and what follows, never where it lies. Checkpoints and files are named by ids at the source; this is the
second line for text the service does not write itself (a traceback, an exception's message)."""

from __future__ import annotations

import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path
from typing import Any

_CODE_ROOTS = tuple(dict.fromkeys(str(Path(p).resolve()) for p in (
    sys.prefix, sys.base_prefix, sysconfig.get_paths()["stdlib"], Path(__file__).resolve().parents[3])))


def hide_host_paths(value: Any, roots: Iterable[str | Path] = ()) -> Any:
    """`value` (a string, or dicts and lists of them) with every path under `roots` or the code's roots hidden."""
    names = {str(r).rstrip("/") for r in (*roots, *_CODE_ROOTS)} | {str(Path(r).resolve()) for r in roots}
    return _hide(value, sorted((n for n in names if n), key=len, reverse=True))


def _hide(value: Any, roots: list[str]) -> Any:
    if isinstance(value, str):
        for root in roots:
            if root in value:
                value = value.replace(root + "/", "…/").replace(root, "…")
        return value
    if isinstance(value, dict):
        return {k: _hide(v, roots) for k, v in value.items()}
    if isinstance(value, list):
        return [_hide(v, roots) for v in value]
    return value
