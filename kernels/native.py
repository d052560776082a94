"""C kernels built for this CPU at first use, with the system's C compiler, and loaded through ctypes.

For the few CPU loops where numba's code falls short: LLVM cannot keep a loop's running sums in registers
when they live in arrays that might alias the data (numba has no `restrict`), and such loops then run at the
speed of their stores. The C sources use GCC/Clang vector extensions, so one source serves AVX2, AVX-512 and
NEON; `-march=native` picks the widest, as numba's JIT does. A build is cached per source, compiler, flags
and CPU (`cache_dir()`): the first use on a machine costs about a second, later ones a file lookup. The
compiler is `CC` (default `cc`); torch.compile's CPU backend needs one too. The sources are `.c` files beside
their Python loaders (`read_source`); `tests/kernels/test_c_sources.py` builds each with warnings as errors and
runs it under AddressSanitizer and UBSan.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

CACHE_ENV = "TAPER_NATIVE_CACHE"
# fast-math as numba's loops have it (reassociated sums vectorise), but inf and NaN keep their meaning
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-std=gnu11", "-fPIC", "-shared",
         "-pthread")


class NativeBuildError(RuntimeError):
    """The C compiler is missing or failed."""


def cache_dir() -> Path:
    """`TAPER_NATIVE_CACHE`, else ~/.cache/taper/native, else (a home that cannot be written, as in a read-only
    container) a per-user folder under the temp dir."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    home = Path.home() / ".cache" / "taper" / "native"
    try:
        home.mkdir(parents=True, exist_ok=True)
        return home
    except OSError:
        return Path(tempfile.gettempdir()) / f"taper-native-{os.getuid()}"


def _cpu_identity() -> bytes:
    """What -march=native depends on: the CPU's flags and model (a cache shared between machines stays right)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine.encode()
    keep = [line for line in lines if line.split(":")[0].strip() in ("flags", "Features", "model name", "CPU part")]
    return "\n".join(dict.fromkeys(keep)).encode()


def read_source(anchor: str, name: str) -> str:
    """The C source `name` beside the Python file `anchor` (a loader's `__file__`). The sources are package data,
    and `model.portable` copies them beside the flattened modules that read them, so call it with exactly
    `read_source(__file__, "<name>.c")` with a literal name: that is the form portable.py looks for."""
    return (Path(anchor).parent / name).read_text()


@functools.cache
def load(name: str, source: str) -> ctypes.CDLL:
    """The shared library built from the C `source` for this CPU (`name` names its files), compiling it if no
    cached build fits."""
    compiler = os.environ.get("CC", "cc")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise NativeBuildError(f"no working C compiler {compiler!r} (set CC) to build {name}: {exc}") from exc
    key = hashlib.sha256(b"\0".join([source.encode(), " ".join(FLAGS).encode(), version.encode(),
                                      _cpu_identity()])).hexdigest()[:20]
    target = cache_dir() / f"{name}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # each builder its own files, then an atomic rename: concurrent first uses do not collide
        partial = target.with_name(f"{target.stem}.{os.getpid()}.tmp")
        c_file = target.with_name(f"{target.stem}.{os.getpid()}.c")
        c_file.write_text(source)
        build = subprocess.run([compiler, *FLAGS, "-o", str(partial), str(c_file), "-lm"], capture_output=True,
                               text=True)
        c_file.unlink()
        if build.returncode != 0:
            partial.unlink(missing_ok=True)
            raise NativeBuildError(f"{compiler} failed to build {name}:\n{build.stderr[-2000:]}")
        os.replace(partial, target)
    return ctypes.CDLL(str(target))
