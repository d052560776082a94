"""Our top-level `kernels` package must not make transformers believe the HF `kernels` hub package is
installed (it would then try to fetch and route to hub kernels)."""

import importlib

from transformers.integrations import hub_kernels
from transformers.utils import import_utils


def test_transformers_does_not_see_hf_kernels():
    import_utils.is_kernels_available.cache_clear()
    assert import_utils.is_kernels_available() is False
    # hub_kernels imports the HF package's API at import time only when it believes it is installed.
    assert not hasattr(hub_kernels, "get_kernel_hub")


def test_our_kernels_package_is_the_one_imported():
    kernels = importlib.import_module("kernels")
    assert hasattr(importlib.import_module("kernels.kda"), "chunk_kda")
    assert not hasattr(kernels, "get_kernel")  # the HF package's entry point
