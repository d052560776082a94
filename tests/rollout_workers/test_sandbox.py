"""The python environment's sandbox under attack, with the real bubblewrap: as root (the worker as CI runs
it) and as an unprivileged user (the worker as the images run it). Each attack prints what got through;
a test fails if anything did: the network, host files (read or write), the parent's environment, an
unbounded fork, a process that outlives the call. Ordinary programs still run; where the sandbox cannot
run, the python environment refuses to start, unless the operator chose the unsafe mode by name."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import json
import os
import platform
import secrets
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import rollout_workers.environments.sandbox as sandbox_module
import rollout_workers.environments.sandbox_cgroup as sandbox_cgroup
from rollout_workers.environments.python_env import PythonEnv
from rollout_workers.environments.sandbox import (
    SANDBOX_UID,
    SandboxConfig,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    check_sandbox,
    run_python,
)

REPO = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("sandbox_runner.py")
SECRET_VAR = "TAPER_TEST_SANDBOX_SECRET"
LIMITS = SandboxLimits(cpu_seconds=5, memory_bytes=256 * 1024 * 1024, output_bytes=64 * 1024, wall_seconds=20.0)

Run = Callable[..., SandboxResult]


@pytest.fixture(scope="module")
def secret() -> Iterator[str]:
    token = "s3cret-" + secrets.token_hex(8)
    os.environ[SECRET_VAR] = token
    yield token
    del os.environ[SECRET_VAR]


@pytest.fixture(scope="module")
def delegated_cgroup() -> Iterator[tuple[str, list[str]]]:
    """A parent cgroup delegated to SANDBOX_UID, as an operator sets one up for an unprivileged worker:
    (TAPER_SANDBOX_CGROUP, the cgroup.procs files the worker must start in). v1: a child of this process's
    cgroup in each hierarchy, owned by the uid. v2: a parent whose children get the controllers, owned by
    the uid, with the worker in a leaf of its own (a cgroup v2 parent with controllers holds no process)."""
    name = "taper-test-" + secrets.token_hex(4)
    try:
        parents = sandbox_cgroup.find_parents("/" + name)
    except sandbox_cgroup.CgroupUnavailable:
        parents = sandbox_cgroup.find_parents(None)  # v1: the parent must exist; make it under our own
    made: list[str] = []
    if parents.version == 2:
        parent = parents.dirs["unified"]
        worker = os.path.join(parent, "worker")
        os.mkdir(worker)
        made += [worker, parent]
        owned = [parent, os.path.join(parent, "cgroup.procs"), worker, os.path.join(worker, "cgroup.procs")]
        setting, start_in = "/" + name, [os.path.join(worker, "cgroup.procs")]
    else:
        owned = []
        for d in dict.fromkeys(parents.dirs.values()):
            child = os.path.join(d, name)
            os.mkdir(child)
            made.append(child)
            owned += [child, os.path.join(child, "cgroup.procs"), os.path.join(child, "tasks")]
        setting, start_in = name, []
    for path in owned:
        os.chown(path, SANDBOX_UID, SANDBOX_UID)
    yield setting, start_in
    for d in made:
        with contextlib.suppress(OSError):
            os.rmdir(d)


@pytest.fixture(params=["root", "unprivileged"])
def run(request: pytest.FixtureRequest, secret: str) -> Run:
    """Make a sandbox call as the given worker user: `run(code, limits=LIMITS, stdin="")`."""
    if request.param == "root":
        if os.geteuid() != 0:
            pytest.skip("the worker-as-root case needs a root test run (CI runs as root)")
        return lambda code, limits=LIMITS, stdin="": run_python(code, limits, stdin)
    if os.geteuid() != 0:
        return lambda code, limits=LIMITS, stdin="": run_python(code, limits, stdin)
    cgroup, start_in = request.getfixturevalue("delegated_cgroup")

    def run_unprivileged(code: str, limits: SandboxLimits = LIMITS, stdin: str = "") -> SandboxResult:
        request = {"code": code, "limits": dataclasses.asdict(limits), "stdin": stdin}
        env = {SECRET_VAR: secret, "TAPER_SANDBOX_CGROUP": cgroup}
        return SandboxResult(**unprivileged_worker(request, env, start_in))

    return run_unprivileged


def unprivileged_worker(request: dict[str, object], env: dict[str, str], start_in: list[str]) -> dict[str, object]:
    """Run sandbox_runner.py as uid 65534 (started in the cgroups `start_in`) and return what it prints."""
    python = sandbox_module._sandbox_python(SandboxConfig(), as_root=True)  # one uid 65534 can run
    # the sandbox's own launcher: into the worker's cgroup, then down to the uid, then the worker
    launch = [sys.executable, "-I", "-S", "-c", sandbox_module._LAUNCHER, str(SANDBOX_UID), str(len(start_in)),
              *start_in]
    proc = subprocess.run([*launch, python, str(RUNNER), sandbox_module.__file__], input=json.dumps(request),
                          capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin", **env}, cwd="/")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture
def host_dir(secret: str) -> Iterator[Path]:
    """A directory any user may read and write, holding a secret: only the sandbox keeps code out of it."""
    d = Path(tempfile.mkdtemp(prefix="taper-sandbox-host-", dir="/tmp"))
    d.chmod(0o777)
    (d / "secret.txt").write_text(secret)
    (d / "secret.txt").chmod(0o666)
    yield d
    shutil.rmtree(d)


def processes_with(marker: str) -> list[int]:
    """Host pids (any namespace, any user) whose command line holds `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if marker.encode() in Path("/proc", entry, "cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                pass
    return found


def run_watching(run: Run, code: str, limits: SandboxLimits, marker: str) -> tuple[SandboxResult, int]:
    """Run `code` in a thread while counting, from the host, the processes carrying `marker`: returns the
    result and the most seen at once (so a test can tell its check would have seen them)."""
    results: list[SandboxResult] = []
    thread = threading.Thread(target=lambda: results.append(run(code, limits)))
    thread.start()
    most = 0
    while thread.is_alive():
        most = max(most, len(processes_with(marker)))
        time.sleep(0.05)
    thread.join()
    return results[0], most


# ---------------------------------------------------------------------------------------------- attacks

def test_network_is_unreachable(run: Run, host_dir: Path) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    abstract = socket.socket(socket.AF_UNIX)
    abstract_name = b"\0taper-sandbox-test-" + secrets.token_hex(4).encode()
    abstract.bind(abstract_name)
    abstract.listen()
    abstract.setblocking(False)
    unix_path = host_dir / "tool.sock"
    on_disk = socket.socket(socket.AF_UNIX)
    on_disk.bind(str(unix_path))
    unix_path.chmod(0o777)
    on_disk.listen()
    on_disk.setblocking(False)
    code = f"""
import socket
reached = []
def attempt(name, fn):
    try:
        fn()
        reached.append(name)
    except OSError as e:
        print(name, "blocked:", repr(e))
attempt("tcp-loopback", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=2))
attempt("tcp6-loopback", lambda: socket.create_connection(("::1", {port}), timeout=2))
attempt("tcp-outside", lambda: socket.create_connection(("1.1.1.1", 80), timeout=2))
attempt("udp-outside", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("8.8.8.8", 53)))
attempt("dns", lambda: socket.getaddrinfo("example.com", 80))
attempt("unix-abstract", lambda: socket.socket(socket.AF_UNIX).connect({abstract_name!r}))
attempt("unix-path", lambda: socket.socket(socket.AF_UNIX).connect({str(unix_path)!r}))
print("REACHED", reached)
"""
    try:
        r = run(code)
        assert "REACHED []" in r.stdout, r.stdout + r.stderr
        for s in (listener, abstract, on_disk):
            with pytest.raises(BlockingIOError):  # nobody connected
                s.accept()
    finally:
        for s in (listener, abstract, on_disk):
            s.close()


def test_host_files_cannot_be_read(run: Run, host_dir: Path, secret: str) -> None:
    targets = [
        host_dir / "secret.txt", host_dir, REPO / "pyproject.toml", REPO, Path(sandbox_module.__file__),
        Path(sys.prefix) / "pyvenv.cfg", Path(sysconfig.get_paths()["purelib"]), Path.home(), Path("/home"),
        Path("/root"), Path("/etc/passwd"), Path("/etc/hostname"), Path("/etc/ssl"), Path("/var"),
        Path("/tmp") / host_dir.name,
    ]
    code = f"""
import os
for p in {[str(t) for t in targets]!r}:
    try:
        if os.path.isdir(p):
            print("LISTED" if os.listdir(p) else "EMPTY", p)
        else:
            print("READ", p, open(p, "rb").read(200))
    except OSError as e:
        print("blocked", p, e.errno)
try:
    import pytest
    print("IMPORTED installed package pytest")
except ImportError:
    pass
print("DONE")
"""
    r = run(code)
    assert "DONE" in r.stdout, r.stderr
    leaks = [line for line in r.stdout.splitlines() if line.startswith(("LISTED", "READ", "IMPORTED"))]
    assert not leaks and secret not in r.stdout


def test_host_files_cannot_be_written(run: Run, host_dir: Path) -> None:
    tag = secrets.token_hex(4)
    new_files = [host_dir / f"pwned-{tag}", REPO / f"pwned-{tag}", Path(sys.prefix) / f"pwned-{tag}.pth",
                 Path(f"/pwned-{tag}"), Path(f"/dev/pwned-{tag}"), Path(f"/proc/pwned-{tag}"), Path(f"/tmp/pwned-{tag}")]
    existing = [host_dir / "secret.txt", Path(sandbox_module.__file__), Path(sys.executable)]
    # Opening for writing is the proof; nothing is written, so a failing run damages nothing.
    code = f"""
import os, sys
for p in {[str(f) for f in new_files[:-1]]!r} + [os.path.join(os.path.dirname(os.__file__), "pwned-{tag}.py")]:
    try:
        os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
        print("CREATED", p)
    except OSError as e:
        print("blocked", p, e.errno)
for p in {[str(f) for f in existing]!r} + [sys.executable, os.__file__]:
    try:
        os.close(os.open(p, os.O_WRONLY))
        print("OPENED FOR WRITING", p)
    except OSError as e:
        print("blocked", p, e.errno)
with open("/tmp/pwned-{tag}", "w") as f:  # its own private /tmp
    f.write("scratch")
print(open("/tmp/pwned-{tag}").read())
"""
    try:
        r = run(code)
        assert "scratch" in r.stdout and "CREATED" not in r.stdout and "OPENED" not in r.stdout, r.stdout + r.stderr
        assert not any(p.exists() for p in new_files)
    finally:
        for p in new_files:
            if p.is_file():
                p.unlink()


def test_parent_environment_is_not_visible(run: Run, secret: str) -> None:
    code = """
import os
print(sorted(os.environ))
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            print(pid, open(f"/proc/{pid}/environ", "rb").read())
        except OSError as e:
            print(pid, "blocked", e.errno)
print("DONE")
"""
    r = run(code)
    assert "DONE" in r.stdout
    assert secret not in r.stdout and SECRET_VAR not in r.stdout
    assert r.stdout.splitlines()[0] == "['HOME', 'LANG', 'PATH', 'PWD']"


def test_fork_is_bounded(run: Run) -> None:
    limits = dataclasses.replace(LIMITS, max_processes=12, wall_seconds=10.0)
    code = """
import os, time
n = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
except OSError as e:
    print("forked", n, "then", e.errno)
"""
    r = run(code, limits)
    forked, errno = int(r.stdout.split()[1]), int(r.stdout.split()[3])
    assert errno == 11 and 1 <= forked <= limits.max_processes - 2  # EAGAIN; bwrap's pid 1 and us count


def test_fork_bomb_is_contained_and_killed(run: Run) -> None:
    marker = "taper-forkbomb-" + secrets.token_hex(4)
    limits = dataclasses.replace(LIMITS, max_processes=12, wall_seconds=3.0)
    code = f"""
import os, sys
bomb = "import os\\nwhile True:\\n    try:\\n        os.fork()\\n    except OSError:\\n        pass\\n"
os.execv(sys.executable, [sys.executable, "-c", bomb, {marker!r}])
"""
    r, most = run_watching(run, code, limits, marker)
    assert r.timed_out and r.duration_s < 10
    assert 2 <= most <= limits.max_processes  # it did fork, never past the limit
    assert processes_with(marker) == []
    assert run("print('still fine')").stdout == "still fine\n"


@pytest.mark.parametrize("ending", ["exits", "times-out"])
def test_no_process_outlives_the_call(run: Run, ending: str) -> None:
    marker = "taper-daemon-" + secrets.token_hex(4)
    then = "time.sleep(60)" if ending == "times-out" else "time.sleep(1)"
    code = f"""
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.closerange(0, 3)  # a proper daemon: it does not hold the call's output open
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(120)", {marker!r}])
    os._exit(0)
os.wait()
print("daemon started", flush=True)
{then}
"""
    r, most = run_watching(run, code, dataclasses.replace(LIMITS, wall_seconds=3.0), marker)
    assert r.stdout == "daemon started\n" and r.timed_out == (ending == "times-out")
    assert most == 1  # the daemon ran, seen from the host
    assert processes_with(marker) == []  # and is gone once the call returns


def test_cancelled_call_leaves_no_process() -> None:
    """The agent loop times a tool call out by cancelling it: the program and its daemons die then, not
    at their own (longer) wall-clock limit."""
    marker = "taper-cancel-" + secrets.token_hex(4)
    code = f"""
import os, sys, subprocess, time
subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(120)", {marker!r}])
time.sleep(60)
"""
    env = PythonEnv(wall_seconds=60)

    async def call_then_cancel() -> int:
        task = asyncio.ensure_future(env.call("run_python", {"code": code}))
        deadline = time.monotonic() + 20
        while not processes_with(marker) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        seen = len(processes_with(marker))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return seen

    assert asyncio.run(call_then_cancel()) == 1
    assert processes_with(marker) == []


def test_a_killed_worker_leaves_no_sandbox_behind() -> None:
    """The worker process dies mid-call (SIGKILL, no cleanup of its own): its sandboxes die with it."""
    marker = "taper-orphan-" + secrets.token_hex(4)
    code = f"""
import os, sys, time
if os.fork() == 0:
    os.setsid()
    os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(120)", {marker!r}])
time.sleep(60)
"""
    worker = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfrom rollout_workers.environments.sandbox import run_python\n"
                               "run_python(sys.stdin.read())"],
        stdin=subprocess.PIPE, text=True, cwd=REPO)
    assert worker.stdin
    worker.stdin.write(code)
    worker.stdin.close()
    deadline = time.monotonic() + 30
    while not processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(processes_with(marker)) == 1
    worker.kill()
    worker.wait()
    deadline = time.monotonic() + 5  # the kernel delivers the parent-death signals asynchronously
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(marker) == []


FILTERED_X86_64 = [("bpf", 321), ("userfaultfd", 323), ("perf_event_open", 298), ("keyctl", 250),
                   ("io_uring_setup", 425), ("ptrace", 101), ("x32-getpid", 39 | 0x40000000)]


def test_escape_tricks_that_beat_the_old_audit_hook_gain_nothing(run: Run) -> None:
    """No Python-level hook to switch off any more: subprocesses and ctypes work, and stay inside; the
    seccomp filter answers the kernel interfaces sandboxes are usually escaped through with ENOSYS."""
    code = """
import ctypes, os, subprocess, sys
libc = ctypes.CDLL(None, use_errno=True)
print("unshare-user", libc.unshare(0x10000000))
print("unshare-net", libc.unshare(0x40000000))
print("mount", libc.mount(b"none", b"/usr", b"tmpfs", 0, None))
try:
    os.setuid(0)
    print("setuid", "ROOT")
except OSError:  # uid 0 is not even mapped
    print("setuid", -1)
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print("caps", status["CapEff"].strip(), status["CapPrm"].strip(), status["NoNewPrivs"].strip())
child = subprocess.run([sys.executable, "-c", "import os; print(os.getppid(), len(os.listdir('/proc')))"],
                       capture_output=True, text=True)
print("child", child.stdout.strip())
print("pids", sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
for name, nr in SYSCALLS:  # kernel interfaces the seccomp filter takes away
    print(name, libc.syscall(nr, 0, 0, 0, 0, 0), ctypes.get_errno())
""".replace("SYSCALLS", repr(FILTERED_X86_64 if platform.machine() == "x86_64" else []))
    r = run(code)
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    for name, _ in FILTERED_X86_64 if platform.machine() == "x86_64" else []:
        assert lines[name] == f"-1 {errno.ENOSYS}", (name, lines[name])
    assert (lines["unshare-user"], lines["unshare-net"], lines["mount"], lines["setuid"]) == ("-1",) * 4
    assert lines["caps"] == "0000000000000000 0000000000000000 1"
    assert lines["child"].split()[0] == "2"  # a subprocess runs, inside the sandbox's pid namespace
    assert max(json.loads(lines["pids"])) < 20  # it sees only its own processes, not the host's


def test_a_call_that_forks_past_its_memory_is_killed_as_a_whole(run: Run) -> None:
    """Memory is the call's, not each process's: eight children of 40 MB each (every one far below its
    address-space rlimit) exceed a 128 MB call, which is killed, and the result says why."""
    limits = dataclasses.replace(LIMITS, memory_bytes=128 * 1024 * 1024, wall_seconds=20.0)
    code = """
import os, time
for _ in range(8):
    if os.fork() == 0:
        block = bytearray(40 * 1024 * 1024)
        for i in range(0, len(block), 4096):
            block[i] = 1
        time.sleep(15)
        os._exit(0)
time.sleep(15)
print("ALL HELD")
"""
    r = run(code, limits)
    assert r.exceeded == "memory" and "ALL HELD" not in r.stdout, r
    assert not r.timed_out and r.duration_s < 15
    assert "memory limit" in r.summary()


def test_memfd_pages_count_against_the_call(run: Run) -> None:
    """shmem (memfds, the tmpfs) is not address space: only the call's cgroup sees it."""
    limits = dataclasses.replace(LIMITS, memory_bytes=96 * 1024 * 1024, wall_seconds=20.0)
    code = """
import os
held = []
for _ in range(40):  # 320 MB in memory files, never mapped
    fd = os.memfd_create("hold")
    os.write(fd, b"x" * (8 * 1024 * 1024))
    held.append(fd)
print("HELD", len(held))
"""
    r = run(code, limits)
    assert r.exceeded == "memory" and "HELD" not in r.stdout, r


def test_a_call_that_forks_past_its_cpu_time_is_killed_as_a_whole(run: Run) -> None:
    """CPU time is the call's: four busy children and their parent share one second, measured by the
    call's cgroup, not a second each (RLIMIT_CPU restarts with every fork)."""
    limits = dataclasses.replace(LIMITS, cpu_seconds=1, wall_seconds=20.0)
    code = """
import os
for _ in range(4):
    if os.fork() == 0:
        while True:
            pass
while True:
    pass
"""
    r = run(code, limits)
    assert r.exceeded == "cpu" and not r.timed_out, r
    assert r.cpu_s is not None and 1.0 < r.cpu_s < 1.6, r.cpu_s
    assert "CPU-time limit" in r.summary()
    r = run("print(sum(range(10**6)))", limits)  # below the budget: untouched, and measured
    assert r.exceeded is None and r.exit_code == 0 and r.cpu_s is not None and 0 < r.cpu_s < 1.0


def test_socket_families_outside_the_network_namespace_are_refused(run: Run) -> None:
    """vsock reaches the hypervisor, not the network namespace: it (and every family but the four the
    sandbox needs) fails as unsupported, through socket(), socketpair() and a raw syscall whose family
    carries high bits the kernel drops."""
    code = """
import ctypes, socket
libc = ctypes.CDLL(None, use_errno=True)
def attempt(name, fn):
    try:
        fn().close()
        print(name, "OPEN")
    except OSError as e:
        print(name, e.errno)
attempt("vsock", lambda: socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM))
attempt("packet", lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW))
attempt("unix", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
attempt("inet", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
attempt("inet6", lambda: socket.socket(socket.AF_INET6, socket.SOCK_STREAM))
pair = (ctypes.c_int * 2)()
print("vsock-pair", libc.socketpair(socket.AF_VSOCK, socket.SOCK_STREAM, 0, pair), ctypes.get_errno())
print("vsock-high-bits", libc.syscall(41, ctypes.c_long(socket.AF_VSOCK | 1 << 32), socket.SOCK_STREAM, 0),
      ctypes.get_errno())
"""
    r = run(code)
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    unsupported = str(errno.EAFNOSUPPORT)
    if platform.machine() == "x86_64":
        assert (lines["vsock"], lines["packet"]) == (unsupported, unsupported), r.stdout + r.stderr
        assert lines["vsock-pair"] == lines["vsock-high-bits"] == f"-1 {unsupported}"
    assert lines["unix"] == lines["inet"] == lines["inet6"] == "OPEN"


def test_text_without_an_encoding_becomes_replacement_characters() -> None:
    """A lone surrogate is valid in JSON tool-call arguments and has no UTF-8: the tool result shows U+FFFD."""
    env = PythonEnv()
    out = asyncio.run(env.call("run_python", {"code": 'print("a\ud800b", len("\udfff"))\n# \ud83d'}))
    assert out == "a\ufffdb 1\n"
    r = run_python("import sys\nprint(repr(sys.stdin.read()))", LIMITS, stdin="x\udc80y")
    assert r.stdout == "'x\ufffdy'\n"


def test_runs_under_uvloop_as_the_worker_user() -> None:
    """Ray workers run uvloop, which takes no user/group arguments for a subprocess: a call and a python
    grader work on it as they do on plain asyncio (as root here when the suite runs as root)."""
    import uvloop

    from reward_models.graders.base import GradeContext
    from reward_models.graders.python_grader import PythonGrader

    loop = uvloop.new_event_loop()
    try:
        r = loop.run_until_complete(sandbox_module.run_python_async("import os\nprint(os.getuid())", LIMITS))
    finally:
        loop.close()
    assert (r.exit_code, r.stdout) == (0, f"{SANDBOX_UID if os.geteuid() == 0 else os.getuid()}\n"), r
    grader = PythonGrader(name="g", source="def grade(sample, item):\n    return 0.75")

    async def grade_on_the_loop() -> float:  # as the scorer does: from inside the worker's running loop
        return grader.grade({}, {"output_text": "x"}, GradeContext())

    policy = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())  # asyncio.run in the grader's thread: uvloop too
    try:
        assert asyncio.run(grade_on_the_loop()) == 0.75
    finally:
        asyncio.set_event_loop_policy(policy)


# ---------------------------------------------------------------------------------------------- ordinary code

def test_ordinary_programs_run(run: Run) -> None:
    code = """
import json, math, multiprocessing, os, sys, tempfile, threading
def square(x):
    return x * x
with multiprocessing.Pool(2) as pool:  # workers find `square` in __main__ by name
    squares = sum(pool.map(square, range(100)))
data = sys.stdin.read()
with open("notes.txt", "w") as f:
    f.write(data.upper())
with tempfile.NamedTemporaryFile("w+") as t:
    t.write("tmp ok")
    t.flush()
    t.seek(0)
    tmp = t.read()
out = []
th = threading.Thread(target=lambda: out.append(math.factorial(20)))
th.start()
th.join()
print(json.dumps({"stdin": open("notes.txt").read(), "tmp": tmp, "thread": out[0], "pool": squares, "cwd": os.getcwd(),
                  "pi": round(math.pi, 5), "text": "naïve ✓"}, ensure_ascii=False))
"""
    r = run(code, stdin="hello sandbox")
    assert (r.exit_code, r.timed_out, r.sandboxed, r.stderr) == (0, False, True, "")
    assert json.loads(r.stdout) == {"stdin": "HELLO SANDBOX", "tmp": "tmp ok", "thread": 2432902008176640000,
                                    "pool": 328350, "cwd": "/tmp", "pi": 3.14159, "text": "naïve ✓"}
    r = run("import sys\nprint('partial')\nsys.exit(3)")
    assert (r.stdout, r.exit_code) == ("partial\n", 3)
    r = run("1 / 0")
    assert r.exit_code == 1 and r.stderr.startswith('Traceback (most recent call last):\n  File "main.py", line 1')


def test_scratch_space_and_open_files_are_capped(run: Run) -> None:
    limits = dataclasses.replace(LIMITS, tmpfs_bytes=4 * 1024 * 1024, max_open_files=32)
    code = """
import os
try:
    with open("big", "wb") as f:
        for _ in range(16):
            f.write(b"x" * (1024 * 1024))
    print("WROTE 16 MiB")
except OSError as e:
    print("disk", e.errno)
os.remove("big")
files = []
try:
    for i in range(100):
        files.append(open("/dev/null"))
except OSError as e:
    print("files", len(files), e.errno)
"""
    r = run(code, limits)
    lines = r.stdout.splitlines()
    assert lines[0] in ("disk 27", "disk 28"), r.stdout + r.stderr  # EFBIG or ENOSPC
    assert lines[1].startswith("files ") and lines[1].endswith(" 24") and int(lines[1].split()[1]) < 32


# ---------------------------------------------------------------------------------------------- refusals

def test_refuses_to_start_without_bwrap(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-bwrap")
    with pytest.raises(SandboxUnavailable, match="bubblewrap not found") as e:
        check_sandbox(SandboxConfig(bwrap=missing))
    assert "apt-get install bubblewrap" in str(e.value) and "TAPER_SANDBOX_MODE=unsafe-rlimits-only" in str(e.value)
    monkeypatch.setenv("TAPER_SANDBOX_BWRAP", missing)
    with pytest.raises(SandboxUnavailable, match="TAPER_SANDBOX_BWRAP"):
        PythonEnv()
    with pytest.raises(SandboxUnavailable):
        run_python("print('ran anyway')")
    monkeypatch.delenv("TAPER_SANDBOX_BWRAP")
    monkeypatch.setenv("TAPER_SANDBOX_PYTHON", str(tmp_path / "no-such-python"))
    with pytest.raises(SandboxUnavailable, match="TAPER_SANDBOX_PYTHON: .* is not an executable interpreter"):
        PythonEnv()
    monkeypatch.setenv("TAPER_SANDBOX_MODE", "off")
    with pytest.raises(SandboxUnavailable, match="TAPER_SANDBOX_MODE: must be one of bwrap, unsafe-rlimits-only"):
        PythonEnv()


def test_refuses_to_start_without_user_namespaces() -> None:
    """A worker where user namespaces are off: run the check inside a real bwrap that disables them."""
    bwrap = shutil.which("bwrap")
    assert bwrap, "bubblewrap must be installed for these tests (scripts/setup.sh installs it)"
    check = ("from rollout_workers.environments.sandbox import SandboxUnavailable, check_sandbox\n"
             "try:\n    check_sandbox()\n    print('STARTED')\nexcept SandboxUnavailable as e:\n    print(e)\n")
    # a fresh /tmp, with the checkout and the interpreter bound back where they are (a clone under /tmp)
    keep = dict.fromkeys(str(p) for p in (REPO, Path(sys.prefix), Path(sys.base_prefix),
                                          Path(os.path.realpath(sys.executable)).parent))
    binds = [arg for path in keep for arg in ("--ro-bind", path, path)]
    proc = subprocess.run(
        [bwrap, "--unshare-user", "--uid", "1000", "--gid", "1000", "--disable-userns", "--ro-bind", "/", "/",
         "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", *binds, "--chdir", str(REPO), "--", sys.executable,
         "-c", check],
        capture_output=True, text=True, timeout=60, env={"PATH": os.environ["PATH"]},
    )
    assert "STARTED" not in proc.stdout, proc.stdout + proc.stderr
    assert "bubblewrap cannot create the sandbox here" in proc.stdout, proc.stdout + proc.stderr
    assert "user namespaces" in proc.stdout and "TAPER_SANDBOX_MODE=unsafe-rlimits-only" in proc.stdout


def test_refuses_to_start_without_a_cgroup_it_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unprivileged worker with no cgroup delegated to it: the sandbox refuses, naming the requirement,
    unless the operator asks for per-process limits by name."""
    if os.geteuid() != 0:
        pytest.skip("needs root to start a worker as another uid")
    refused = unprivileged_worker({"check": True}, {}, [])
    assert "cgroup" in refused["error"] and "TAPER_SANDBOX_CGROUP" in refused["error"], refused
    assert "TAPER_SANDBOX_LIMITS=per-process" in refused["error"]
    assert unprivileged_worker({"check": True}, {"TAPER_SANDBOX_LIMITS": "per-process"}, []) == {}
    monkeypatch.setenv("TAPER_SANDBOX_LIMITS", "rlimits")
    with pytest.raises(SandboxUnavailable, match="TAPER_SANDBOX_LIMITS: must be one of cgroup, per-process"):
        PythonEnv()


def test_unsafe_mode_runs_only_when_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TAPER_SANDBOX_BWRAP", str(tmp_path / "no-such-bwrap"))
    monkeypatch.setenv("TAPER_SANDBOX_MODE", "unsafe-rlimits-only")
    env = PythonEnv(memory_mb=128)
    assert env.sandbox.mode == "unsafe-rlimits-only"
    assert asyncio.run(env.call("run_python", {"code": "print(6 * 7)"})) == "42\n"
    r = run_python("import os\nprint(sorted(os.environ))\nx = bytearray(512 * 1024 * 1024)", LIMITS,
                   config=SandboxConfig(mode="unsafe-rlimits-only"))
    assert not r.sandboxed and "MemoryError" in r.stderr  # the rlimits still hold
    assert SECRET_VAR not in r.stdout and r.stdout.startswith("['HOME', 'LANG', 'PATH'")

