from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

sys.path.insert(0, str(Path(__file__).parent))

from api_helpers import Api  # noqa: E402

from api.app import create_app  # noqa: E402
from rl_service.control.service import TaperService  # noqa: E402
from rl_service.control.settings import TaperSettings  # noqa: E402
from rl_service.control.store import Store  # noqa: E402


@pytest.fixture
def api(redis_url: str, tmp_path: Path) -> Iterator[Api]:
    store = Store(redis_url)
    service = TaperService(store, tmp_path, submit_rate_per_minute=5)
    app = create_app(service, TaperSettings(max_request_bytes=64_000, data_dir=tmp_path))
    with TestClient(app) as client:
        yield Api(client, store, service, store.create_api_key("alpha"), store.create_api_key("beta"))
