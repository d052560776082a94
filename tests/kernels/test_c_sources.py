"""The C kernels as C: each `.c` source beside its Python loader compiles without a warning (`-Wall -Wextra
-Werror`, for this CPU and, on x86, for the other instruction sets its `#if` branches serve), and the kernels'
own reference tests pass with every source built under AddressSanitizer and UBSan."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import native

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "kernels").rglob("*.c"))
# -march=native is the build's own (its flags as built); on x86 also AVX-512 with AMX (the tile kernel's real
# branch) and baseline SSE (the emulated tiles, the narrowest vectors), at -O1 to keep the builds short
TARGETS = ["native", *(["sapphirerapids", "x86-64"] if platform.machine() == "x86_64" else [])]
# sources that need a macro from their loader (mla_decode_cpu.c: the latent width)
DEFINES = {"mla_decode_cpu.c": ["-DR=64"]}
# small cases of each kernel's reference tests: partial vectors and tiles, several threads, every layout
SANITIZED_TESTS = [
    "tests/kernels/test_attn_res_cpu.py::test_matches_the_modules_on_any_thread_count[3 threads-3-50-37-dtype0-2e-06]",
    "tests/kernels/test_attn_res_cpu.py::test_matches_the_modules_on_any_thread_count[3 threads-3-50-37-dtype1-0.01]",
    "tests/kernels/test_attn_res_cpu.py::test_reads_strided_and_mixed_dtype_candidates",
    *(f"tests/kernels/test_mla_decode_cpu.py::test_matches_softmax_attention_over_the_latents[3 threads-64-32-3-"
      f"lengths1-{case}]" for case in ("dtype0-False-2e-06", "dtype1-False-1e-05", "dtype2-True-1e-05")),
    "tests/kernels/test_mla_decode_cpu.py::test_pages_apart_in_a_padded_buffer",
    "tests/kernels/test_prefill_attention_cpu.py::test_matches_causal_softmax_attention[1-5-9-20-24]",
    "tests/kernels/test_prefill_attention_cpu.py::test_matches_causal_softmax_attention[3-40-40-32-32]",
    "tests/kernels/test_prefill_attention_cpu.py::test_a_rising_max_rescales_the_running_output",
    *(f"tests/kernels/test_native.py::test_the_c_recurrence_gives_the_same_numbers_on_any_number_of_threads[{case}]"
      for case in ("lengths0-64", "lengths0-40", "lengths1-40")),
    "tests/kernels/test_kda_decode_cpu.py::test_prefill_over_state_slots_matches_naive[3 threads-False]",
    "tests/kernels/test_kda_decode_cpu.py::test_slot_decode_matches_naive[paged-False-True-dtype1-0.01]",
]


def _compiler() -> str:
    return os.environ.get("CC", "cc")


def test_every_c_kernel_is_a_c_file_read_by_the_loader_beside_it() -> None:
    assert {p.name for p in SOURCES} >= {"recurrent_cpu.c", "attn_res_cpu.c", "mla_decode_cpu.c",
                                         "prefill_attention_cpu.c"}
    for source in SOURCES:
        loaders = [p for p in source.parent.glob("*.py") if f'read_source(__file__, "{source.name}")' in p.read_text()]
        assert loaders, f"no Python module beside {source.name} reads it"
    # and no C left in Python strings
    in_strings = [p.name for p in (ROOT / "kernels").rglob("*.py") if re.search(r"^#include <", p.read_text(), re.M)]
    assert not in_strings, in_strings


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_compiles_without_warnings(source: Path, target: str, tmp_path: Path) -> None:
    flags = [f for f in native.FLAGS if f != "-shared"]
    if target != "native":
        flags = [{"-march=native": f"-march={target}", "-O3": "-O1"}.get(f, f) for f in flags]
    build = subprocess.run([_compiler(), *flags, "-Wall", "-Wextra", "-Werror", *DEFINES.get(source.name, []),
                            "-c", "-o", str(tmp_path / "out.o"), str(source)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]


def _sanitizer_runtime() -> str:
    path = subprocess.run([_compiler(), "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    return path if os.path.isabs(path) and Path(path).exists() else ""


def _run_sanitized(tests: list[str], tmp_path: Path, runtime: str, extra_env: dict[str, str] | None = None
                   ) -> tuple[subprocess.CompletedProcess, list[Path]]:
    logs = tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    env = {**os.environ, "LD_PRELOAD": runtime, native.CACHE_ENV: str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "kernels")]),
           # Python itself is not built with ASan and keeps objects alive at exit: leaks are not ours to judge
           "ASAN_OPTIONS": f"detect_leaks=0:abort_on_error=0:log_path={logs / 'asan'}",
           "UBSAN_OPTIONS": f"print_stacktrace=1:log_path={logs / 'ubsan'}", **(extra_env or {})}
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "sanitized_build", "-p", "no:cacheprovider", "-q",
                          "-x", *tests], capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    return run, sorted(logs.iterdir())


def test_the_kernels_reference_tests_pass_under_address_and_undefined_behaviour_sanitizers(tmp_path: Path) -> None:
    runtime = _sanitizer_runtime()
    if not runtime:
        pytest.skip(f"{_compiler()} has no AddressSanitizer runtime (libasan)")
    run, reports = _run_sanitized(SANITIZED_TESTS, tmp_path, runtime)
    report_text = "\n".join(p.read_text()[-3000:] for p in reports)
    assert run.returncode == 0 and not reports, run.stdout[-3000:] + run.stderr[-2000:] + report_text
    assert f"{len(SANITIZED_TESTS)} passed" in run.stdout, run.stdout[-2000:]


def test_the_sanitized_run_reports_an_out_of_bounds_write(tmp_path: Path) -> None:
    """The harness above can fail: a source that writes one past its buffer is caught and reported."""
    runtime = _sanitizer_runtime()
    if not runtime:
        pytest.skip(f"{_compiler()} has no AddressSanitizer runtime (libasan)")
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "import ctypes\nfrom kernels import native\n\n"
        "def test_overflow():\n"
        "    lib = native.load('overflow', '#include <stdlib.h>\\nint f(int n) { int *a = malloc(n * sizeof(int));'\n"
        "                      ' a[n] = 1; int r = a[0]; free(a); return r; }\\n')\n"
        "    lib.f(ctypes.c_int(4))\n")
    run, reports = _run_sanitized([str(probe)], tmp_path, runtime)
    assert run.returncode != 0
    assert any("heap-buffer-overflow" in p.read_text() for p in reports), run.stdout[-2000:] + run.stderr[-2000:]
