"""A pytest plugin (`-p sanitized_build`) that builds every C kernel with AddressSanitizer and UBSan, for the run
`test_c_sources.py` starts in a subprocess (the interpreter preloads the ASan runtime there)."""

from kernels import native

SANITIZE = ("-O1", "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g")
native.FLAGS = (*native.FLAGS, *SANITIZE)
