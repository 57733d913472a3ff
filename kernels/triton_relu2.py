"""Triton ReLU^2 for CUDA: relu(x)^2 forward, 2 relu(x) dy backward, each one pass over memory.

x: any shape, contiguous, float32 or bfloat16 (flattened to 1-D blocks of BLOCK elements).
Math in fp32, output in x's dtype. Reference: kernels/reference.py relu2.
"""

import torch
import triton
import triton.language as tl

from kernels.triton_checks import check_device

BLOCK = 1024  # elements per program


@triton.jit
def _forward(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.maximum(tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32), 0.0)
    tl.store(y_ptr + offsets, (x * x).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward(x_ptr, dy_ptr, dx_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.maximum(tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32), 0.0)
    dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(dx_ptr + offsets, (2.0 * x * dy).to(dx_ptr.dtype.element_ty), mask=mask)


class ReLU2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        assert x.dtype in (torch.float32, torch.bfloat16), x.dtype
        check_device(x)
        x = x.contiguous()
        y = torch.empty_like(x)
        _forward[(triton.cdiv(x.numel(), BLOCK),)](x, y, x.numel(), BLOCK=BLOCK)
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch.empty_like(x)
        _backward[(triton.cdiv(x.numel(), BLOCK),)](x, dy, dx, x.numel(), BLOCK=BLOCK)
        return dx


def relu2(x):
    return ReLU2.apply(x)
