import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import cpu_threads as cpu_threads_module  # noqa: E402
from kernels.kda import recurrent_cpu  # noqa: E402


@pytest.fixture(params=[1, 3], ids=["1 thread", "3 threads"])
def cpu_threads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """The compiled CPU passes and the C recurrence on this many threads, however small the inputs, so that
    a test's few rows are split (block edges inside sequences, the recurrence's value columns in blocks)."""
    monkeypatch.setattr(cpu_threads_module, "MIN_ELEMENTS_PER_THREAD", 1)
    monkeypatch.setattr(recurrent_cpu, "STATE_ELEMENTS_PER_THREAD", 1)
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
