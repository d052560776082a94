"""Run untrusted Python under bubblewrap: an OS-level sandbox with CPU, memory, process, file and
wall-clock limits per call and no network.

Each call starts `bwrap` with new user, pid, net, ipc, uts and cgroup namespaces (no nested user
namespaces), no capabilities, a seccomp filter (`seccomp.py`), an empty environment and a new session.
The filesystem holds only the interpreter, its standard library (its site-packages hidden) and the
shared libraries it loads, all read-only; a fresh /proc, a minimal /dev, and a private size-capped
tmpfs as /tmp, the working directory. A trusted
bootstrap sets the rlimits inside the namespaces, then runs the program. A kill (wall clock, the call's CPU
time, its memory) ends pid 1 of the sandbox's pid namespace, which ends every process in it (setsid and
double forks included).

The limits hold for the call as a whole: each call gets its own cgroup (`sandbox_cgroup.py`: memory.max,
pids.max, cpu.max, and a kill once its CPU time passes `cpu_seconds`); the rlimits stay as a second line
per process. A trusted launcher (a first stage run by the worker's interpreter, no preexec hook, so it works
on every event loop) moves itself into the call's cgroup and, when the worker is root, drops to uid 65534
before it execs bwrap: the kernel never applies RLIMIT_NPROC to real root, and sandboxed code should not
run as it. The interpreter must then be readable by that uid (`TAPER_SANDBOX_PYTHON`).

Operator settings (read here only: Ray workers run this and must not import the service's settings):
- `TAPER_SANDBOX_MODE`: `bwrap` (default) or `unsafe-rlimits-only` (rlimits, no isolation: for machines
  where bwrap cannot run, and only when the code it runs is trusted).
- `TAPER_SANDBOX_BWRAP`: the bwrap binary (default: `bwrap` on PATH).
- `TAPER_SANDBOX_PYTHON`: the interpreter sandboxed code runs on (default: the worker's own; for a root
  worker whose interpreter uid 65534 cannot read, the system python3).
- `TAPER_SANDBOX_LIMITS`: `cgroup` (default: per-call cgroups; the sandbox refuses to start without them)
  or `per-process` (rlimits alone, which bound each process, not the call: a call that forks gets more).
- `TAPER_SANDBOX_CGROUP`: the parent cgroup of the calls' cgroups (see `sandbox_cgroup.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rollout_workers.environments.sandbox_cgroup import (
    REQUIREMENT,
    CallCgroup,
    CgroupParents,
    CgroupUnavailable,
    find_parents,
)
from rollout_workers.environments.seccomp import seccomp_filter

SandboxMode = Literal["bwrap", "unsafe-rlimits-only"]
MODES: tuple[SandboxMode, ...] = ("bwrap", "unsafe-rlimits-only")
LimitsMode = Literal["cgroup", "per-process"]
LIMITS_MODES: tuple[LimitsMode, ...] = ("cgroup", "per-process")
Exceeded = Literal["memory", "cpu"]
SANDBOX_UID = 65534  # who sandboxed code runs as when the worker is root ("nobody" on Debian)
log = logging.getLogger(__name__)
_WORKDIR = "/tmp"
_SHM_BYTES = 1024 * 1024  # /dev/shm: room for multiprocessing's semaphores, not a second scratch disk
_POLL_S = 0.05  # how often a call's cgroup is read (CPU time, OOM kills) while it runs


@dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: int = 5  # CPU time of the whole call (its cgroup); also each process's RLIMIT_CPU
    memory_bytes: int = 256 * 1024 * 1024  # memory of the whole call (its cgroup); also each process's RLIMIT_AS
    output_bytes: int = 16 * 1024
    wall_seconds: float = 10.0
    max_processes: int = 16  # tasks (processes and threads) in the sandbox, its pid 1 included
    max_open_files: int = 64
    tmpfs_bytes: int = 16 * 1024 * 1024  # the working directory; also the largest file it may write
    cpus: float = 1.0  # CPU bandwidth of the call, in cores (cpu.max)

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "memory_bytes", "output_bytes", "wall_seconds", "max_open_files",
                     "tmpfs_bytes", "cpus"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0")
        if self.max_processes < 3:  # bwrap's pid 1 and the interpreter, plus one
            raise ValueError("max_processes: must be >= 3")


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # negative: killed by that signal
    timed_out: bool
    output_truncated: bool
    sandboxed: bool  # False only in the operator's unsafe-rlimits-only mode
    duration_s: float
    exceeded: Exceeded | None = None  # the call's limit it went past: killed (or, memory, a process OOM-killed)
    cpu_s: float | None = None  # CPU time of the whole call (None without a cgroup: per-process limits)

    def summary(self, max_chars: int = 2000) -> str:
        """What the model sees."""
        parts = []
        if self.stdout:
            parts.append(self.stdout)
        if self.stderr:
            parts.append("[stderr]\n" + self.stderr)
        if self.exceeded == "memory":
            parts.append("[killed: the call's memory limit was exceeded]")
        elif self.exceeded == "cpu":
            parts.append("[killed: the call's CPU-time limit was exceeded]")
        elif self.timed_out:
            parts.append("[killed: wall-clock limit exceeded]")
        elif self.exit_code == -signal.SIGXCPU:
            parts.append("[killed: a process's CPU-time limit was exceeded]")
        elif self.exit_code not in (0, None):
            parts.append(f"[exit code {self.exit_code}]")
        if self.output_truncated:
            parts.append("[output truncated]")
        text = "\n".join(parts) if parts else "[no output]"
        return text if len(text) <= max_chars else text[:max_chars] + "\n[output truncated]"


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run on this machine; the message says why and what the operator can do."""


