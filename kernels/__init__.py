"""KDA ops: Triton kernels for CUDA and pure-torch paths for CPU (chunked, recurrent decode, naive reference)."""
