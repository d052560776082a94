"""A real multi-node Ray cluster on one machine: a head (1 CPU, `learner`) and a rollout node (2 CPUs,
`rollout`) as separate `ray start` processes. A tiny RL job's rollout workers must land on the rollout
node; that node is killed mid-job and a replacement joins; the job must finish with every group of every
step, its workers rescheduled onto the replacement.

The job runs in its own process (tests/deploy/multinode_job.py) so its Ray client never mixes with the
session's local Ray. Each node runs `ray start --block` in its own session; killing the session kills that
node's raylet and its workers and nothing else.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_workers.storage import read_trajectories, step_file

HERE = Path(__file__).parent
# a private throwaway cluster: no token auth (Ray turns it on by default for `ray start`)
CLUSTER_ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
               "RAY_agent_register_timeout_ms": "300000"}
AGENT_PORT_FLAGS = ("dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
                    "runtime-env-agent-port")
RAY = str(Path(sys.executable).with_name("ray"))
TOTAL_STEPS = 3
NUM_WORKERS = 1
PROMPTS, GENERATIONS = 2, 2  # as in multinode_job.tiny_spec


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def session_pids(sid: int) -> list[int]:
    """Every live process of a session (the node's `ray start --block` and all it started)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


class RayNode:
    """One `ray start --block` process tree, in its own session and temp dir. On a loaded machine a raylet
    can abort at startup (it waits a fixed time for its agents' port files), so a failed start is retried."""

    READY = "will now block forever"

    def __init__(self, args: list[str], temp_root: Path, name: str, attempts: int = 3, timeout: float = 120) -> None:
        self.args, self.temp_root, self.name = args, temp_root, name
        for attempt in range(attempts):
            self._spawn(f"{name}-{attempt}")
            if self._wait_ready(timeout):
                return
            self.kill()
        raise AssertionError(f"ray node {name} did not start in {attempts} attempts:\n{tail(self.log_path)}")

    def _spawn(self, tag: str) -> None:
        temp_dir = self.temp_root / tag
        temp_dir.mkdir()
        self.log_path = self.temp_root / f"{tag}.log"
        self.log = self.log_path.open("w")
        cmd = [RAY, "start", "--block", "--disable-usage-stats", f"--temp-dir={temp_dir}",
               "--object-store-memory", str(80 * 1024 * 1024),
               *(f"--{flag}={free_port()}" for flag in AGENT_PORT_FLAGS), *self.args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**CLUSTER_ENV, "PYTHONUNBUFFERED": "1"})

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.READY in self.log_path.read_text(errors="replace"):
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.5)
        return False

    def kill(self) -> None:
        """SIGKILL the node's whole session (raylet, object store, workers): a lost machine."""
        for _ in range(3):
            pids = session_pids(self.proc.pid)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if not self.log.closed:
            self.log.close()


@pytest.fixture
def cluster_dir() -> Iterator[Path]:
    # short: Ray's unix socket paths live under the temp dir and must stay under ~107 characters
    path = Path(tempfile.mkdtemp(prefix="tpr-"))
    yield path
    if not os.environ.get("TAPER_KEEP_MULTINODE_DIR"):  # set it to keep the nodes' logs for a post-mortem
        shutil.rmtree(path, ignore_errors=True)


def tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen, log: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"job process exited ({proc.returncode}) while waiting for {what}:\n{tail(log)}")
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}:\n{tail(log)}")


def progress_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_rollout_node_lost_mid_job_is_replaced_and_no_group_is_lost(cluster_dir: Path) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    nodes: list[RayNode] = []
    job: subprocess.Popen | None = None
    work_dir, progress, result = cluster_dir / "job", cluster_dir / "progress.jsonl", cluster_dir / "result.json"
    try:
        nodes.append(RayNode(["--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=1",
                              "--num-gpus=0", "--include-dashboard=false", '--resources={"learner": 1}'],
                             cluster_dir, "head"))
        job_log = (cluster_dir / "job.log").open("w")
        job = subprocess.Popen(
            [sys.executable, str(HERE / "multinode_job.py"), "--address", address, "--work-dir", str(work_dir),
             "--progress", str(progress), "--result", str(result), "--total-steps", str(TOTAL_STEPS),
             "--num-workers", str(NUM_WORKERS), "--hold-after-step", "0"],
            stdout=job_log, stderr=subprocess.STDOUT, env=CLUSTER_ENV,
        )
        # the rollout node joins after the driver connected: the driver then has one node on this IP to
        # attach to, and its rollout workers wait for the `rollout` resource to appear
        wait_for(lambda: progress.with_suffix(".connected").exists(), 120, "the driver to connect", job,
                 cluster_dir / "job.log")
        rollout_args = [f"--address={address}", "--node-ip-address=127.0.0.1", "--num-cpus=2", "--num-gpus=0",
                        f'--resources={{"rollout": {NUM_WORKERS}}}']
        nodes.append(RayNode(rollout_args, cluster_dir, "rollout-a"))
        first = wait_for(lambda: progress_lines(progress), 480, "the first training step", job, cluster_dir / "job.log")[0]
        node_a = first["worker_nodes"][0]
        assert node_a and first["worker_nodes"] == [node_a] * NUM_WORKERS, first

        nodes[1].kill()  # mid-job: the job holds after step 0, so step 1's rollouts meet the dead workers
        progress.with_suffix(".resume").write_text("")
        time.sleep(3)
        nodes.append(RayNode(rollout_args, cluster_dir, "rollout-b"))
        job.wait(timeout=400)
        assert result.exists(), tail(cluster_dir / "job.log")
        out = json.loads(result.read_text())
        assert out["error"] is None and out["outcome"] == "succeeded", out
        assert out["steps"] == list(range(TOTAL_STEPS))
        assert node_a != out["head_node"], "rollout workers ran on the head, which has no `rollout` resource"

        lines = progress_lines(progress)
        # step 1 ran its rollouts after the kill: its groups went to replacement workers on the new node
        for line in lines[1:]:
            node_b = line["worker_nodes"][0]
            assert node_b not in (None, node_a, out["head_node"]), lines
            assert line["worker_nodes"] == [node_b] * NUM_WORKERS, lines
            assert line["worker_restarts"] >= NUM_WORKERS, lines
        # no group lost: every step trained on all its groups, each complete and without infra failures
        for t in range(TOTAL_STEPS):
            trajs = read_trajectories(step_file(work_dir / "trajectories", t), limit=1000)
            sizes = Counter(tj.group_id for tj in trajs)
            assert len(sizes) == PROMPTS and set(sizes.values()) == {GENERATIONS}, (t, sizes)
            assert not [tj.id for tj in trajs if tj.status.is_infra_failure], t
        # the scheduler's bundles of the same spec: the learner on the `learner` node (the head), each
        # rollout worker on the `rollout` node (the replacement)
        node_b = lines[-1]["worker_nodes"][0]
        assert out["placement"] == {"learner_nodes": [out["head_node"]], "rollout_nodes": [node_b] * NUM_WORKERS}

        # teardown: nothing of the cluster is left running
        for node in reversed(nodes):
            node.kill()
        assert not [pid for node in nodes for pid in session_pids(node.proc.pid)], "ray processes left behind"
    finally:
        if job is not None and job.poll() is None:
            job.kill()
            job.wait(timeout=10)
        for node in reversed(nodes):
            node.kill()
