"""Row blocks over threads (`kernels.cpu_threads`): every row once, errors raised after all blocks end."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from kernels import cpu_threads


@pytest.mark.parametrize("rows,threads", [(10, 1), (10, 3), (2, 5), (0, 4), (1000, 7)])
def test_blocks_cover_every_row_once(rows: int, threads: int) -> None:
    seen = torch.zeros(rows, dtype=torch.int64)
    blocks = []

    def fn(lo: int, hi: int) -> None:
        seen[lo:hi] += 1
        blocks.append(hi - lo)

    cpu_threads.run_row_blocks(fn, rows, threads)
    assert torch.equal(seen, torch.ones(rows, dtype=torch.int64))
    assert len(blocks) == max(1, min(rows, threads)) and max(blocks) - min(blocks) <= 1


def test_an_error_in_any_block_is_raised_after_every_block_has_finished() -> None:
    finished = []

    def fn(lo: int, hi: int) -> None:
        if lo > 0 and lo < 50:
            raise ValueError(f"block {lo}")
        time.sleep(0.05)
        finished.append(lo)

    with pytest.raises(ValueError, match="block"):
        cpu_threads.run_row_blocks(fn, 100, 4)
    assert sorted(finished) == [0, 50, 75]


def test_small_work_stays_on_one_thread() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        assert cpu_threads.threads_for(100) == 1
        assert cpu_threads.threads_for(10 * cpu_threads.MIN_ELEMENTS_PER_THREAD) == 4
        assert cpu_threads.threads_for(2 * cpu_threads.MIN_ELEMENTS_PER_THREAD) == 2
    finally:
        torch.set_num_threads(before)


def test_a_forked_child_gets_a_pool_of_its_own() -> None:
    cpu_threads.run_row_blocks(lambda lo, hi: None, 4, 2)  # the parent's pool exists
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: blocks on other threads must still run (a hang is killed by the alarm: no "ok")
        signal.alarm(10)
        seen = []
        cpu_threads.run_row_blocks(lambda lo, hi: seen.append(lo), 4, 2)
        os.write(write, b"ok" if sorted(seen) == [0, 2] else b"bad")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 2) == b"ok"
