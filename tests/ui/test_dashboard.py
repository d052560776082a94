"""The dashboard in real headless Chromium against the real API and Redis: login, job list, live curves fed by
the metrics and SSE endpoints, the schedule editor's preview and PATCH, the trajectory viewer, the submit form
with the API's validation messages, and the environment list. Job progress is written through the store, as a
job driver would; tests/ui/test_real_job.py runs the same page against a real training job."""

from __future__ import annotations

import json

import httpx
import pytest
from synthetic import chart_data, report_steps, start_job, trajectory, write_trajectories
from ui_helpers import ThreadedServer, UiServer, log_in, screenshot, wait_js

from api.app import create_app
from api.ui.tokens import token_pieces
from rl_service.control.service import Principal, TaperService
from rl_service.control.settings import TaperSettings
from rl_service.control.store import Store
from rollout_workers.trajectory import TrajectoryStatus


def test_login_rejects_a_bad_key_then_lists_jobs(ui_server: UiServer, page) -> None:
    job = start_job(ui_server.service, "ui", name="listed-job", total_steps=10)
    report_steps(ui_server.service, job.id, range(1, 4))
    page.goto(f"{ui_server.url}/ui/jobs")
    page.wait_for_url("**/ui/login**")  # no key yet: the page sends us to the login form
    page.fill("#api-key", "tpr_not-a-key")
    page.click("#login-form button[type=submit]")
    page.wait_for_selector("#error:not([hidden])")
    assert "invalid API key" in page.inner_text("#error")
    assert page.evaluate("sessionStorage.getItem('taper.apiKey')") is None

    log_in(page, ui_server.url, ui_server.key)
    row = page.wait_for_selector(f"tr[data-job='{job.id}']")
    assert "listed-job" in row.inner_text()
    assert row.query_selector("[data-state]").get_attribute("data-state") == "running"
    assert "3/10" in row.inner_text()
    # the key lives in sessionStorage only, never in a URL
    assert ui_server.key not in page.url
    assert page.evaluate("sessionStorage.getItem('taper.apiKey')") == ui_server.key
    screenshot(page, "jobs")

    registered = httpx.post(f"{ui_server.url}/v1/environments", headers={"Authorization": f"Bearer {ui_server.key}"},
                            json={"kind": "python", "name": "my-calc",
                                  "import_path": "rollout_workers.environments.calculator:CalculatorEnv",
                                  "grader": {"type": "string_check", "input": "{{sample.answer}}",
                                             "reference": "{{item.answer}}"},
                                  "process_rewards": [{"kind": "tool_called", "name": "used", "tool": "calculator"}]})
    assert registered.status_code == 201, registered.text
    page.click("a[data-nav=environments]")
    page.wait_for_selector("tr[data-env=calculator]")
    listed = ui_server.service.environments.list_all(Principal("ui"))  # the built-ins and my-calc
    assert page.locator("tr[data-env]").count() == len(listed) >= 3
    row = page.locator("tr[data-env=my-calc]")
    assert "python" in row.inner_text() and "calculator:CalculatorEnv" in row.inner_text()
    assert "grader: string_check" in row.inner_text() and "1 process components" in row.inner_text()
    assert "built-in" in page.inner_text("tr[data-env=calculator]")
    screenshot(page, "environments")

    page.click("#logout")
    page.wait_for_url("**/ui/login")
    assert page.evaluate("sessionStorage.getItem('taper.apiKey')") is None
    assert any("/v1/jobs" in u for u in page.request_urls)
    assert not [u for u in page.request_urls if ui_server.key in u or "tpr_not-a-key" in u]


