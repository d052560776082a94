"""KDA ops and the model's other hot loops: Triton kernels for CUDA; on CPU a vectorised torch chunked path for
training and compiled passes (C beside its loader, built by `native.py`; numba) for serving and evaluation;
naive references for tests."""
