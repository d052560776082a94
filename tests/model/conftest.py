import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread(request: pytest.FixtureRequest):
    """The tiny model's ops are far too small for intra-op threads; on a shared, oversubscribed CPU the
    thread barriers cost ~10x. Restored after each test; the vLLM engine tests manage their own threads."""
    if request.module.__name__.rsplit(".", 1)[-1].startswith("test_vllm"):
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
