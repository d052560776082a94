import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """The tiny model's ops are far too small for intra-op threads; on a shared, oversubscribed CPU the
    thread barriers cost ~10x. Restored after each test so other packages' tests are unaffected."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