_UNSAFE_HINT = ("Only if the code it runs is trusted, TAPER_SANDBOX_MODE=unsafe-rlimits-only runs it without "
                "isolation (rlimits only).")


@dataclass(frozen=True)
class SandboxConfig:
    mode: SandboxMode = "bwrap"
    bwrap: str = "bwrap"
    python: str | None = None  # None: see _sandbox_python
    limits: LimitsMode = "cgroup"
    cgroup: str | None = None  # the calls' parent cgroup; None: sandbox_cgroup's default

    @classmethod
    def from_environment(cls) -> SandboxConfig:
        mode = os.environ.get("TAPER_SANDBOX_MODE", "bwrap")
        if mode not in MODES:
            raise SandboxUnavailable(f"TAPER_SANDBOX_MODE: must be one of {', '.join(MODES)}, got {mode!r}")
        limits = os.environ.get("TAPER_SANDBOX_LIMITS", "cgroup")
        if limits not in LIMITS_MODES:
            raise SandboxUnavailable(
                f"TAPER_SANDBOX_LIMITS: must be one of {', '.join(LIMITS_MODES)}, got {limits!r}")
        return cls(mode=mode, bwrap=os.environ.get("TAPER_SANDBOX_BWRAP") or "bwrap",
                   python=os.environ.get("TAPER_SANDBOX_PYTHON") or None, limits=limits,  # type: ignore[arg-type]
                   cgroup=os.environ.get("TAPER_SANDBOX_CGROUP") or None)


# ------------------------------------------------------------------------------------------ the layout

@dataclass(frozen=True)
class _Layout:
    """What bwrap needs for one interpreter: the argv prefix that builds the filesystem, and how to run it."""

    bwrap: str
    python: str
    mount_args: tuple[str, ...]
    as_uid: int | None  # drop to this uid before starting bwrap (the worker is root)
    cgroups: CgroupParents | None  # where the calls' cgroups go; None: per-process limits only


def _world_readable(path: str) -> bool:
    """Whether a user other than the owner and group (uid 65534) can reach and read `path`."""
    p = Path(path)
    if any(not os.stat(d).st_mode & stat.S_IXOTH for d in p.parents):
        return False
    return bool(os.stat(p).st_mode & stat.S_IROTH)