def test_job_page_live_curves_schedule_edit_and_trajectory(ui_server: UiServer, page) -> None:
    svc, store = ui_server.service, ui_server.store
    job = start_job(svc, "ui", total_steps=20)
    report_steps(svc, job.id, range(1, 4))
    write_trajectories(job, [trajectory(job.id, 2, 1.0, task_id="t-1"),
                             trajectory(job.id, 2, 0.0, task_id="t-2"),
                             trajectory(job.id, 2, None, TrajectoryStatus.TRUNCATED, task_id="t-3")])
    log_in(page, ui_server.url, ui_server.key, f"/ui/jobs/{job.id}")

    # ---- curves: every metric key lands in a chart picked by its prefix
    wait_js(page, "document.getElementById('chart-rewards-raw')?.dataset.points === '3'")
    raw = {t["meta"]: t for t in chart_data(page, "chart-rewards-raw")}
    assert set(raw) == {"reward/outcome_mean", "reward/process/tool_use/raw"}
    assert raw["reward/outcome_mean"]["x"] == [0, 1, 2]
    assert raw["reward/outcome_mean"]["y"] == pytest.approx([0.1, 0.2, 0.3])
    weighted = {t["meta"] for t in chart_data(page, "chart-rewards-weighted")}
    assert weighted == {"reward/process/tool_use/weighted"}
    assert {t["meta"] for t in chart_data(page, "chart-success")} == {"success_rate", "reward/success_rate"}
    assert {t["meta"] for t in chart_data(page, "chart-optim")} == {"loss", "loss/policy", "kl", "entropy"}
    assert {t["meta"] for t in chart_data(page, "chart-time")} == {"time/rollout", "time/learn", "time/step"}
    assert {t["meta"] for t in chart_data(page, "chart-throughput")} == {"tokens_per_s"}
    assert page.locator("#chart-other").count() == 0

    # ---- live: the SSE stream (fetch streaming, Bearer header) shows events; new metrics extend the curves
    page.wait_for_selector("#stream-status[data-status=live]")
    store.add_event(job.id, "checkpoint_hint", {"note": "from the test"})
    page.wait_for_selector("#events li[data-kind=checkpoint_hint]")
    report_steps(svc, job.id, range(4, 6))
    wait_js(page, "document.getElementById('chart-rewards-raw').dataset.points === '5'")
    assert chart_data(page, "chart-rewards-raw")[0]["x"] == [0, 1, 2, 3, 4]
    store.r.hset(store.k_job(job.id), "step", "5")

    # ---- schedule editor: the curve in force, a previewed edit, then the PATCH
    wait_js(page, "document.getElementById('schedule-chart').dataset.version === '1'")
    before = {t["meta"]: t for t in chart_data(page, "schedule-chart")}
    assert before["current"]["y"][0] == pytest.approx(1.0) and before["current"]["y"][10] == pytest.approx(0.0)
    assert "proposed" not in before

    page.fill("#schedule-form [name=w_start]", "-1")
    page.wait_for_selector("#schedule-error:not([hidden])")
    assert "w_start" in page.inner_text("#schedule-error")
    assert page.is_disabled("#schedule-apply")
    assert "invalid" in page.get_attribute("#schedule-form [name=w_start]", "class")

    page.fill("#schedule-form [name=w_start]", "1")
    page.select_option("#schedule-form [name=kind]", "constant")
    wait_js(page, "document.getElementById('schedule-chart').dataset.proposed === '1'")
    assert json.loads(page.inner_text("#schedule-patch").removeprefix("PATCH ")) == {"kind": "constant"}
    proposed = {t["meta"]: t for t in chart_data(page, "schedule-chart")}["proposed"]
    # unchanged up to the job's step, constant 1.0 from the next step on
    assert proposed["y"][:6] == pytest.approx(before["current"]["y"][:6])
    assert proposed["y"][6:] == pytest.approx([1.0] * (len(proposed["y"]) - 6))
    assert store.schedule_history(job.id).current.version == 1  # a preview stores nothing
    screenshot(page, "schedule-preview")

    with page.expect_response(lambda r: r.request.method == "PATCH" and "reward-schedule" in r.url) as resp:
        page.click("#schedule-apply")
    assert resp.value.status == 200
    wait_js(page, "document.getElementById('schedule-chart').dataset.version === '2'")
    history = store.schedule_history(job.id)
    assert history.current.version == 2 and history.current.patch == {"kind": "constant"}
    assert history.current.effective_from == 6
    after = {t["meta"]: t for t in chart_data(page, "schedule-chart")}
    assert "proposed" not in after
    assert after["current"]["y"] == pytest.approx(proposed["y"])
    assert "version 2" in page.inner_text("#schedule-status")
    page.wait_for_selector("#schedule-versions tr[data-version='2']")
    page.wait_for_selector("#events li[data-kind=schedule_patched]")

    # "Recommended" fills the measured default: linear 1 -> 0 over the job's 20 steps (a preview, not stored)
    page.click("#schedule-recommended")
    wait_js(page, "document.getElementById('schedule-patch').innerText.includes('linear')")
    assert json.loads(page.inner_text("#schedule-patch").removeprefix("PATCH ")) == {"kind": "linear", "horizon": 20}
    assert store.schedule_history(job.id).current.version == 2
    page.click("#schedule-reset")
    wait_js(page, "document.getElementById('schedule-patch').innerText === ''")

    # the runner reports the new version: the weight chart marks the change
    report_steps(svc, job.id, range(6, 9))
    wait_js(page, "document.getElementById('chart-schedule').dataset.points === '8'")
    shapes = page.evaluate("document.getElementById('chart-schedule').layout.shapes.map(s => s.x0)")
    assert shapes == [6]  # training step 6 (rows count from 0) is the first under version 2
    screenshot(page, "job-curves")

    # ---- trajectories: filter, open one, see the tool call, hover a token
    page.wait_for_selector("#traj-table tr[data-traj]")
    assert page.locator("#traj-table tr[data-traj]").count() == 3
    page.select_option("#traj-filter [name=status]", "truncated")
    page.click("#traj-filter button[type=submit]")
    wait_js(page, "document.querySelectorAll('#traj-table tr[data-traj]').length === 1")
    assert page.get_attribute("#traj-table tr[data-traj]", "data-status") == "truncated"
    page.select_option("#traj-filter [name=status]", "")
    page.fill("#traj-filter [name=min_reward]", "0.5")
    page.click("#traj-filter button[type=submit]")
    wait_js(page, "document.querySelectorAll('#traj-table tr[data-traj]').length === 1")
    page.click("#traj-table tr[data-traj]")
    call = page.wait_for_selector("#traj-viewer .tool-call[data-tool=calculator]")
    assert '"expression":"17*23"' in call.inner_text()
    assert call.query_selector(".tool-result").inner_text() == "391"
    assert page.locator("#traj-viewer .turn").count() == 2
    assert "tool_use 0.9" in page.inner_text("#traj-viewer .turn[data-turn='0'] .chips")
    # model output is shown as text, never run as HTML
    assert "<script>alert(1)</script>" in page.inner_text("#traj-viewer .turn[data-turn='1'] pre.action")
    assert page.locator("#traj-viewer script").count() == 0
    # the token strip shows each token's text (the job's tokenizer, decoded by the server)
    wait_js(page, "document.getElementById('traj-viewer').dataset.decoded")
    pieces = token_pieces([11, 12, 13, 14])
    texts = page.eval_on_selector_all("#traj-viewer .turn[data-turn='0'] .tok.act", "els => els.map(e => e.textContent)")
    assert texts == [pieces[i].replace("\n", "↵").replace("\t", "→") for i in (11, 12, 13, 14)]
    assert page.locator("#traj-viewer .turn[data-turn='0'] .tok.obs").count() == 3
    page.hover("#traj-viewer .turn[data-turn='0'] .tok.act >> nth=2")
    readout = page.inner_text("#token-readout")
    assert "mask 1" in readout and "id 13" in readout and "logprob -2.3" in readout
    assert json.dumps(pieces[13], ensure_ascii=False) in readout
    page.hover("#traj-viewer .turn[data-turn='0'] .tok.obs >> nth=0")
    assert "mask 0" in page.inner_text("#token-readout")
    screenshot(page, "trajectory")

    # ---- the job finishes: the stream delivers the state change and ends
    store.transition(job.id, "succeeded", reason="done")
    page.wait_for_selector("#job-state[data-state=succeeded]")
    page.wait_for_selector("#stream-status[data-status=ended]")
    assert any(u.endswith("/events") for u in page.request_urls)  # the stream, authorised by header only
    assert not [u for u in page.request_urls if ui_server.key in u]
    assert page.console_errors == []


