"""Triton RMSNorm (no weight) for CUDA, forward and backward, one program per row.

x: (..., C), float32 or bfloat16, viewed as (N, C) contiguous rows; C <= MAX_C (one block holds
a row). Forward: y = x * rstd, rstd = 1 / sqrt(mean(x^2) + eps), eps = torch.finfo(x.dtype).eps;
saves x and rstd (N,) fp32. Backward: dx = rstd * (dy - y * mean(dy * y)). Math in fp32, outputs
in x's dtype. Reference: kernels/reference.py rms_norm.
"""

import torch
import triton
import triton.language as tl

from kernels.triton_checks import check_device

MAX_C = 65536  # a row is one block of registers


@triton.jit
def _forward(x_ptr, y_ptr, rstd_ptr, C, eps, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    x = tl.load(x_ptr + row * C + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / C + eps)
    tl.store(rstd_ptr + row, rstd)
    tl.store(y_ptr + row * C + cols, (x * rstd).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward(x_ptr, dy_ptr, rstd_ptr, dx_ptr, C, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    x = tl.load(x_ptr + row * C + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * C + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + row)
    y = x * rstd
    dx = rstd * (dy - y * (tl.sum(dy * y, axis=0) / C))
    tl.store(dx_ptr + row * C + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


class RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        assert x.dtype in (torch.float32, torch.bfloat16) and 0 < x.size(-1) <= MAX_C, (x.dtype, x.shape)
        check_device(x)
        C = x.size(-1)
        rows = x.reshape(-1, C).contiguous()
        y = torch.empty_like(rows)
        rstd = torch.empty(rows.size(0), dtype=torch.float32, device=x.device)
        _forward[(rows.size(0),)](rows, y, rstd, C, torch.finfo(x.dtype).eps, BLOCK_C=triton.next_power_of_2(C))
        ctx.save_for_backward(rows, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        rows, rstd = ctx.saved_tensors
        C = rows.size(1)
        dx = torch.empty_like(rows)
        _backward[(rows.size(0),)](rows, dy.reshape(-1, C).contiguous(), rstd, dx, C,
                                   BLOCK_C=triton.next_power_of_2(C))
        return dx.view(dy.shape)


def rms_norm(x):
    return RMSNorm.apply(x)
