"""One cgroup per sandbox call: memory, processes and CPU counted over everything the call runs.

rlimits are per process, so a call that forks multiplies them; a cgroup counts the call as a whole:
`memory.max` (which counts shmem, memfds and the call's tmpfs as well as page cache), `pids.max`, a CPU
bandwidth (`cpu.max`) and the CPU time used (`cpu.stat`), which the sandbox reads to kill a call past its
`cpu_seconds`. The sandbox's launcher moves itself into the call's cgroup before it starts bwrap, so every
process of the call is in it from the start.

Both cgroup versions work: v2 (unified; the three controllers enabled for the parent's children) and v1
(separate memory, pids, cpu and cpuacct hierarchies, as some container hosts still mount). A call's cgroups
are children of a parent cgroup, `TAPER_SANDBOX_CGROUP` (a cgroup path as /proc/self/cgroup prints it, or
one relative to the worker's own cgroup), which defaults to `/taper-sandbox` on v2 and to the worker's own
cgroup on v1. The worker must be able
to create children in it: as root that is the default; an unprivileged worker needs the parent delegated
to its uid (v2: systemd's Delegate=yes, with the worker itself in a leaf of the delegated subtree).

Standard library only: the sandbox tests load this module from its file for a worker without the
project's environment.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import secrets
import time
from dataclasses import dataclass
from typing import Literal

CONTROLLERS = ("memory", "pids", "cpu")
_V1_HIERARCHIES = ("memory", "pids", "cpu", "cpuacct")  # cpuacct: the CPU time used
DEFAULT_V2_PARENT = "/taper-sandbox"
CPU_PERIOD_US = 100_000
_STALE_S = 600.0  # a call's cgroup left this long by a worker that is gone is swept
_calls = itertools.count()


class CgroupUnavailable(RuntimeError):
    """Per-call cgroups cannot be made here; the message names what the operator must provide."""


@dataclass(frozen=True)
class CgroupParents:
    """Where a call's cgroups go: v2, one directory; v1, one directory per hierarchy (memory, pids, cpu,
    cpuacct; two may be the same when a hierarchy carries both, like cpu,cpuacct)."""

    version: Literal[1, 2]
    dirs: dict[str, str]  # hierarchy name ("unified" on v2) -> directory


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(fstype, mount point, root, options) of the cgroup filesystems this process sees."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if rfields and rfields[0] in ("cgroup", "cgroup2"):
                options = set(rfields[2].split(",")) if len(rfields) > 2 else set()
                found.append((rfields[0], fields[4], fields[3], options))
    return found


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and "unified" for v2."""
    paths: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else ["unified"]:
                paths[c] = path
    return paths


def _directory(mount_point: str, mount_root: str, cgroup_path: str) -> str:
    rel = os.path.relpath(cgroup_path, mount_root) if mount_root != "/" else cgroup_path.lstrip("/")
    if rel == ".." or rel.startswith("../"):
        raise CgroupUnavailable(f"the cgroup {cgroup_path} is outside the cgroup mount at {mount_point}")
    return os.path.normpath(os.path.join(mount_point, rel))


REQUIREMENT = (
    "The sandbox limits memory, processes and CPU per call with a cgroup: it needs cgroup v2 with the memory, "
    "pids and cpu controllers (or cgroup v1 hierarchies for memory, pids, cpu and cpuacct) and a parent cgroup "
    f"it may create children in: TAPER_SANDBOX_CGROUP (default: {DEFAULT_V2_PARENT} on v2, the worker's own "
    "cgroup on v1), writable by the worker's uid (as root the default works; otherwise delegate it, e.g. "
    "systemd's Delegate=yes). Only where that is impossible, TAPER_SANDBOX_LIMITS=per-process keeps rlimits "
    "alone, which bound each process and not the call.")


def _unavailable(problem: str) -> CgroupUnavailable:
    return CgroupUnavailable(f"{problem}. " + REQUIREMENT)


def find_parents(parent: str | None) -> CgroupParents:
    """Resolve (and on v2 prepare) the parent cgroup of the calls: `parent` is a cgroup path, absolute or
    relative to the worker's own cgroup; raises CgroupUnavailable saying what is missing."""
    mounts = _mounts()
    v1 = {c: m for m in mounts if m[0] == "cgroup" for c in _V1_HIERARCHIES if c in m[3]}
    v2 = next((m for m in mounts if m[0] == "cgroup2"), None)
    own = _own_cgroups()
    if all(c in v1 for c in _V1_HIERARCHIES):
        dirs = {}
        for c, (_, point, root, _) in v1.items():
            if c not in own:
                raise _unavailable(f"this process is in no {c} cgroup")
            dirs[c] = _directory(point, root, os.path.join(own[c], parent or ""))
        for d in dict.fromkeys(dirs.values()):
            if not os.path.isdir(d):
                raise _unavailable(f"the parent cgroup {d} does not exist")
        parents = CgroupParents(version=1, dirs=dirs)
        _sweep(parents)
        return parents
    if v2 is None:
        missing = ", ".join(c for c in _V1_HIERARCHIES if c not in v1)
        raise _unavailable(f"no cgroup filesystem here offers {missing}")
    if any(c in v1 for c in CONTROLLERS):
        raise _unavailable("the memory, pids and cpu controllers are split between cgroup v1 and v2")
    _, point, root, _ = v2
    directory = _directory(point, root, os.path.join(own.get("unified", "/"), parent or DEFAULT_V2_PARENT))
    _prepare_v2(directory, point)
    parents = CgroupParents(version=2, dirs={"unified": directory})
    _sweep(parents)
    return parents


