"""Spreading the compiled CPU passes (numba loops that release the GIL) over torch's intra-op threads.

A serving engine on a many-core CPU sets torch's thread count to its cores, and torch's matmuls use them all;
a pass that ran on one thread would then take most of a prefill. Each pass here is split into contiguous
blocks of rows (tokens) that a shared thread pool runs at once, the caller's thread taking the first. The
split never changes a row's arithmetic, so the result is the same on any number of threads. Small calls (a
decode step's few rows) stay on the caller's thread: handing a block to another thread costs ~20 us.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

MIN_ELEMENTS_PER_THREAD = 1 << 16  # ~50-100 us of a pass's work on one core

_pool: ThreadPoolExecutor | None = None


def threads_for(elements: int, per_thread: int | None = None) -> int:
    """Threads for a pass over `elements` values: torch's intra-op count (what the engine or the user set),
    fewer where a thread would get under `per_thread` (default MIN_ELEMENTS_PER_THREAD) of them."""
    blocks = elements // (per_thread or MIN_ELEMENTS_PER_THREAD)
    return 1 if blocks <= 1 else min(torch.get_num_threads(), blocks)  # (a decode step's calls: no torch call)


def run_row_blocks(fn: Callable[[int, int], None], rows: int, threads: int) -> None:
    """fn(lo, hi) over `threads` contiguous blocks of rows 0 .. rows-1, at once. fn must release the GIL
    (numba's nogil loops, ctypes calls) for the blocks to overlap; its first error is raised here, after
    every block has finished."""
    threads = max(1, min(threads, rows))
    if threads == 1:
        fn(0, rows)
        return
    bounds = [rows * i // threads for i in range(threads + 1)]
    futures = [_executor().submit(fn, lo, hi) for lo, hi in zip(bounds[1:-1], bounds[2:], strict=True)]
    try:
        fn(bounds[0], bounds[1])
    finally:
        errors = [f.exception() for f in futures]  # waits for each block
    for error in errors:
        if error is not None:
            raise error


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="taper-cpu")
    return _pool


def _forget_pool_in_child() -> None:
    """A forked child has none of the parent's threads: a pool inherited from it would never run a block."""
    global _pool
    _pool = None


os.register_at_fork(after_in_child=_forget_pool_in_child)