def test_submit_form_shows_the_api_validation_message(ui_server: UiServer, page) -> None:
    log_in(page, ui_server.url, ui_server.key, "/ui/submit")
    page.wait_for_selector("#env-select option[value=calculator]", state="attached")
    page.fill("[data-field='rollout.num_generations']", "0")
    page.click("#submit-button")
    page.wait_for_selector("#error:not([hidden])")
    assert "rollout.num_generations" in page.inner_text("#error")
    assert "invalid" in page.get_attribute("[data-field='rollout.num_generations']", "class")
    screenshot(page, "submit-invalid")

    page.fill("[data-field='rollout.num_generations']", "2")
    page.fill("#total-steps", "40")  # the horizon follows, as the recommended schedule decays over the whole run
    assert page.input_value("#schedule-horizon") == "40"
    page.select_option("[data-field='reward_schedule.kind']", "exponential")  # half_life left empty
    page.click("#submit-button")
    wait_js(page, "document.getElementById('error').innerText.includes('half_life')")
    assert "invalid" in page.get_attribute("[data-field='reward_schedule.half_life']", "class")

    page.fill("[data-field='reward_schedule.half_life']", "5")
    page.fill("[data-field=name]", "from-the-form")
    page.fill("#extra-json", '{"tasks": {"num_train": 50}}')
    page.click("#submit-button")
    page.wait_for_url("**/ui/jobs/job-*")
    job_id = page.url.rsplit("/", 1)[1]
    job = ui_server.store.get_job(job_id)
    assert job.name == "from-the-form" and job.state == "queued"
    assert job.spec.reward_schedule.kind == "exponential" and job.spec.reward_schedule.half_life == 5
    assert job.spec.total_steps == 40 and job.spec.reward_schedule.horizon == 40
    assert job.spec.tasks.num_train == 50 and job.spec.rollout.num_generations == 2
    page.wait_for_selector("#job-state[data-state=queued]")
    assert page.is_disabled("[data-action=pause]") and page.is_enabled("[data-action=cancel]")
    page.once("dialog", lambda d: d.accept())
    page.click("[data-action=cancel]")
    page.wait_for_selector("#job-state[data-state=cancelled]")
    assert ui_server.store.get_job(job_id).state == "cancelled"
    assert page.console_errors == []