def _sweep(parents: CgroupParents) -> None:
    """Remove the empty cgroups of calls whose worker died without removing them (killed mid-call). Only old
    ones: a worker in another pid namespace may share the parent, and its pids are not ours to look up."""
    for d in dict.fromkeys(parents.dirs.values()):
        with contextlib.suppress(OSError):
            for entry in os.scandir(d):
                fields = entry.name.split("-")
                if entry.is_dir() and fields[0] == "call" and len(fields) == 4 and fields[1].isdigit() \
                        and not os.path.exists(f"/proc/{fields[1]}") \
                        and time.time() - entry.stat().st_mtime > _STALE_S:
                    with contextlib.suppress(OSError):  # a cgroup with a process in it cannot be removed
                        os.rmdir(entry.path)


def _prepare_v2(directory: str, mount_point: str) -> None:
    """Make `directory` a cgroup whose children get the three controllers (enabling them in the cgroup above
    it first, where they are not yet handed down to it)."""
    wanted = " ".join("+" + c for c in CONTROLLERS)
    where = directory
    try:
        os.makedirs(directory, exist_ok=True)
        if not set(CONTROLLERS) <= set(_read(directory, "cgroup.controllers").split()):
            where = os.path.dirname(directory)
            if os.path.commonpath([where, mount_point]) != mount_point:
                raise OSError(errno.EPERM, "no cgroup above it to enable the controllers in")
            _write(where, "cgroup.subtree_control", wanted)
            where = directory
        _write(directory, "cgroup.subtree_control", wanted)
    except OSError as e:
        reason = (f"{where} holds processes (a cgroup v2 cgroup that hands controllers to its children must hold "
                  "none: move the workers into a leaf of their own, or name another parent)"
                  if e.errno == errno.EBUSY else f"{where}: {e.strerror or e}")
        raise _unavailable(f"cannot prepare the parent cgroup {directory} with the memory, pids and cpu "
                           f"controllers: {reason}") from None


def _read(directory: str, name: str) -> str:
    with open(os.path.join(directory, name)) as f:
        return f.read()


def _write(directory: str, name: str, value: str) -> None:
    with open(os.path.join(directory, name), "w") as f:
        f.write(value)


class CallCgroup:
    """The cgroup(s) of one call, created with its limits; `remove()` once the call's processes are gone."""

    def __init__(self, parents: CgroupParents, memory_bytes: int, max_processes: int, cpus: float) -> None:
        self.version = parents.version
        name = f"call-{os.getpid()}-{next(_calls)}-{secrets.token_hex(3)}"
        self.dirs: dict[str, str] = {h: os.path.join(d, name) for h, d in parents.dirs.items()}
        quota = max(int(cpus * CPU_PERIOD_US), 1000)
        try:
            for d in dict.fromkeys(self.dirs.values()):
                os.mkdir(d)
            if self.version == 2:
                d = self.dirs["unified"]
                _write(d, "memory.max", str(memory_bytes))
                with contextlib.suppress(FileNotFoundError):  # no swap accounting on this kernel
                    _write(d, "memory.swap.max", "0")
                _write(d, "memory.oom.group", "1")  # an OOM kill takes the whole call
                _write(d, "pids.max", str(max_processes))
                _write(d, "cpu.max", f"{quota} {CPU_PERIOD_US}")
            else:
                _write(self.dirs["memory"], "memory.limit_in_bytes", str(memory_bytes))
                with contextlib.suppress(FileNotFoundError):  # memsw only with swap accounting
                    _write(self.dirs["memory"], "memory.memsw.limit_in_bytes", str(memory_bytes))
                _write(self.dirs["pids"], "pids.max", str(max_processes))
                _write(self.dirs["cpu"], "cpu.cfs_period_us", str(CPU_PERIOD_US))
                _write(self.dirs["cpu"], "cpu.cfs_quota_us", str(quota))
        except OSError as e:
            self.remove()
            where = ", ".join(dict.fromkeys(self.dirs.values()))
            raise CgroupUnavailable(f"cannot create the call's cgroup ({where}): {e.strerror or e}. "
                                    + REQUIREMENT) from None

    @property
    def procs_files(self) -> list[str]:
        """The files the launcher writes its pid into, one per hierarchy."""
        return [os.path.join(d, "cgroup.procs") for d in dict.fromkeys(self.dirs.values())]

    def cpu_seconds(self) -> float:
        """CPU time used by the call's processes so far, alive or gone."""
        if self.version == 2:
            for line in _read(self.dirs["unified"], "cpu.stat").splitlines():
                key, _, value = line.partition(" ")
                if key == "usage_usec":
                    return int(value) / 1e6
            return 0.0
        return int(_read(self.dirs["cpuacct"], "cpuacct.usage")) / 1e9

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the call for going past `memory.max`."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        directory = self.dirs["unified" if self.version == 2 else "memory"]
        for line in _read(directory, name).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and int(value) > 0:
                return True
        return False

    def pids(self) -> list[int]:
        """The processes still in the call's cgroup."""
        d = self.dirs["unified" if self.version == 2 else "pids"]
        with contextlib.suppress(FileNotFoundError):
            return [int(p) for p in _read(d, "cgroup.procs").split()]
        return []

    def kill(self) -> None:
        """SIGKILL every process of the call (cgroup.kill on v2; one by one on v1)."""
        if self.version == 2:
            with contextlib.suppress(OSError):
                _write(self.dirs["unified"], "cgroup.kill", "1")
                return
        for pid in self.pids():
            with contextlib.suppress(OSError):
                os.kill(pid, 9)

    def remove(self) -> bool:
        """Remove the call's cgroups; False while a process is still in one (try again later)."""
        removed = True
        for d in dict.fromkeys(self.dirs.values()):
            try:
                os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError:
                removed = False
        return removed
