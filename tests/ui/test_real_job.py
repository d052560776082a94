"""The job page of a real running tiny job: the real JobRunner (tiny model, vLLM on CPU) in a detached driver on a
real local Ray, scheduled by the API process, watched and steered from headless Chromium. The tiny model is first
warm-started for a few seconds on gold calculator conversations, so its rollouts contain real tool calls (a random
model's turns are all cut off before any call closes).

The same job is also the real job's whole life over HTTP (it was a second real job of its own in
tests/api, a second vLLM start for the same path): submit -> running -> reward-schedule PATCH seen by the job in
its metrics -> succeeded, with its states and events, checkpoints and trajectories (filtered, paged) listed over
the REST API, and nothing left behind (placement group, embedded head) when the server stops. Killing a driver
and resuming it from its checkpoint is tested with a stand-in runner in
tests/rl_service/control/test_scheduler.py and with the real runner in
tests/rl_service/control/test_scheduler_real_job.py."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from synthetic import chart_data
from ui_helpers import ThreadedServer, log_in, screenshot, wait_js

from api.app import create_app
from rl_service.control.local_services import EMBEDDED_RECORD
from rl_service.control.settings import TaperSettings
from rl_service.control.store import Store

TINY_JOB = {
    "name": "ui-real",
    "model": {"preset": "tiny"},
    "environment": {"name": "calculator"},
    "tasks": {"seed": 0, "num_train": 16, "num_eval": 0},
    # the prompt is ~250 tokens, a calculator call ~30; a cooler temperature keeps the short warm start's format
    "rollout": {"num_workers": 1, "prompts_per_step": 2, "num_generations": 2, "max_turns": 2, "temperature": 0.5,
                "max_tokens_per_turn": 40, "max_total_tokens": 400, "kv_cache_gib": 0.25},
    "reward_schedule": {"kind": "linear", "w_start": 1.0, "w_end": 0.0, "horizon": 10},
    "resources": {"learner_cpus": 1, "rollout_cpus": 1},
    "total_steps": 4,
    "checkpoint_every": 1,
    "keep_last_checkpoints": 2,
}


def warm_started_tiny_model(out: Path, steps: int = 80) -> Path:
    """The tiny model after `steps` SFT steps on gold calculator conversations (~30 s on one CPU core): enough
    for it to write well-formed calculator calls, not to get the numbers right. Saved with its tokenizer."""
    import torch

    from model.config import TaperConfig
    from model.modeling import TaperForCausalLM
    from model.tokenizer import load_tokenizer
    from rl_service.training.sft import train_sft
    from rollout_workers.environments.registry import generate_tasks, make_env_factory

    torch.manual_seed(0)
    tokenizer = load_tokenizer()
    model = TaperForCausalLM(TaperConfig.preset("tiny", vocab_size=len(tokenizer)))
    env = make_env_factory("calculator")()
    gold = [env.demonstration(task) for task in generate_tasks("calculator", 64, seed=10_000)]
    # one intra-op thread: on a busy two-core machine two threads spin-wait on each other (measured 20 s per
    # step instead of 0.4 s)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_sft(model, tokenizer, gold, steps=steps, lr=3e-3, batch_size=4, seed=0, tools=env.tools())
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.slow
def test_real_job_lifecycle_over_http_and_its_page_updates_takes_a_schedule_patch_and_shows_trajectories(
        redis_url: str, ray_local, tmp_path: Path, page) -> None:
    key = Store(redis_url).create_api_key("ui-real")
    checkpoint = warm_started_tiny_model(tmp_path / "warm-start")
    # the warm start is a base model the operator offers; the tenant names it, never its path
    settings = TaperSettings(redis_url=redis_url, data_dir=tmp_path, base_models={"warm-start": checkpoint})
    with ThreadedServer(create_app(settings=settings)) as server:
        api = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        r = api.post("/v1/jobs", json={**TINY_JOB, "model": {"preset": "tiny", "checkpoint": "base:warm-start"}})
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        log_in(page, server.url, key, f"/ui/jobs/{job_id}")
        wait_js(page, "document.getElementById('schedule-chart').dataset.version === '1'")
        # the runner has read its schedule (and is starting its engines): steer it from the editor now
        page.wait_for_selector("#events li[data-kind=started]", state="attached", timeout=300_000)
        page.select_option("#schedule-form [name=kind]", "constant")
        page.fill("#schedule-form [name=w_start]", "0.5")
        wait_js(page, "document.getElementById('schedule-chart').dataset.proposed === '1'")
        with page.expect_response(lambda r: r.request.method == "PATCH") as resp:
            page.click("#schedule-apply")
        assert resp.value.status == 200 and resp.value.json()["version"] == 2
        wait_js(page, "document.getElementById('schedule-chart').dataset.version === '2'")
        current = next(t for t in chart_data(page, "schedule-chart") if t["meta"] == "current")
        patched_from = resp.value.json()["effective_from"]
        assert current["y"][patched_from:] == pytest.approx([0.5] * (len(current["y"]) - patched_from))

        # the curves grow while the job runs: watch what the page draws until the job ends
        state = "document.getElementById('job-state').dataset.state"
        points = "Number(document.getElementById('chart-rewards-raw')?.dataset.points || 0)"
        seen_running: set[int] = set()
        deadline = time.monotonic() + 420
        while (now := page.evaluate(f"[{state}, {points}]"))[0] not in ("succeeded", "failed", "cancelled"):
            assert time.monotonic() < deadline, f"the job did not finish: {now}"
            if now[0] == "running" and now[1] >= 1:
                if not seen_running:
                    screenshot(page, "real-job-running")
                seen_running.add(now[1])
            page.wait_for_timeout(100)
        assert now[0] == "succeeded", page.inner_text("#job-error")
        total = TINY_JOB["total_steps"]
        wait_js(page, f"{points} === {total}", timeout=15)
        # a partial curve was on the page while the job was running, and grew to the full one without a reload
        assert seen_running and min(seen_running) < total, seen_running

        # the runner used the patched schedule: the weight chart shows it and marks the version change
        used = next(t for t in chart_data(page, "chart-schedule") if t["meta"] == "schedule/weight")
        assert used["y"][-1] == pytest.approx(0.5)
        events = [li for li in page.eval_on_selector_all("#events li", "els => els.map(e => e.dataset.kind)")]
        assert "schedule_patched" in events and "schedule_applied" in events

        # the trajectories of the run, opened in the viewer with their tokens
        page.click("#traj-filter button[type=submit]")
        wait_js(page, "document.querySelectorAll('#traj-table tr[data-traj]').length === 16")
        trajs = api.get(f"/v1/jobs/{job_id}/trajectories", params={"limit": 50}).json()["items"]
        # a real call: parsed, run by the calculator, its result inserted into the conversation
        ran = [(t, c) for t in trajs for s in t["steps"] for c in s["tool_calls"]
               if c["name"] == "calculator" and c["result"] is not None]
        assert ran, [c for t in trajs for s in t["steps"] for c in s["tool_calls"]][:4]
        pick, call = ran[0]
        page.click(f"#traj-table tr[data-traj='{pick['id']}']")
        page.wait_for_selector("#traj-viewer .turn")
        assert page.locator("#traj-viewer .turn").count() == len(pick["steps"])
        tokens = sum(len(s["action_ids"]) + len(s["observation_ids"]) for s in pick["steps"])
        assert page.locator("#traj-viewer .tok").count() == tokens
        calls = sum(len(s["tool_calls"]) for s in pick["steps"])
        assert page.locator("#traj-viewer .tool-call").count() == calls
        shown = page.locator("#traj-viewer .tool-call[data-tool=calculator]").first
        assert call["arguments"]["expression"] in shown.locator(".tool-args").inner_text()
        assert shown.locator(".tool-result").inner_text() == call["result"]
        # the turn's process rewards are on the page, one chip per component
        chips = page.locator("#traj-viewer .turn[data-turn='0'] .chip").count()
        assert chips == len(pick["steps"][0]["process_rewards"]) > 0
        page.hover("#traj-viewer .tok.act >> nth=0")
        assert "logprob" in page.inner_text("#token-readout")
        screenshot(page, "real-job-done")
        assert page.console_errors == []

        # the same finished job over HTTP: its whole life in the REST API
        final = api.get(f"/v1/jobs/{job_id}").json()
        assert final["state"] == "succeeded" and final["attempts"] == 1 and final["step"] == total
        metrics = api.get(f"/v1/jobs/{job_id}/metrics").json()["items"]
        train = [m for m in metrics if "schedule/version" in m["metrics"]]
        assert [m["step"] for m in train] == list(range(total))
        assert train[-1]["metrics"]["schedule/version"] == 2.0  # the PATCH reached the job
        assert train[-1]["metrics"]["schedule/weight"] == 0.5
        events = api.get(f"/v1/jobs/{job_id}/events", params={"limit": 1000}).json()["items"]
        kinds = [e["kind"] for e in events]
        for kind in ("submitted", "schedule_patched", "started", "checkpoint", "completed"):
            assert kind in kinds, (kind, kinds)
        states = [e["data"]["to"] for e in events if e["kind"] == "state"]
        assert states == ["starting", "running", "succeeded"]
        ckpts = api.get(f"/v1/jobs/{job_id}/checkpoints").json()
        keep = TINY_JOB["keep_last_checkpoints"]
        assert [ck["step"] for ck in ckpts] == list(range(total + 1 - keep, total + 1))  # what was kept
        assert [ck["checkpoint"] for ck in ckpts] == [f"{job_id}:{ck['step']}" for ck in ckpts]  # ids, no paths
        on_disk = sorted((Path(Store(redis_url).get_job(job_id).work_dir) / "checkpoints").glob("step_*"))
        assert [int(p.name.split("_")[1]) for p in on_disk] == [ck["step"] for ck in ckpts]
        per_step = TINY_JOB["rollout"]["prompts_per_step"] * TINY_JOB["rollout"]["num_generations"]
        assert len(trajs) == total * per_step
        one = api.get(f"/v1/jobs/{job_id}/trajectories", params={"step": 1}).json()["items"]
        assert len(one) == per_step and all(t["train_step"] == 1 for t in one)
        for t in one:  # the loss mask: 1 on what the model wrote, 0 on what the environment inserted
            assert len(t["loss_mask"]) == len(t["completion_ids"])
            assert sum(t["loss_mask"]) == sum(len(s["action_ids"]) for s in t["steps"])
            assert t["completion_ids"][: len(t["steps"][0]["action_ids"])] == t["steps"][0]["action_ids"]
        paged = api.get(f"/v1/jobs/{job_id}/trajectories", params={"limit": 3, "offset": 6}).json()["items"]
        assert [t["id"] for t in paged] == [t["id"] for t in trajs[6:9]]
        assert all(t["job_id"] == job_id for t in trajs)
        admin = {"Authorization": f"Bearer {Store(redis_url).create_api_key('ops', admin=True)}"}
        assert api.get("/metrics", headers=admin).text.count('taper_jobs{state="succeeded"} 1.0') == 1
    # the finished job's placement group is gone, so later tests get the whole local Ray
    assert not Store(redis_url).r.smembers(Store(redis_url).k_placed())
    # the server used this process's Ray: no embedded head was started (it would outlive the test)
    assert not (tmp_path / EMBEDDED_RECORD).exists()
