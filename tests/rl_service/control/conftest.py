from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import standin_runner  # noqa: E402


@pytest.fixture(scope="session")
def standin_runner_cls(ray_local):
    # Ray workers cannot import test modules: ship the stand-in by value.
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(standin_runner)
    return standin_runner.StandInRunner
