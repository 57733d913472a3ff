"""Entry checks shared by the kernels/triton_*.py wrappers."""

import os


def check_device(*tensors):
    """Triton runs on CUDA tensors; under TRITON_INTERPRET=1 (the CPU tests) on host tensors."""
    assert all(t.is_cuda for t in tensors) or os.environ.get("TRITON_INTERPRET") == "1", \
        "Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 on the CPU)"