def _base_interpreter() -> str:
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _sandbox_python(config: SandboxConfig, as_root: bool) -> str:
    if config.python:
        python = shutil.which(config.python) or config.python
        if not os.access(python, os.X_OK):
            raise SandboxUnavailable(f"TAPER_SANDBOX_PYTHON: {config.python!r} is not an executable interpreter")
        python = os.path.realpath(python)
        if as_root and not _world_readable(python):
            raise SandboxUnavailable(
                f"TAPER_SANDBOX_PYTHON: {python} is not readable by uid {SANDBOX_UID}, which sandboxed code runs "
                "as when the worker is root; point it at a world-readable interpreter (e.g. /usr/bin/python3)")
        return python
    python = _base_interpreter()
    if not as_root or _world_readable(python):
        return python
    for candidate in ("/usr/local/bin/python3", "/usr/bin/python3"):
        if os.access(candidate, os.X_OK) and _world_readable(os.path.realpath(candidate)):
            return os.path.realpath(candidate)
    raise SandboxUnavailable(
        f"the worker runs as root and its interpreter {python} is not readable by uid {SANDBOX_UID}, which "
        "sandboxed code runs as; set TAPER_SANDBOX_PYTHON to a world-readable Python 3 (or install python3)")


_PROBE = ("import json, sys, sysconfig; "
          "print(json.dumps([sys.version_info[0], sysconfig.get_path('stdlib'), sysconfig.get_path('platstdlib')]))")


def _interpreter_files(python: str) -> tuple[list[str], list[str], list[str]]:
    """(stdlib dirs, library directories to bind, single library files to bind) for `python`."""
    try:
        out = subprocess.run([python, "-I", "-S", "-c", _PROBE], capture_output=True, text=True, timeout=30,
                             env={}, check=True).stdout
        major, *stdlib_dirs = json.loads(out)
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        raise SandboxUnavailable(f"cannot run the sandbox interpreter {python}: {e}") from None
    if major != 3:
        raise SandboxUnavailable(f"the sandbox interpreter {python} is not Python 3")
    stdlibs = sorted({os.path.realpath(d) for d in stdlib_dirs})
    dirs: set[str] = set()
    files: set[str] = set()
    for lib in _shared_libraries(python):
        d = os.path.dirname(lib).rstrip("/") + "/"
        # A directory that holds the stdlib (a prefix's lib/) would bring its site-packages: bind the file.
        if any((s + "/").startswith(d) for s in stdlibs):
            files.add(lib)
        else:
            dirs.add(d.rstrip("/"))
    # The loader searches both /lib/<triplet> and /usr/lib/<triplet>; keep each pair together.
    for d in list(dirs):
        twin = d.removeprefix("/usr") if d.startswith("/usr/") else "/usr" + d
        if os.path.isdir(twin):
            dirs.add(twin)
    return stdlibs, sorted(dirs), sorted(files)


def _shared_libraries(python: str) -> list[str]:
    """The libraries (and the loader) `python` links, as the paths the loader names them by."""
    ldd = shutil.which("ldd")
    if ldd is None:
        raise SandboxUnavailable("ldd is not installed: it lists the libraries the sandbox interpreter needs")
    out = subprocess.run([ldd, python], capture_output=True, text=True, timeout=30, env={}).stdout
    libs = []
    for line in out.splitlines():
        m = re.search(r"(?:=>\s*)?(/\S+)\s+\(0x", line)
        if m:
            libs.append(m.group(1))
    return libs  # empty when statically linked


