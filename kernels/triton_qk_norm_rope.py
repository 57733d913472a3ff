"""Triton QK-norm + rotary positions for CUDA, forward and backward, one program per (b, h, t).

x: (B, H, T, D) float32 or bfloat16, any strides with stride(-1) == 1 (q and k come out of
view/transpose/permute of the projections; they are read in place). cos, sin: (T, D/2) or
(B, 1, T, D/2) in x's dtype, read through their broadcast strides. gain: (H,) or None, used in
x's dtype. Forward: y = x * rstd (RMSNorm over D, eps = torch.finfo(x.dtype).eps), then
out = cat(y1 cos + y2 sin, y2 cos - y1 sin) * gain[h]; out is contiguous (B, H, T, D); saves x,
cos, sin, gain and rstd (B*H*T,) fp32. Backward: dx (and dgain as per-row partial sums reduced
in torch); cos and sin get no gradient. Math in fp32, outputs in x's dtype.
Reference: kernels/reference.py qk_norm_rope.
"""

import torch
import triton
import triton.language as tl

from kernels.triton_checks import check_device


@triton.jit
def _forward(x_ptr, cos_ptr, sin_ptr, gain_ptr, out_ptr, rstd_ptr, H, T, D, eps,
             sxb, sxh, sxt, scb, sch, sct, HAS_GAIN: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # = (b * H + h) * T + t
    t, h, b = row % T, (row // T) % H, row // (T * H)
    half = D // 2
    cols = tl.arange(0, BLOCK)
    mask = cols < half
    x_row = x_ptr + b * sxb + h * sxh + t * sxt
    x1 = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + half + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
    tl.store(rstd_ptr + row, rstd)
    y1, y2 = x1 * rstd, x2 * rstd
    angle = b * scb + h * sch + t * sct + cols
    c = tl.load(cos_ptr + angle, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + angle, mask=mask, other=0.0).to(tl.float32)
    o1, o2 = y1 * c + y2 * s, y2 * c - y1 * s
    if HAS_GAIN:
        g = tl.load(gain_ptr + h).to(tl.float32)
        o1, o2 = o1 * g, o2 * g
    out_row = out_ptr + row * D
    tl.store(out_row + cols, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_row + half + cols, o2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward(x_ptr, cos_ptr, sin_ptr, gain_ptr, rstd_ptr, dout_ptr, dx_ptr, dgain_ptr, H, T, D,
              sxb, sxh, sxt, scb, sch, sct, HAS_GAIN: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t, h, b = row % T, (row // T) % H, row // (T * H)
    half = D // 2
    cols = tl.arange(0, BLOCK)
    mask = cols < half
    x_row = x_ptr + b * sxb + h * sxh + t * sxt
    rstd = tl.load(rstd_ptr + row)
    y1 = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32) * rstd
    y2 = tl.load(x_row + half + cols, mask=mask, other=0.0).to(tl.float32) * rstd
    angle = b * scb + h * sch + t * sct + cols
    c = tl.load(cos_ptr + angle, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + angle, mask=mask, other=0.0).to(tl.float32)
    d1 = tl.load(dout_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    d2 = tl.load(dout_ptr + row * D + half + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_GAIN:
        # d gain[h] = sum of dout * (the rotated, not yet scaled, output); this row's share.
        tl.store(dgain_ptr + row, tl.sum(d1 * (y1 * c + y2 * s) + d2 * (y2 * c - y1 * s), axis=0))
        g = tl.load(gain_ptr + h).to(tl.float32)
        d1, d2 = d1 * g, d2 * g
    dy1, dy2 = d1 * c - d2 * s, d1 * s + d2 * c  # the rotation's transpose
    dot = (tl.sum(dy1 * y1, axis=0) + tl.sum(dy2 * y2, axis=0)) / D
    dx_row = dx_ptr + row * D
    tl.store(dx_row + cols, (rstd * (dy1 - y1 * dot)).to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dx_row + half + cols, (rstd * (dy2 - y2 * dot)).to(dx_ptr.dtype.element_ty), mask=mask)


def broadcast_strides(cos, sin, shape):
    """Strides (b, h, t) of cos and sin read as (B, H, T, D/2); both must share them."""
    cos, sin = cos.expand(shape), sin.expand(shape)
    assert cos.stride() == sin.stride() and cos.stride(-1) == 1, (cos.stride(), sin.stride())
    return cos.stride()[:3]


class QKNormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, gain):
        B, H, T, D = x.shape
        assert x.dtype in (torch.float32, torch.bfloat16) and D % 2 == 0 and x.stride(-1) == 1, (x.dtype, x.shape)
        assert cos.dtype == sin.dtype == x.dtype and cos.shape[-2:] == (T, D // 2), (cos.dtype, cos.shape, x.dtype)
        assert gain is None or (gain.shape == (H,) and gain.dtype == x.dtype), gain
        check_device(x, cos, sin)
        out = torch.empty(B, H, T, D, dtype=x.dtype, device=x.device)
        rstd = torch.empty(B * H * T, dtype=torch.float32, device=x.device)
        angle_strides = broadcast_strides(cos, sin, (B, H, T, D // 2))
        _forward[(B * H * T,)](x, cos, sin, gain if gain is not None else rstd, out, rstd, H, T, D,
                               torch.finfo(x.dtype).eps, *x.stride()[:3], *angle_strides,
                               HAS_GAIN=gain is not None, BLOCK=triton.next_power_of_2(D // 2))
        ctx.save_for_backward(x, cos, sin, gain, rstd)
        ctx.angle_strides = angle_strides
        return out

    @staticmethod
    def backward(ctx, dout):
        x, cos, sin, gain, rstd = ctx.saved_tensors
        B, H, T, D = x.shape
        dout = dout.contiguous()
        dx = torch.empty(B, H, T, D, dtype=x.dtype, device=x.device)
        dgain_rows = torch.empty(B * H * T if gain is not None else 0, dtype=torch.float32, device=x.device)
        _backward[(B * H * T,)](x, cos, sin, gain if gain is not None else rstd, rstd, dout, dx, dgain_rows,
                                H, T, D, *x.stride()[:3], *ctx.angle_strides,
                                HAS_GAIN=gain is not None, BLOCK=triton.next_power_of_2(D // 2))
        dgain = None if gain is None else dgain_rows.view(B, H, T).sum((0, 2)).to(gain.dtype)
        return dx, None, None, dgain


def qk_norm_rope(x, cos, sin, gain=None):
    return QKNormRope.apply(x, cos, sin, None if gain is None else gain.to(x.dtype))
