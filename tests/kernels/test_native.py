"""Building C kernels for this CPU (`kernels.native`): compiled once per source and CPU, then loaded from the
cache; a missing compiler or a failing build is an error that says so."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch

from kernels import native
from kernels.kda.recurrent_cpu import kda_rows

SOURCE = """float dot(const float *a, const float *b, long n) {
    float s = 0;
    for (long i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}
"""


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    native.load.cache_clear()
    yield tmp_path / "cache"
    native.load.cache_clear()


def test_a_source_is_built_once_then_loaded_from_the_cache(cache: Path, tmp_path: Path) -> None:
    lib = native.load("dot", SOURCE)
    lib.dot.restype = ctypes.c_float
    lib.dot.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
    a, b = np.random.default_rng(0).standard_normal((2, 100), dtype=np.float32)
    assert lib.dot(a.ctypes.data, b.ctypes.data, 100) == pytest.approx(float(a @ b), rel=1e-5)
    (built,) = cache.glob("dot-*.so")
    stamp = built.stat().st_mtime_ns
    native.load.cache_clear()
    native.load("dot", SOURCE)
    assert built.stat().st_mtime_ns == stamp and list(cache.glob("dot-*")) == [built]
    native.load("dot", SOURCE.replace("s += a[i] * b[i]", "s += 2 * a[i] * b[i]"))  # a new source: a new build
    assert len(list(cache.glob("dot-*.so"))) == 2


def test_a_missing_compiler_or_a_broken_source_is_a_clear_error(cache: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(native.NativeBuildError, match="failed to build broken"):
        native.load("broken", "int f( {\n")
    assert not list(cache.glob("broken-*"))  # nothing half-written
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(native.NativeBuildError, match="no working C compiler"):
        native.load("dot", SOURCE)


def test_a_home_that_cannot_be_written_falls_back_to_the_temp_dir(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    blocked = tmp_path / "home"
    blocked.write_text("a file, not a folder")
    monkeypatch.delenv(native.CACHE_ENV, raising=False)
    monkeypatch.setattr(Path, "home", lambda: blocked)
    assert native.cache_dir().name.startswith("taper-native-") and not str(native.cache_dir()).startswith(str(blocked))


def test_the_c_recurrence_refuses_arrays_it_cannot_read_safely() -> None:
    q, v, o = torch.zeros(4, 2, 8), torch.zeros(4, 2, 8), torch.zeros(4, 2, 8)
    beta = torch.zeros(4, 2)
    pool = torch.zeros(3, 2, 8, 8)
    bounds = torch.tensor([0]), torch.tensor([4])
    with pytest.raises(ValueError, match="decay must be a contiguous fp32 CPU tensor"):
        kda_rows(q, q, v, q.double(), beta, 1.0, True, *bounds, torch.tensor([0]), pool, o)
    with pytest.raises(ValueError, match="k must be a contiguous fp32 CPU tensor"):
        kda_rows(q, torch.zeros(4, 2, 16)[..., ::2], v, q, beta, 1.0, True, *bounds, torch.tensor([0]), pool, o)
    with pytest.raises(ValueError, match="slots outside the pool"):
        kda_rows(q, q, v, q, beta, 1.0, True, *bounds, torch.tensor([3]), pool, o)
    with pytest.raises(ValueError, match="sequence bounds outside"):
        kda_rows(q, q, v, q, beta, 1.0, True, torch.tensor([0]), torch.tensor([5]), torch.tensor([0]), pool, o)
    with pytest.raises(ValueError, match="pool must be fp32 on the CPU with each slot contiguous"):
        kda_rows(q, q, v, q, beta, 1.0, True, *bounds, torch.tensor([0]), pool.transpose(2, 3), o)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        kda_rows(q, q, v, q, beta, 1.0, True, *bounds, torch.tensor([0]), pool, o, threads=0)


@pytest.mark.parametrize("V", [64, 40])  # 40: a column block with a rest that is not a whole vector
@pytest.mark.parametrize("lengths", [[300], [7, 0, 120, 33]])
def test_the_c_recurrence_gives_the_same_numbers_on_any_number_of_threads(V: int, lengths: list[int]) -> None:
    """Units are (sequence, head) and, with fewer of those than threads, blocks of value columns: each column of
    the state evolves on its own, so every split must give bit-for-bit the one-thread result."""
    gen = torch.Generator().manual_seed(V + len(lengths))
    R, HV, K = sum(lengths), 2, 16
    q, k = torch.randn(R, HV, K, generator=gen), torch.randn(R, HV, K, generator=gen)
    v = torch.randn(R, HV, V, generator=gen)
    decay = 0.6 + 0.4 * torch.rand(R, HV, K, generator=gen)
    beta = torch.rand(R, HV, generator=gen)
    ends = torch.tensor(lengths).cumsum(0)
    starts = ends - torch.tensor(lengths)
    slots = torch.arange(len(lengths)) * 2
    if len(lengths) > 1:
        slots[1] = -1  # a skipped sequence: zero output, its slot untouched
    pool0 = torch.randn(2 * len(lengths), HV, K, V, generator=gen)
    results = []
    for threads in (1, 2, 3, 8):
        pool, o = pool0.clone(), torch.full((R, HV, V), float("nan"))
        kda_rows(q, k, v, decay, beta, 0.25, True, starts, ends, slots, pool, o, threads=threads)
        results.append((o, pool))
    o1, pool1 = results[0]
    assert torch.isfinite(o1).all() and not torch.equal(pool1, pool0)
    for o, pool in results[1:]:
        assert torch.equal(o, o1) and torch.equal(pool, pool1)