@functools.lru_cache(maxsize=8)
def _layout(config: SandboxConfig, as_root: bool) -> _Layout:
    bwrap = shutil.which(config.bwrap)
    if bwrap is None:
        raise SandboxUnavailable(
            f"bubblewrap not found ({config.bwrap!r}): model-written code runs only inside it. Install it "
            "(Debian/Ubuntu: apt-get install bubblewrap) or set TAPER_SANDBOX_BWRAP to the binary. " + _UNSAFE_HINT)
    _require_version(bwrap)
    python = _sandbox_python(config, as_root)
    stdlibs, lib_dirs, lib_files = _interpreter_files(python)
    args: list[str] = []
    for path in [python, *stdlibs, *lib_dirs, *lib_files]:
        args += ["--ro-bind", path, path]
    # The loader's cache: how it finds a libpython outside the default directories (/usr/local/lib)
    # when the interpreter carries no RUNPATH, as in the official Python images.
    args += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    for site in (os.path.join(d, "site-packages") for d in stdlibs):
        if os.path.isdir(site):  # hide the interpreter's installed packages
            args += ["--size", "4096", "--tmpfs", site, "--remount-ro", site]
    args += ["--proc", "/proc", "--dev", "/dev",
             "--size", str(_SHM_BYTES), "--tmpfs", "/dev/shm", "--remount-ro", "/dev"]
    return _Layout(bwrap=bwrap, python=python, mount_args=tuple(args), as_uid=SANDBOX_UID if as_root else None,
                   cgroups=None)


_MIN_BWRAP = (0, 8, 0)  # --disable-userns and --size


def _require_version(bwrap: str) -> None:
    try:
        out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=30, env={}).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise SandboxUnavailable(f"cannot run bubblewrap ({bwrap}): {e}") from None
    m = re.search(r"(\d+)\.(\d+)\.(\d+)", out)
    if m is None or tuple(map(int, m.groups())) < _MIN_BWRAP:
        raise SandboxUnavailable(
            f"bubblewrap {m.group(0) if m else '(unknown version)'} at {bwrap} is too old: the sandbox needs "
            f"{'.'.join(map(str, _MIN_BWRAP))} or later (Debian 12, Ubuntu 24.04). " + _UNSAFE_HINT)


_NAMESPACES = ("--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
               "--unshare-cgroup", "--disable-userns")

# Trusted bootstrap, run by the sandbox's interpreter inside the namespaces before the program: sets
# the rlimits (RLIMIT_NPROC only counts the sandbox's tasks from inside its user namespace), then runs
# /tmp/main.py as __main__ with tracebacks that start at the program.
_BOOTSTRAP = r"""
import resource as _r, sys as _s
for _name, _soft, _hard in LIMITS:
    _r.setrlimit(getattr(_r, _name), (_soft, _hard))
_s.argv = ["main.py"]
_s.excepthook = lambda t, v, tb, _hook=_s.__excepthook__: _hook(t, v.with_traceback(tb.tb_next), tb.tb_next)
del _r, _s, _name, _soft, _hard
__file__ = "/tmp/main.py"
exec(compile(open("main.py").read(), "main.py", "exec"))  # in __main__ itself: pickling by name works
"""


def _bootstrap(limits: SandboxLimits, per_call_cpu: bool) -> str:
    # SIGXCPU at the soft limit, SIGKILL after; a second behind the call's own CPU kill when there is one
    cpu = limits.cpu_seconds + 1 if per_call_cpu else limits.cpu_seconds
    rlimits = [
        ("RLIMIT_CPU", cpu, cpu + 1),
        ("RLIMIT_AS", limits.memory_bytes, limits.memory_bytes),
        ("RLIMIT_NPROC", limits.max_processes, limits.max_processes),
        ("RLIMIT_NOFILE", limits.max_open_files, limits.max_open_files),
        ("RLIMIT_FSIZE", limits.tmpfs_bytes, limits.tmpfs_bytes),
        ("RLIMIT_CORE", 0, 0),
    ]
    return _BOOTSTRAP.replace("LIMITS", repr(rlimits), 1)


_SECCOMP_FILTER = seccomp_filter()

