"""GPU tests: `python -m pytest -m gpu tests/gpu` on a machine with a CUDA GPU and vLLM's CUDA build (the
`cuda` extra). Everywhere else they are skipped, with the reason."""

from __future__ import annotations

import pytest


def _no_gpu_reason() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "needs a CUDA GPU: run `python -m pytest -m gpu tests/gpu` on a GPU machine"
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return "needs vLLM (the `cuda` extra)"
    if not current_platform.is_cuda_alike():
        return "needs vLLM's CUDA build (this vLLM is a CPU build)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _no_gpu_reason()
    for item in items:
        if "tests/gpu/" in item.nodeid or item.nodeid.startswith("gpu/"):
            item.add_marker(pytest.mark.gpu)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session", autouse=True)
def _plugin_registered() -> None:
    """The plugin registered in this process (in-process engines), also where the project is not installed and
    vLLM finds no entry point."""
    if _no_gpu_reason() is None:
        import model.vllm_plugin as plugin

        plugin.register()
