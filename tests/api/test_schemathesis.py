"""Property-based testing of our own OpenAPI document: no request, however odd, gets a 5xx (in process, half
the cases on a real job), and the document tells the truth (`schemathesis run --checks all` against a live
server, every phase including the stateful one that follows the document's links).

Bounded (a fixed number of examples per operation, a fixed seed) so that both stay around a minute."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
import torch
from api_helpers import ThreadedServer
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings

from api.app import create_app
from rl_service.control.service import TaperService
from rl_service.control.settings import TaperSettings
from rl_service.control.store import Store
from rl_service.spec import JobSpec

EXAMPLES_PER_OPERATION = 20
CONFORMANCE_EXAMPLES_PER_OPERATION = 10
CONFORMANCE_CONFIG = Path(__file__).with_name("schemathesis.toml")


@pytest.fixture
def fuzz_target(redis_url: str, tmp_path: Path) -> Iterator[dict]:
    store = Store(redis_url)
    service = TaperService(store, tmp_path, submit_rate_per_minute=10_000)
    app = create_app(service, TaperSettings(max_request_bytes=64_000, data_dir=tmp_path))
    key = store.create_api_key("fuzz")
    job, _ = store.submit_job("fuzz", JobSpec(total_steps=2), str(tmp_path / "jobs"))
    with TestClient(app):
        yield {"app": app, "key": key, "job_id": job.id, "store": store}


def test_no_server_errors(fuzz_target: dict) -> None:
    # Models built earlier in this process set flush-to-zero for denormals (a CPU speed setting), and
    # hypothesis refuses to generate floats under it; fuzzing the API needs no model.
    torch.set_flush_denormal(False)
    schema = schemathesis.openapi.from_asgi("/openapi.json", fuzz_target["app"])
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15
    failures: list[tuple] = []
    answered: set[tuple[str, str]] = set()  # operations that got a 2xx at least once

    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case) -> None:
            # Half the cases address the real job, so the fuzzer reaches past the 404 of a random id.
            for name in ("job_id", "fine_tuning_job_id"):
                if case.path_parameters and len(str(case.path_parameters.get(name, ""))) % 2:
                    case.path_parameters[name] = fuzz_target["job_id"]
            headers = dict(case.headers or {})
            headers["Authorization"] = f"Bearer {fuzz_target['key']}"  # the generated one is random
            if case.path.endswith("/events"):
                headers["Accept"] = "application/json"  # an SSE stream of a live job would never end
            response = case.call(headers=headers)
            if response.status_code < 300:
                answered.add((case.method, case.path))
            if response.status_code >= 500:
                failures.append((case.method, case.formatted_path, case.query, case.body, response.text[:300]))

        run()
    assert not failures, failures[:5]
    assert len(answered) >= 10, answered  # the fuzzer got past auth and validation



def test_every_schemathesis_check_passes_against_a_live_server(redis_url: str, tmp_path: Path) -> None:
    """What a user's own CI would run against the document: all checks (status codes, headers, content types
    and schemas of the responses as documented; schema-valid requests accepted, schema-invalid ones rejected;
    405 with Allow for undeclared methods; auth enforced; created resources reachable through their links and
    gone after DELETE)."""
    store = Store(redis_url)
    service = TaperService(store, tmp_path, submit_rate_per_minute=10_000)
    # above the largest field the document allows (a python grader's 64 KiB source), so that a body one
    # character over a maxLength is judged by validation (4xx naming the field), not cut off at 413
    app = create_app(service, TaperSettings(max_request_bytes=200_000, data_dir=tmp_path))
    key = store.create_api_key("conformance")
    app.openapi()  # build the (cached) document now: on a loaded machine it took most of the 10 s load timeout
    with ThreadedServer(app) as server:
        run = subprocess.run(
            [sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFORMANCE_CONFIG), "run",
             f"{server.url}/openapi.json", "--checks", "all",
             "--header", f"Authorization: Bearer {key}", "--max-examples", str(CONFORMANCE_EXAMPLES_PER_OPERATION),
             "--seed", "20261201", "--workers", "1", "--generation-database", "none", "--no-color"],
            cwd=tmp_path, capture_output=True, text=True, timeout=400,
        )
    report = run.stdout[-12_000:] + run.stderr[-2000:]
    assert run.returncode == 0, report
    for phase in ("Examples", "Coverage", "Fuzzing", "Stateful"):
        assert f"✅ {phase}" in run.stdout, report