# Trusted first stage, run by the worker's interpreter: moves itself into the call's cgroup (so bwrap and
# everything it starts are counted from the first instruction), drops to the sandbox uid when the worker is
# root, then becomes bwrap. argv: uid (-1: keep), the number of cgroup.procs files, those files, bwrap's argv.
_LAUNCHER = r"""
import os, sys
uid, n = int(sys.argv[1]), int(sys.argv[2])
for path in sys.argv[3:3 + n]:
    with open(path, "w") as f:
        f.write(str(os.getpid()))
if uid >= 0:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
argv = sys.argv[3 + n:]
os.execv(argv[0], argv)
"""


def _launcher(layout: _Layout, cgroup: CallCgroup | None) -> list[str]:
    """The argv prefix that starts bwrap in the call's cgroup as the sandbox uid ([] when neither applies)."""
    files = cgroup.procs_files if cgroup else []
    if layout.as_uid is None and not files:
        return []
    uid = -1 if layout.as_uid is None else layout.as_uid
    return [os.path.realpath(sys.executable), "-I", "-S", "-c", _LAUNCHER, str(uid), str(len(files)), *files]


def _call_cgroup(layout: _Layout, limits: SandboxLimits) -> CallCgroup | None:
    if layout.cgroups is None:
        return None
    try:
        return CallCgroup(layout.cgroups, limits.memory_bytes, limits.max_processes, limits.cpus)
    except CgroupUnavailable as e:
        raise SandboxUnavailable(str(e)) from None


@contextlib.contextmanager
def _bwrap_call(layout: _Layout, limits: SandboxLimits, code: bytes,
                cgroup: CallCgroup | None) -> Iterator[tuple[list[str], tuple[int, ...], int]]:
    """The argv of one call, the fds bwrap reads (pass them to it) and the read end of its info pipe,
    which tells the sandbox's pid 1; the fds are closed on exit."""
    code_fd = _memfd(code)
    info_r, info_w = os.pipe()
    os.set_blocking(info_r, False)
    passed = [code_fd, info_w]
    seccomp: list[str] = []
    if _SECCOMP_FILTER is not None:
        passed.append(_memfd(_SECCOMP_FILTER))
        seccomp = ["--seccomp", str(passed[-1])]
    argv = [
        *_launcher(layout, cgroup), layout.bwrap, *_NAMESPACES, "--die-with-parent", "--new-session", "--cap-drop", "ALL",
        "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", _WORKDIR,
        "--setenv", "LANG", "C.UTF-8", "--hostname", "sandbox",
        *layout.mount_args,
        "--size", str(limits.tmpfs_bytes), "--tmpfs", _WORKDIR, "--file", str(code_fd), f"{_WORKDIR}/main.py",
        "--chdir", _WORKDIR, "--remount-ro", "/", "--info-fd", str(info_w), *seccomp,
        "--", layout.python, "-I", "-B", "-c", _bootstrap(limits, per_call_cpu=cgroup is not None),
    ]
    try:
        yield argv, tuple(passed), info_r
    finally:
        for fd in (*passed, info_r):
            os.close(fd)


def _unavailable_message(stderr: str) -> str:
    return (f"bubblewrap cannot create the sandbox here ({stderr.strip() or 'no message'}). It needs unprivileged "
            "user namespaces: on the host, sysctl user.max_user_namespaces > 0 (Debian's older kernels: "
            "kernel.unprivileged_userns_clone=1; Ubuntu 24.04: kernel.apparmor_restrict_unprivileged_userns=0 or "
            "an AppArmor profile for bwrap); in a container, a seccomp/AppArmor profile that allows unshare and "
            "mount in user namespaces (see deploy/README.md). " + _UNSAFE_HINT)


@functools.lru_cache(maxsize=8)
def _checked(config: SandboxConfig, as_root: bool) -> _Layout:
    layout = _layout(config, as_root)
    _probe(layout)  # bwrap itself first: where both are missing, its message is the likelier fix
    if config.limits == "per-process":
        return layout
    try:
        layout = dataclasses.replace(layout, cgroups=find_parents(config.cgroup))
    except CgroupUnavailable as e:
        raise SandboxUnavailable(str(e)) from None
    _probe(layout)
    return layout