def test_event_stream_resumes_after_an_api_restart_without_losing_or_repeating_events(
        redis_url: str, tmp_path, page) -> None:
    store = Store(redis_url)
    service = TaperService(store, tmp_path)
    key = store.create_api_key("ui")
    job = start_job(service, "ui")
    events = "Array.from(document.querySelectorAll('#events li')).map(li => li.dataset.id)"
    first = ThreadedServer(create_app(service, TaperSettings(data_dir=tmp_path)))
    with first:
        log_in(page, first.url, key, f"/ui/jobs/{job.id}")
        page.wait_for_selector("#stream-status[data-status=live]")
        wait_js(page, f"{events}.length === 3")  # submitted, queued -> starting, starting -> running
    wait_js(page, "document.getElementById('stream-status').dataset.status === 'reconnecting'")
    missed = store.add_event(job.id, "while_down", {"n": 1})
    with ThreadedServer(create_app(service, TaperSettings(data_dir=tmp_path)), port=first.port):
        page.wait_for_selector("#events li[data-kind=while_down]", state="attached", timeout=30_000)
        page.wait_for_selector("#stream-status[data-status=live]")
        store.add_event(job.id, "after_restart", {"n": 2})
        page.wait_for_selector("#events li[data-kind=after_restart]", state="attached")
        ids = page.evaluate(events)
        assert len(ids) == len(set(ids)) == 5 and missed in ids  # Last-Event-ID: nothing replayed twice
        store.transition(job.id, "cancelled", reason="done")
        page.wait_for_selector("#stream-status[data-status=ended]")
    store.close()
