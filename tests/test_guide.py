"""docs/environments.md followed as a new user would, with nothing written by hand beyond the guide's files:
the example package is installed into the venv and checked with `taper env check`; `taper serve`'s embedded
setup runs; both examples (the Python package, the HTTP server with /process) are registered over REST and
trained by their job files (a warm start on demonstrations, then RL with a schedule patched mid-run: 6 of the
files' 12 RL steps, to keep the suite short; docs/benchmarks/rl.md has the full runs); each ends with a checkpoint whose greedy rollout writes a well-formed `convert` call."""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from typer.testing import CliRunner

from api.cli.cli import app as cli
from api.cli.launcher import ApiServerProcess
from rl_service.control.local_services import stop_embedded
from rl_service.ports import free_port
from tests.waiting import wait_for

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PIP = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]


@pytest.fixture(scope="module")
def installed_example() -> Iterator[None]:
    """`pip install ./examples/unit_convert`, as the guide says; uninstalled afterwards."""
    subprocess.run([*PIP, str(EXAMPLES / "unit_convert")], check=True, capture_output=True, timeout=300)
    try:
        yield
    finally:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", "taper-unit-convert"],
                       capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def tool_server() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(EXAMPLES / "unit_convert_http" / "server.py"), "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _answers(url), 60, "the example tool server")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def _answers(url: str) -> bool:
    try:
        httpx.get(url, timeout=1)
        return True
    except httpx.TransportError:
        return False


@pytest.fixture(scope="module")
def service(installed_example: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """`TAPER_HTTP_ALLOW=127.0.0.1 taper serve` on a fresh data dir: the embedded Redis and Ray head."""
    data_dir = tmp_path_factory.mktemp("guide")
    env = {"TAPER_DATA_DIR": str(data_dir), "RAY_ADDRESS": "", "TAPER_HTTP_ALLOW": "127.0.0.1"}
    server = ApiServerProcess(data_dir / "api.log", env=env)
    server.env.pop("TAPER_REDIS_URL", None)
    try:  # a server that does not answer in time has already started the embedded services: stop them too
        server.start()
        key = (data_dir / "api-key").read_text().strip()
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
            yield client
    finally:
        server.stop()
        stop_embedded(data_dir)


def test_env_check_passes_on_the_installed_example(installed_example: None) -> None:
    result = CliRunner().invoke(cli, ["env", "check", "taper_unit_convert", "--tasks", "4"])
    assert result.exit_code == 0, result.output
    assert "4 demonstrations earn the full outcome reward" in result.output


@pytest.mark.timeout(1200)  # a warm start and six RL steps on a 2-core machine
@pytest.mark.parametrize("example", ["unit_convert", "unit_convert_http"])
def test_the_guide_trains_an_example_to_a_checkpoint_that_calls_its_tool(
        example: str, service: httpx.Client, tool_server: str, tmp_path: Path) -> None:
    registration = yaml.safe_load((EXAMPLES / example / "register.yaml").read_text())
    if registration["kind"] == "http":  # the guide's server runs on the port the test chose
        registration["base_url"] = tool_server
    r = service.post("/v1/environments", json=registration)
    assert r.status_code == 201, r.text
    spec = yaml.safe_load((EXAMPLES / example / "job.yaml").read_text())
    spec |= {"total_steps": 6, "eval_every": 3}  # the patch after step 2 still leaves steps on its version
    r = service.post("/v1/jobs", json=spec)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]

    wait_for(lambda: service.get(f"/v1/jobs/{job_id}").json()["step"] >= 2, 900, "two RL steps")
    r = service.patch(f"/v1/jobs/{job_id}/reward-schedule", json={"kind": "linear", "w_end": 0.0, "horizon": 4})
    assert r.status_code == 200, r.text
    job = wait_for(lambda: (j := service.get(f"/v1/jobs/{job_id}").json())["state"] in
                   ("succeeded", "failed", "cancelled") and j, 900, "the job to finish")
    assert job["state"] == "succeeded", job

    events = service.get(f"/v1/jobs/{job_id}/events", params={"limit": 1000}).json()["items"]
    kinds = [e["kind"] for e in events]
    assert "warm_start_done" in kinds and "schedule_patched" in kinds, kinds
    rows = service.get(f"/v1/jobs/{job_id}/metrics", params={"limit": 1000}).json()["items"]
    train = [r["metrics"] for r in rows if "time/step" in r["metrics"]]
    assert train[0]["warm_start/steps"] >= 1 and max(m["schedule/version"] for m in train) == 2
    evals = [r for r in rows if "eval/success_rate" in r["metrics"]]
    print(f"{example}: held-out success by step",  # the numbers of docs/benchmarks/rl.md
          [(r["step"], round(r["metrics"]["eval/success_rate"], 3)) for r in evals])
    if registration["kind"] == "http":  # the server's /process components reached the rewards
        trajs = service.get(f"/v1/jobs/{job_id}/trajectories", params={"limit": 20}).json()["items"]
        assert any("env/call_matches_task" in s["process_rewards"] or "call_matches_task" in s["process_rewards"]
                   for t in trajs for s in t["steps"]), trajs[0]["steps"]

    checkpoint = service.get(f"/v1/jobs/{job_id}/checkpoints").json()[-1]
    r = service.get(checkpoint["download_url"])  # the model folder, as a user downloads it
    assert r.status_code == 200, r.text
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        tar.extractall(tmp_path, filter="data")
    assert_greedy_rollout_calls_convert(tmp_path / f"{job_id}-step-{checkpoint['step']}")


def assert_greedy_rollout_calls_convert(path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import model  # noqa: F401  (registers the architecture with transformers)
    from rollout_workers.chat import as_template_tools
    from rollout_workers.parsing import parse_tool_calls

    sys.path.insert(0, str(EXAMPLES / "unit_convert"))
    try:
        from taper_unit_convert import UnitConvertEnv
    finally:
        sys.path.remove(str(EXAMPLES / "unit_convert"))
    env = UnitConvertEnv()
    task = UnitConvertEnv.generate_tasks(1, seed=12345)[0]
    tokenizer = AutoTokenizer.from_pretrained(path)
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": task["question"]}],
                                           tools=as_template_tools(env.tools()), tokenize=False,
                                           add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = policy.generate(ids, max_new_tokens=48, do_sample=False, pad_token_id=tokenizer.pad_token_id or 0)
    text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=False)
    calls = parse_tool_calls(text, {t["name"]: t for t in env.tools()})
    assert calls and calls[0].error is None and calls[0].name == "convert", text