def _probe(layout: _Layout) -> None:
    """Run a program the way every call does; raises SandboxUnavailable with the cause when it fails."""
    cgroup = _call_cgroup(layout, SandboxLimits())
    try:
        with _bwrap_call(layout, SandboxLimits(), b"print('ok')", cgroup) as (argv, passed, _):
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, env={}, pass_fds=passed,
                                  stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as e:
        raise SandboxUnavailable(f"cannot start bubblewrap ({layout.bwrap}): {e}. " + _UNSAFE_HINT) from None
    finally:
        if cgroup is not None:
            _remove_sync(cgroup)
    if proc.returncode == 0 and proc.stdout == "ok\n":
        return
    if cgroup is not None:
        raise SandboxUnavailable(f"the sandbox cannot start in its cgroup ({proc.stderr.strip()[-500:]}). "
                                 + REQUIREMENT)
    raise SandboxUnavailable(_unavailable_message(proc.stderr))


def check_sandbox(config: SandboxConfig | None = None) -> SandboxConfig:
    """The operator's sandbox configuration, after checking it can run here (once per process and
    configuration); raises SandboxUnavailable with what to do otherwise."""
    config = config or SandboxConfig.from_environment()
    if config.mode == "bwrap":
        _checked(config, os.geteuid() == 0)
    return config


# ------------------------------------------------------------------------------------------ running

def run_python(code: str, limits: SandboxLimits = SandboxLimits(), stdin: str = "",
               config: SandboxConfig | None = None) -> SandboxResult:
    """Run `code` under `limits`; never raises for anything the code does."""
    return asyncio.run(run_python_async(code, limits, stdin, config))


async def run_python_async(code: str, limits: SandboxLimits = SandboxLimits(), stdin: str = "",
                           config: SandboxConfig | None = None) -> SandboxResult:
    """`run_python` on an event loop. Cancelling it (e.g. a tool timeout shorter than the wall-clock limit)
    kills the program at once instead of leaving it to run to its own limit. Raises SandboxUnavailable
    when the configured sandbox cannot run here."""
    config = check_sandbox(config)
    if config.mode == "unsafe-rlimits-only":
        return await _run_unsafe(code, limits, stdin)
    layout = _checked(config, os.geteuid() == 0)
    cgroup = _call_cgroup(layout, limits)
    try:
        with _bwrap_call(layout, limits, _encode(code), cgroup) as (argv, passed, info_r):
            start = time.monotonic()
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={},
                pass_fds=passed, start_new_session=True,
            )
            init = _SandboxInit(proc, info_r)
            try:
                return await _supervise(proc, limits, stdin, start, init.kill, cgroup)
            finally:
                await init.end()
    finally:
        if cgroup is not None:
            await _remove(cgroup)


_SURROGATE = re.compile("[\ud800-\udfff]")


def replace_surrogates(text: str) -> str:
    """`text` with what has no UTF-8 encoding (a lone surrogate, which JSON tool-call arguments may carry)
    as U+FFFD: a program, a tokenizer or a log sees a replacement character, never an encoding error."""
    return _SURROGATE.sub("\ufffd", text)


def _encode(text: str) -> bytes:
    return replace_surrogates(text).encode("utf-8")


