"""The dashboard's routes without a browser: pages and assets, plotly.js from the installed package, and the
two helper endpoints (schedule preview, token text) with auth and field-named errors."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from synthetic import start_job

from api.app import create_app
from api.ui.preview import sample_steps, schedule_preview
from api.ui.tokens import token_pieces, tokenizer_file
from reward_models.schedule import RewardSchedule, ScheduleHistory
from rl_service.control.service import TaperService
from rl_service.control.settings import TaperSettings
from rl_service.control.store import Store


@pytest.fixture
def client(redis_url: str, tmp_path: Path) -> Iterator[tuple[TestClient, TaperService, dict[str, str]]]:
    store = Store(redis_url)
    service = TaperService(store, tmp_path)
    with TestClient(create_app(service, TaperSettings(data_dir=tmp_path))) as c:
        yield c, service, {"Authorization": f"Bearer {store.create_api_key('ui')}"}


def test_sample_steps_keeps_both_ends_and_bounds_the_count() -> None:
    assert sample_steps(0) == [0]
    assert sample_steps(9) == list(range(10))
    many = sample_steps(1_000_000, max_points=100)
    assert many[0] == 0 and many[-1] == 1_000_000 and len(many) == 100 and many == sorted(set(many))
    with pytest.raises(ValueError, match="last_step"):
        sample_steps(-1)


def test_preview_is_what_the_patch_would_store() -> None:
    history = ScheduleHistory.start(RewardSchedule(kind="cosine", w_start=1.0, w_end=0.2, horizon=30))
    before = history.model_dump()
    out = schedule_preview(history, at_step=7, last_step=40, patch={"kind": "exponential", "half_life": 4.0})
    assert history.model_dump() == before  # nothing applied to the caller's history
    stored = ScheduleHistory.model_validate(before)
    new = stored.apply_patch({"kind": "exponential", "half_life": 4.0}, at_step=7)
    assert out["proposed"]["version"] == new.version == 2 and out["proposed"]["effective_from"] == 8
    assert out["proposed"]["weight"] == [stored.weight(s) for s in range(41)]
    assert out["current"]["weight"] == [history.weight(s) for s in range(41)]
    assert out["proposed"]["weight"][:8] == out["current"]["weight"][:8]
    assert out["proposed"]["weight"][8:] != out["current"]["weight"][8:]
    with pytest.raises(ValidationError, match="half_life"):
        schedule_preview(history, at_step=7, last_step=40, patch={"kind": "exponential"})


def test_a_checkpoint_with_its_own_tokenizer_is_used(tmp_path: Path) -> None:
    assert tokenizer_file(str(tmp_path)) == tokenizer_file(None)  # no tokenizer.json there: the shipped one
    (tmp_path / "tokenizer.json").write_bytes(tokenizer_file(None).read_bytes())
    assert tokenizer_file(str(tmp_path)) == tmp_path / "tokenizer.json"
    assert tokenizer_file(tmp_path.as_uri()) == tmp_path / "tokenizer.json"


def test_token_pieces_decode_with_the_shipped_tokenizer() -> None:
    from tokenizers import Tokenizer

    shipped = tokenizer_file(None)
    assert shipped.parent.name == "tokenizer" and shipped.parent.parent.name == "model"
    tok = Tokenizer.from_file(str(shipped))
    ids = tok.encode("<tool_call>17*23</tool_call>").ids
    pieces = token_pieces(ids)
    assert "".join(pieces[i] for i in ids) == "<tool_call>17*23</tool_call>"
    with pytest.raises(ValueError, match="ids"):
        token_pieces([tok.get_vocab_size(with_added_tokens=True)])


def test_pages_assets_and_plotly_are_served(client) -> None:
    c, _, _ = client
    for path in ("/ui/jobs", "/ui/jobs/job-x", "/ui/submit", "/ui/environments", "/ui/login"):
        r = c.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in r.headers["content-security-policy"]
        assert "cdn" not in r.text.lower() and "http://" not in r.text and "https://" not in r.text
    assert c.get("/ui", follow_redirects=False).headers["location"] == "/ui/jobs"
    js = c.get("/ui/vendor/plotly.min.js")
    import plotly

    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    shipped = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    assert js.content == shipped.read_bytes()
    assert c.get("/ui/static/job.js").status_code == 200
    assert c.get("/ui/static/missing.js").status_code == 404
    assert c.get("/ui/static/..%2Fapp.py").status_code in (404, 422)
    assert all(not p.startswith("/ui") for p in c.get("/openapi.json").json()["paths"])


def test_preview_and_tokens_endpoints_need_a_key_and_name_the_bad_field(client) -> None:
    c, service, h = client
    job = start_job(service, "ui", total_steps=12)
    url = f"/ui/api/jobs/{job.id}/schedule-preview"
    assert c.post(url, json={}).status_code == 401
    cur = c.post(url, json={}, headers=h).json()
    assert cur["proposed"] is None and cur["steps"] == list(range(13)) and cur["job_step"] == 0
    assert cur["current"]["weight"][0] == 1.0 and cur["current"]["weight"][10] == 0.0
    bad = c.post(url, json={"w_start": -1}, headers=h)
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "w_start"
    bad = c.post(url, json={"kind": "step"}, headers=h)  # valid, but not for this linear schedule (as PATCH)
    assert bad.status_code == 409 and bad.json()["error"]["field"] == "milestones"
    bad = c.post(url, json={"kind": "linear", "milestones": [3]}, headers=h)  # invalid on its own
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "milestones"
    ok = c.post(url, json={"kind": "step", "milestones": [3, 6]}, headers=h).json()
    # the job is at step 0: the new version applies from step 1 and drops at each milestone
    assert ok["proposed"]["effective_from"] == 1
    assert ok["proposed"]["weight"][:7] == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.0]
    assert ok["proposed"]["weight"][12] == 0.0 and service.store.schedule_history(job.id).current.version == 1
    other = {"Authorization": f"Bearer {service.store.create_api_key('someone-else')}"}
    assert c.post(url, json={}, headers=other).status_code == 404  # another tenant's job does not exist

    service.store.transition(job.id, "succeeded", reason="done")
    final = c.post(url, json={"w_end": 0.5}, headers=h)
    assert final.status_code == 409 and final.json()["error"]["field"] == "state"
    assert c.post(url, json={}, headers=h).status_code == 200  # the curve itself stays viewable

    turl = f"/ui/api/jobs/{job.id}/tokens"
    assert c.post(turl, json={"ids": [1]}).status_code == 401
    assert c.post(turl, json={"ids": [1, 1, 2]}, headers=h).json() == {"pieces": {"1": "<|im_start|>", "2": "<|im_end|>"}}
    bad = c.post(turl, json={"ids": [10**9]}, headers=h)
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "ids"


REPO = Path(__file__).resolve().parents[2]
SKIP_DIRS = {".venv", ".git", "node_modules", "test-artifacts", "taper_data", ".pytest_cache", ".ruff_cache",
             ".tmp", ".whl"}  # the last two: scratch folders .gitignore keeps out of the repository
UI_DIR = REPO / "api" / "ui"


def _repo_files(suffix: str) -> list[Path]:
    out = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        out += [Path(root) / f for f in files if f.endswith(suffix)]
    return out


def test_front_end_code_is_our_own_and_loads_nothing_from_elsewhere() -> None:
    # no JavaScript library copied into the repository: the only .js files are the dashboard's own scripts
    js = _repo_files(".js")
    assert js and all(p.parent == UI_DIR / "static" for p in js), [str(p) for p in js]
    for path in js:
        text = path.read_text(encoding="utf-8")
        assert len(text) < 30_000 and not path.name.endswith(".min.js"), f"{path.name} looks like a bundled library"
        assert text.startswith(("//", '"use strict"')), f"{path.name}: not one of the dashboard's scripts"
    # no CDN or other origin anywhere in the pages, scripts or styles (the CSP would block it anyway)
    for path in [*js, *UI_DIR.rglob("*.html"), *UI_DIR.rglob("*.css")]:
        text = path.read_text(encoding="utf-8")
        assert "http://" not in text and "https://" not in text and "//cdn" not in text, path.name


def test_the_api_never_takes_a_key_from_the_url(client) -> None:
    c, service, h = client
    job = start_job(service, "ui", total_steps=2)
    key = h["Authorization"].removeprefix("Bearer ")
    assert c.get("/v1/jobs", headers=h).status_code == 200
    for name in ("api_key", "key", "token", "access_token", "authorization"):
        for path in ("/v1/jobs", f"/v1/jobs/{job.id}/events?limit=1", f"/v1/jobs/{job.id}/metrics"):
            sep = "&" if "?" in path else "?"
            r = c.get(f"{path}{sep}{name}={key}")
            assert r.status_code == 401, (path, name, r.status_code)
            assert r.json()["error"]["field"] == "Authorization"
