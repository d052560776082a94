"""Checkpoints that load anywhere: `taper checkpoints download` fetches a job's checkpoint from a live API (a
streamed tar), and plain transformers loads it with `trust_remote_code=True` in a fresh interpreter where none
of this project's packages can be imported; its logits equal our model's."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
from pathlib import Path

import pytest
import torch
from api_helpers import ThreadedServer
from typer.testing import CliRunner

from api.app import create_app
from api.cli.cli import app as cli
from model import TaperConfig, TaperForCausalLM
from rl_service.control.service import TaperService
from rl_service.control.settings import TaperSettings, get_settings
from rl_service.control.store import Store
from rl_service.spec import JobSpec
from rl_service.training.checkpoint import save_checkpoint

OUR_PACKAGES = ("model", "kernels", "rollout_workers", "reward_models", "rl_service", "api")

# Runs with `python -S` (no site: no .pth files, so no editable install of this project) from an empty
# directory; only the environment's site-packages (torch, transformers) goes back on the path.
LOAD_ELSEWHERE = textwrap.dedent("""
    import importlib.util, json, sys
    sys.path.append(sys.argv[1])
    assert not [p for p in {packages!r} if importlib.util.find_spec(p)], "our packages are importable"
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(sys.argv[2], trust_remote_code=True).eval()
    ids = torch.tensor(json.loads(sys.argv[3]))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    torch.save(logits, sys.argv[4])
    print(type(model).__module__)
""").format(packages=OUR_PACKAGES)


@pytest.fixture
def job_with_checkpoint(redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    store = Store(redis_url)
    service = TaperService(store, tmp_path / "data")
    key = store.create_api_key("alpha")
    job, _ = store.submit_job("alpha", JobSpec(total_steps=2), str(service.files.jobs_dir))
    torch.manual_seed(0)
    model = TaperForCausalLM(TaperConfig.preset("tiny")).eval()
    ckpt = save_checkpoint(Path(job.work_dir) / "checkpoints", 3, model, {"cursor": 0},
                           learner_state={"step": torch.tensor(3)})
    store.add_checkpoint(job.id, 3, ckpt.path.resolve().as_uri())
    with ThreadedServer(create_app(service, TaperSettings(data_dir=tmp_path / "data"))) as server:
        monkeypatch.setenv("TAPER_API_URL", server.url)
        monkeypatch.setenv("TAPER_API_KEY", key)
        get_settings.cache_clear()
        yield job.id, model, server, key
    get_settings.cache_clear()


def test_downloaded_checkpoint_loads_without_our_packages(job_with_checkpoint, tmp_path: Path) -> None:
    job_id, model, _, _ = job_with_checkpoint
    out = tmp_path / "downloads"
    result = CliRunner().invoke(cli, ["checkpoints", "download", job_id, "3", "-o", str(out)])
    assert result.exit_code == 0, result.output
    folder = out / f"{job_id}-step-3"
    files = {f.name for f in folder.iterdir()}
    assert {"config.json", "model.safetensors", "configuration_taper.py", "modeling_taper.py"} <= files
    assert not files & {"learner.pt", "rng.pt", "state.json"}  # the learner's state stays on the cluster
    assert json.loads((folder / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"] == \
        "modeling_taper.TaperForCausalLM"

    ids = torch.randint(0, model.config.vocab_size, (2, 21), generator=torch.Generator().manual_seed(1))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    logits_file = tmp_path / "logits.pt"
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "hf-modules"),
           "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-S", "-c", LOAD_ELSEWHERE, sysconfig.get_paths()["purelib"], str(folder),
         json.dumps(ids.tolist()), str(logits_file)],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "transformers_modules" in run.stdout  # the class came from the folder's own code
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    torch.testing.assert_close(torch.load(logits_file), expected, rtol=1e-5, atol=1e-5)


def test_download_errors(job_with_checkpoint, redis_url: str) -> None:
    job_id, _, server, key = job_with_checkpoint
    import httpx

    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}) as c:
        r = c.get(f"/v1/jobs/{job_id}/checkpoints/3/download")
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-tar"
        names = tarfile.open(fileobj=__import__("io").BytesIO(r.content)).getnames()
        assert f"{job_id}-step-3/model.safetensors" in names
        r = c.get(f"/v1/jobs/{job_id}/checkpoints/4/download")
        assert r.status_code == 404 and r.json()["error"]["field"] == "step"
        other = Store(redis_url).create_api_key("beta")
        r = c.get(f"/v1/jobs/{job_id}/checkpoints/3/download", headers={"Authorization": f"Bearer {other}"})
        assert r.status_code == 404 and r.json()["error"]["field"] == "job_id"
    result = CliRunner().invoke(cli, ["checkpoints", "download", job_id, "9"])
    assert result.exit_code == 1 and "404" in result.output and "Traceback" not in result.output