async def _supervise(proc: asyncio.subprocess.Process, limits: SandboxLimits, stdin: str, start: float,
                     kill: Callable[[], Awaitable[None]], cgroup: CallCgroup | None) -> SandboxResult:
    """Feed stdin and collect capped output through pipes while the sandbox runs. Its pipes close as soon as
    its last process is gone, which the pid namespace guarantees when the call ends."""
    assert proc.stdin and proc.stdout and proc.stderr
    out, err = _CappedOutput(limits.output_bytes), _CappedOutput(limits.output_bytes)
    tasks = [asyncio.ensure_future(_feed(proc.stdin, _encode(stdin))),
             asyncio.ensure_future(out.drain(proc.stdout)), asyncio.ensure_future(err.drain(proc.stderr))]
    watch = None if cgroup is None else functools.partial(_watch, cgroup, limits.cpu_seconds)
    try:
        ended = await _wait_or_kill(proc, limits.wall_seconds, kill, watch)
        duration = time.monotonic() - start
        await asyncio.gather(*tasks[1:])
    finally:
        for task in tasks:
            task.cancel()
    if ended is None and cgroup is not None and cgroup.oom_killed():
        ended = "memory"  # a process of the call was OOM-killed, and the call ended before the watch saw it
    code = proc.returncode
    if code is not None and code > 128:  # bwrap reports death by signal N as 128 + N
        code = 128 - code
    timed_out = ended == "wall"
    return SandboxResult(stdout=out.text(), stderr=err.text(), exit_code=None if timed_out else code,
                         timed_out=timed_out, output_truncated=out.truncated or err.truncated, sandboxed=True,
                         duration_s=duration, exceeded=None if ended in (None, "wall") else ended,
                         cpu_s=None if cgroup is None else cgroup.cpu_seconds())


async def _watch(cgroup: CallCgroup, cpu_seconds: float) -> Exceeded:
    """Return once the call goes past a limit its cgroup measures: memory (an OOM kill) or CPU time."""
    while True:
        await asyncio.sleep(_POLL_S)
        if cgroup.oom_killed():
            return "memory"
        if cgroup.cpu_seconds() > cpu_seconds:
            return "cpu"


