"""Run untrusted Python in a subprocess with CPU-time, memory, output-size and wall-clock limits and
no network.

Layers: rlimits (CPU seconds, address space, file size, core dumps) set in the child before exec; a
fresh network namespace (where the kernel lets us unshare one) and, always,
a CPython audit hook installed before the user's code runs that refuses sockets, subprocesses, exec,
fork and ctypes (audit hooks cannot be removed from inside the interpreter). The child runs in its own
process group, so a wall-clock timeout kills it and anything it spawned.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

# Trusted first stage (no preexec_fn: forking a threaded parent and running Python before exec can
# deadlock): leave the network namespace where allowed, set the rlimits, then exec the interpreter that
# runs the user's code. One byte over the output cap lets us tell "hit the cap" from "exactly the cap".
_LAUNCHER = r"""
import ctypes, os, resource, sys
bootstrap, src, netns_flag, cpu, mem, fsize = sys.argv[1:7]
try:
    if ctypes.CDLL(None, use_errno=True).unshare(0x40000000) == 0:
        open(netns_flag, "w").close()
except (OSError, AttributeError):
    pass
cpu, mem, fsize = int(cpu), int(mem), int(fsize)
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
os.execv(sys.executable, [sys.executable, "-I", "-c", bootstrap, src])
"""

# Runs inside the child: install the audit hook, then execute the user's file.
_BOOTSTRAP = r"""
import sys
_BLOCKED = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
            "os.forkpty", "ctypes.", "_ctypes.", "pty.", "os.kill", "signal.pthread_kill")
def _hook(event, args, _blocked=_BLOCKED):
    if event.startswith(_blocked):
        raise PermissionError(f"sandbox: {event} is not allowed")
_path = sys.argv[1]
with open(_path) as _f:
    _code = _f.read()
sys.addaudithook(_hook)
del _f, _path, _hook
_g = {"__name__": "__main__", "__builtins__": __builtins__}
exec(compile(_code, "<sandbox>", "exec"), _g)
"""


@dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: int = 5
    memory_bytes: int = 256 * 1024 * 1024
    output_bytes: int = 16 * 1024
    wall_seconds: float = 10.0

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "memory_bytes", "output_bytes", "wall_seconds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0")


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    output_truncated: bool
    network_namespace: bool
    duration_s: float

    def summary(self, max_chars: int = 2000) -> str:
        """What the model sees."""
        parts = []
        if self.stdout:
            parts.append(self.stdout)
        if self.stderr:
            parts.append("[stderr]\n" + self.stderr)
        if self.timed_out:
            parts.append("[killed: wall-clock limit exceeded]")
        elif self.exit_code not in (0, None):
            parts.append(f"[exit code {self.exit_code}]")
        if self.output_truncated:
            parts.append("[output truncated]")
        text = "\n".join(parts) if parts else "[no output]"
        return text if len(text) <= max_chars else text[:max_chars] + "\n[output truncated]"


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` under `limits`; never raises for anything the code does."""
    return asyncio.run(run_python_async(code, limits))


async def run_python_async(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """`run_python` on an event loop. Cancelling it (e.g. a tool timeout shorter than the wall-clock limit)
    kills the program at once instead of leaving it to run to its own limit."""
    with tempfile.TemporaryDirectory(prefix="taper-sandbox-") as work:
        src = os.path.join(work, "main.py")
        with open(src, "w") as f:
            f.write(code)
        out_path, err_path = os.path.join(work, "stdout"), os.path.join(work, "stderr")
        netns_flag = os.path.join(work, "netns")

        env = {"PATH": "/usr/bin:/bin", "PYTHONIOENCODING": "utf-8", "HOME": work}
        start = time.monotonic()
        timed_out = False
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", "-c", _LAUNCHER, _BOOTSTRAP, src, netns_flag,
                str(limits.cpu_seconds), str(limits.memory_bytes), str(limits.output_bytes + 1),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                cwd=work,
                env=env,
                start_new_session=True,
            )
            try:
                await asyncio.wait_for(proc.wait(), timeout=limits.wall_seconds)
            except TimeoutError:
                timed_out = True
                await _kill_group(proc)
            except asyncio.CancelledError:
                await _kill_group(proc)
                raise
        duration = time.monotonic() - start
        stdout, out_trunc = _read_capped(out_path, limits.output_bytes)
        stderr, err_trunc = _read_capped(err_path, limits.output_bytes)
        return SandboxResult(
            stdout=stdout,
            stderr=stderr,
            exit_code=None if timed_out else proc.returncode,
            timed_out=timed_out,
            output_truncated=out_trunc or err_trunc,
            network_namespace=os.path.exists(netns_flag),
            duration_s=duration,
        )


async def _kill_group(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    await proc.wait()


def _read_capped(path: str, cap: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(cap + 1)
    return data[:cap].decode("utf-8", errors="replace"), len(data) > cap
