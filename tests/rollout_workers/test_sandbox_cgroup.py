"""Where a call's cgroup goes and what is written into it, on both cgroup versions: pure logic over a directory
tree laid out as the kernel's (this machine has one version; the real one is exercised by every sandbox test
in test_sandbox.py, which kills calls past their memory and CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

import rollout_workers.environments.sandbox_cgroup as sandbox_cgroup
from rollout_workers.environments.sandbox_cgroup import CallCgroup, CgroupUnavailable, find_parents


def layout(monkeypatch: pytest.MonkeyPatch, mounts: list[tuple[str, str, str, set[str]]], own: dict[str, str]) -> None:
    monkeypatch.setattr(sandbox_cgroup, "_mounts", lambda: mounts)
    monkeypatch.setattr(sandbox_cgroup, "_own_cgroups", lambda: own)


def test_v2_parent_is_prepared_and_a_call_gets_its_limits(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.subtree_control").write_text("")
    layout(monkeypatch, [("cgroup2", str(root), "/", set())], {"unified": "/system.slice/worker"})
    # the parent exists already, with the controllers handed down to it (as the kernel shows them)
    parent = root / "taper-sandbox"
    parent.mkdir()
    (parent / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    parents = find_parents(None)
    assert parents.version == 2 and parents.dirs == {"unified": str(parent)}
    assert (parent / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"

    call = CallCgroup(parents, memory_bytes=128 << 20, max_processes=16, cpus=0.5)
    d = Path(call.dirs["unified"])
    assert d.parent == parent and call.procs_files == [str(d / "cgroup.procs")]
    assert [(d / f).read_text() for f in ("memory.max", "memory.oom.group", "pids.max", "cpu.max")] == \
        [str(128 << 20), "1", "16", "50000 100000"]
    (d / "cpu.stat").write_text("usage_usec 1250000\nuser_usec 1000000\n")
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 0\n")
    assert call.cpu_seconds() == 1.25 and not call.oom_killed()
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 2\noom_kill 1\n")
    assert call.oom_killed()
    for f in d.iterdir():  # a real cgroup's files go with it
        f.unlink()
    assert call.remove() and not d.exists()


def test_a_relative_parent_is_under_the_workers_own_cgroup_in_each_v1_hierarchy(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    mounts = [("cgroup", str(tmp_path / c), "/", {"rw", c}) for c in ("memory", "pids", "cpu", "cpuacct")]
    own = {"memory": "/jobs/42", "pids": "/", "cpu": "/", "cpuacct": "/"}
    for c, path in own.items():
        (tmp_path / c / path.lstrip("/") / "sandbox").mkdir(parents=True)
    layout(monkeypatch, mounts, own)
    parents = find_parents("sandbox")
    assert parents.version == 1
    assert parents.dirs["memory"] == str(tmp_path / "memory" / "jobs" / "42" / "sandbox")
    assert parents.dirs["pids"] == str(tmp_path / "pids" / "sandbox")
    call = CallCgroup(parents, memory_bytes=64 << 20, max_processes=8, cpus=1.0)
    assert Path(call.dirs["memory"], "memory.limit_in_bytes").read_text() == str(64 << 20)
    assert Path(call.dirs["cpu"], "cpu.cfs_quota_us").read_text() == "100000"
    assert len(call.procs_files) == 4
    Path(call.dirs["cpuacct"], "cpuacct.usage").write_text("2500000000\n")
    assert call.cpu_seconds() == 2.5


def test_refusals_name_the_requirement(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    layout(monkeypatch, [("cgroup", str(tmp_path), "/", {"memory"})], {"memory": "/"})
    with pytest.raises(CgroupUnavailable, match="no cgroup filesystem here offers pids, cpu, cpuacct") as e:
        find_parents(None)
    assert "TAPER_SANDBOX_CGROUP" in str(e.value) and "TAPER_SANDBOX_LIMITS=per-process" in str(e.value)
    layout(monkeypatch, [("cgroup", str(tmp_path), "/", {"memory"}), ("cgroup2", str(tmp_path), "/", set())],
           {"memory": "/", "unified": "/"})
    with pytest.raises(CgroupUnavailable, match="split between cgroup v1 and v2"):
        find_parents(None)
    root = tmp_path / "v2"
    root.mkdir()
    layout(monkeypatch, [("cgroup2", str(root), "/", set())], {"unified": "/"})
    (root / "taper-sandbox").mkdir()
    (root / "taper-sandbox" / "cgroup.controllers").write_text("io\n")  # not handed down, and none above
    (root / "cgroup.subtree_control").mkdir()  # a write that fails, as the kernel's does
    with pytest.raises(CgroupUnavailable, match="cannot prepare the parent cgroup .*taper-sandbox"):
        find_parents(None)
    with pytest.raises(CgroupUnavailable, match="outside the cgroup mount"):
        layout(monkeypatch, [("cgroup2", str(root), "/jobs", set())], {"unified": "/elsewhere"})
        find_parents("x")