async def _wait_or_kill(proc: asyncio.subprocess.Process, wall_seconds: float, kill: Callable[[], Awaitable[None]],
                        watch: Callable[[], Awaitable[Exceeded]] | None = None) -> Exceeded | Literal["wall"] | None:
    """Wait for the program; kill it at the wall-clock limit ("wall"), when `watch` returns (its answer), or
    when the call is cancelled. None: it ended by itself."""
    waiter = asyncio.ensure_future(proc.wait())
    watcher = asyncio.ensure_future(watch()) if watch else None
    try:
        done, _ = await asyncio.wait([t for t in (waiter, watcher) if t is not None], timeout=wall_seconds,
                                     return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        await kill()
        raise
    finally:
        for task in (waiter, watcher):
            if task is not None and not task.done():
                task.cancel()
    if waiter in done:
        return None
    await kill()
    return watcher.result() if watcher is not None and watcher in done else "wall"


async def _remove(cgroup: CallCgroup) -> None:
    """Remove a call's cgroup once its processes are gone (the kernel reaps them just after pid 1)."""
    for _ in range(100):
        if cgroup.remove():
            return
        cgroup.kill()
        await asyncio.sleep(0.02)
    log.warning("sandbox: the cgroup of a call could not be removed: %s", ", ".join(cgroup.procs_files))


def _remove_sync(cgroup: CallCgroup) -> None:
    for _ in range(100):
        if cgroup.remove():
            return
        cgroup.kill()
        time.sleep(0.02)


async def _feed(writer: asyncio.StreamWriter, data: bytes) -> None:
    with contextlib.suppress(ConnectionError):
        if data:
            writer.write(data)
            await writer.drain()
        writer.close()


class _CappedOutput:
    """The first `cap` bytes of a stream; the rest is read and dropped so the writer never blocks on us."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.kept = bytearray()
        self.truncated = False

    async def drain(self, reader: asyncio.StreamReader) -> None:
        while chunk := await reader.read(65536):
            room = self.cap - len(self.kept)
            self.truncated = self.truncated or len(chunk) > room
            self.kept += chunk[:max(room, 0)]

    def text(self) -> str:
        return self.kept.decode("utf-8", errors="replace")


class _SandboxInit:
    """Pid 1 of a call's pid namespace, held by a pidfd (so a reused pid is never hit): when it dies the
    kernel kills every process in the namespace, and it exits only after they are all gone."""

    def __init__(self, proc: asyncio.subprocess.Process, info_fd: int) -> None:
        self.proc = proc
        self.pidfd: int | None = None
        self._found = asyncio.ensure_future(self._find(info_fd))

    async def _find(self, info_fd: int) -> None:
        await _readable(info_fd)  # bwrap writes {"child-pid": ...} once the sandbox is set up
        try:
            child = int(json.loads(os.read(info_fd, 4096))["child-pid"])
            pidfd = os.pidfd_open(child)
        except (OSError, ValueError, KeyError):
            return
        try:
            is_ours = _parent_of(child) == self.proc.pid
        except (OSError, ValueError):
            is_ours = False
        if is_ours:
            self.pidfd = pidfd
        else:
            os.close(pidfd)

    async def kill(self) -> None:
        """End the sandbox now; bwrap, which waits for its pid 1, exits after that."""
        if self.pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.proc.wait()), timeout=5.0)
                return
        with contextlib.suppress(ProcessLookupError):  # not set up yet: its pid 1 dies with bwrap
            self.proc.kill()
        await self.proc.wait()

    async def end(self) -> None:
        """After the program: end what is left in the namespace (a daemon that closed its output) and
        wait until it is gone, so nothing outlives the call."""
        self._found.cancel()
        if self.pidfd is None:
            return
        try:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(_readable(self.pidfd), timeout=5.0)
        finally:
            os.close(self.pidfd)
            self.pidfd = None


async def _readable(fd: int) -> None:
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(fd)


def _parent_of(pid: int) -> int:
    stat_line = Path(f"/proc/{pid}/stat").read_text()
    return int(stat_line[stat_line.rindex(")") + 2:].split()[1])


def _memfd(data: bytes) -> int:
    fd = os.memfd_create("main.py", os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


# ------------------------------------------------------------------------------------------ unsafe mode

# Operator-chosen unsafe mode: the same rlimits (no RLIMIT_NPROC: outside a user namespace it would count
# every process of the worker's uid), set by a first stage before exec; no isolation of any kind.
_UNSAFE_LAUNCHER = r"""
import os, resource, sys
cpu, mem, fsize, nofile = map(int, sys.argv[1:5])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
os.execv(sys.executable, [sys.executable, "-I", "main.py"])
"""


async def _run_unsafe(code: str, limits: SandboxLimits, stdin: str) -> SandboxResult:
    # Output goes to memory files, not pipes: a process that left the group could hold a pipe open.
    fds = [_memfd(_encode(stdin)), _memfd(b""), _memfd(b"")]
    try:
        with tempfile.TemporaryDirectory(prefix="taper-unsafe-") as work:
            Path(work, "main.py").write_bytes(_encode(code))
            start = time.monotonic()
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", "-c", _UNSAFE_LAUNCHER, str(limits.cpu_seconds),
                str(limits.memory_bytes), str(limits.tmpfs_bytes), str(limits.max_open_files),
                stdin=fds[0], stdout=fds[1], stderr=fds[2], cwd=work,
                env={"PATH": "/usr/bin:/bin", "HOME": work, "LANG": "C.UTF-8"}, start_new_session=True,
            )

            async def kill_group() -> None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()

            timed_out = await _wait_or_kill(proc, limits.wall_seconds, kill_group)
            duration = time.monotonic() - start
        (stdout, out_trunc), (stderr, err_trunc) = (_read_capped(fd, limits.output_bytes) for fd in fds[1:])
    finally:
        for fd in fds:
            os.close(fd)
    return SandboxResult(stdout=stdout, stderr=stderr, exit_code=None if timed_out else proc.returncode,
                         timed_out=timed_out, output_truncated=out_trunc or err_trunc, sandboxed=False,
                         duration_s=duration)


def _read_capped(fd: int, cap: int) -> tuple[str, bool]:
    data = os.pread(fd, cap + 1, 0)
    return data[:cap].decode("utf-8", errors="replace"), len(data) > cap
