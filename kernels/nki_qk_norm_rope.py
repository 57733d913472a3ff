"""NKI kernels (Trainium) for QK-norm fused with rotary positions, forward and backward, for the
two Neuron call paths (kernels/nki_common.py). Reference: kernels/reference.qk_norm_rope.

Layout: x (B, H, T, D) is viewed as (B*H, T, D) in HBM; cos and sin as (Bc, T, D/2) with Bc = 1
(positions 0..T-1, shared by every sequence) or B (each sequence its own positions). Per (b, h)
the T positions go to the 128 partitions in tiles (the last one partial, a static slice) and D
stays on the free axis, so the two rotary halves are free-axis slices. Forward:
y = x * rstd (RMSNorm over D, fp32 statistics, eps = torch.finfo(x.dtype).eps), then
out = cat(y1 cos + y2 sin, y2 cos - y1 sin); it returns out and rstd (B*H, T) fp32. Backward
rotates the gradient back (dy1 = g1 cos - g2 sin, dy2 = g1 sin + g2 cos) and applies the RMSNorm
backward. cos and sin are constants of the positions (no gradient).

The per-head query gain is not in the kernel: the host multiplies the kernel's output by it in
torch, so autograd gives the gain its gradient (a reduction over B, T and D that would need a
cross-partition sum in the kernel for one multiply saved).

Written against the NKI 0.3+ API (`import nki`, nki.language, nki.isa, destination first);
not run on Trainium or under the Neuron compiler here (no Neuron SDK installs on these machines):
tests/test_nki_kernels.py runs this source on tests/nki_double.py.
"""

import nki
import nki.isa as nisa
import nki.language as nl
import torch

from kernels.nki_common import NkiOp, rms_backward_tile, row_rstd

P = nl.tile_size.pmax  # 128 partitions


def _check(x, cos, sin, heads):
    BH, T, D = x.shape
    assert D % 2 == 0 and BH % heads == 0, (x.shape, heads)
    assert cos.shape == sin.shape and cos.shape[1:] == (T, D // 2), (cos.shape, sin.shape, x.shape)
    assert cos.shape[0] in (1, BH // heads), (cos.shape, BH // heads)


def _load_rotation(cos, sin, batch, t0, rows, dtype):
    """cos and sin rows t0..t0+rows of sequence `batch` -> two (P, D/2) SBUF tiles."""
    half = cos.shape[2]
    tiles = []
    for table in (cos, sin):
        t = nl.ndarray((P, half), dtype=dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[0:rows, :], src=table[batch, t0:t0 + rows, :])
        tiles.append(t)
    return tiles


def _rotate(a, b, cos_t, sin_t, rows, half, dst, sign):
    """dst[:rows] = a * cos + sign * b * sin on (P, D/2) slices (sign +1 or -1)."""
    a_cos = nl.ndarray((P, half), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=a_cos[0:rows, :], data1=a, data2=cos_t[0:rows, :], op=nl.multiply)
    b_sin = nl.ndarray((P, half), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=b_sin[0:rows, :], data1=b, data2=sin_t[0:rows, :], op=nl.multiply)
    nisa.tensor_tensor(dst=dst, data1=a_cos[0:rows, :], data2=b_sin[0:rows, :], op=nl.add if sign > 0 else nl.subtract)


@nki.jit
def qk_norm_rope_fwd(x, cos, sin, heads, eps):
    """x (B*H, T, D), cos, sin (Bc, T, D/2) in x's dtype, heads = H, eps float -> (out (B*H, T, D)
    in x's dtype, rstd (B*H, T) fp32), both HBM."""
    _check(x, cos, sin, heads)
    BH, T, D = x.shape
    half = D // 2
    out = nl.ndarray((BH, T, D), dtype=x.dtype, buffer=nl.shared_hbm)
    rstd_out = nl.ndarray((BH, T), dtype=nl.float32, buffer=nl.shared_hbm)
    for bh in nl.affine_range(BH):
        batch = bh // heads if cos.shape[0] > 1 else 0
        for t in nl.affine_range((T + P - 1) // P):
            rows = min(P, T - t * P)
            x_t = nl.ndarray((P, D), dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=x_t[0:rows, :], src=x[bh, t * P:t * P + rows, :])
            cos_t, sin_t = _load_rotation(cos, sin, batch, t * P, rows, x.dtype)
            rstd = row_rstd(x_t, rows, D, eps)
            y = nl.ndarray((P, D), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=y[0:rows, :], data=x_t[0:rows, :], op0=nl.multiply, operand0=rstd[0:rows, :])
            y1, y2 = y[0:rows, 0:half], y[0:rows, half:D]
            o = nl.ndarray((P, D), dtype=x.dtype, buffer=nl.sbuf)
            _rotate(y1, y2, cos_t, sin_t, rows, half, o[0:rows, 0:half], +1)
            _rotate(y2, y1, cos_t, sin_t, rows, half, o[0:rows, half:D], -1)
            nisa.dma_copy(dst=out[bh, t * P:t * P + rows, :], src=o[0:rows, :])
            nisa.dma_copy(dst=rstd_out[bh, t * P:t * P + rows], src=rstd[0:rows, :])
    return out, rstd_out


@nki.jit
def qk_norm_rope_bwd(grad, x, cos, sin, rstd, heads):
    """grad, x (B*H, T, D), cos, sin (Bc, T, D/2), rstd (B*H, T) fp32, heads = H -> dx (B*H, T, D)
    HBM in x's dtype."""
    _check(x, cos, sin, heads)
    assert grad.shape == x.shape and rstd.shape == x.shape[:2], (grad.shape, rstd.shape, x.shape)
    BH, T, D = x.shape
    half = D // 2
    dx = nl.ndarray((BH, T, D), dtype=x.dtype, buffer=nl.shared_hbm)
    for bh in nl.affine_range(BH):
        batch = bh // heads if cos.shape[0] > 1 else 0
        for t in nl.affine_range((T + P - 1) // P):
            rows = min(P, T - t * P)
            x_t = nl.ndarray((P, D), dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=x_t[0:rows, :], src=x[bh, t * P:t * P + rows, :])
            g_t = nl.ndarray((P, D), dtype=grad.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=g_t[0:rows, :], src=grad[bh, t * P:t * P + rows, :])
            rstd_t = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=rstd_t[0:rows, :], src=rstd[bh, t * P:t * P + rows])
            cos_t, sin_t = _load_rotation(cos, sin, batch, t * P, rows, x.dtype)
            g1, g2 = g_t[0:rows, 0:half], g_t[0:rows, half:D]
            dy = nl.ndarray((P, D), dtype=nl.float32, buffer=nl.sbuf)
            _rotate(g1, g2, cos_t, sin_t, rows, half, dy[0:rows, 0:half], -1)  # dy1 = g1 cos - g2 sin
            _rotate(g2, g1, cos_t, sin_t, rows, half, dy[0:rows, half:D], +1)  # dy2 = g2 cos + g1 sin
            x_hat = nl.ndarray((P, D), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=x_hat[0:rows, :], data=x_t[0:rows, :], op0=nl.multiply, operand0=rstd_t[0:rows, :])
            dx_t = nl.ndarray((P, D), dtype=x.dtype, buffer=nl.sbuf)
            rms_backward_tile(dy, x_hat, rstd_t, rows, D, dx_t)
            nisa.dma_copy(dst=dx[bh, t * P:t * P + rows, :], src=dx_t[0:rows, :])
    return dx


def _tables(table, x):
    """cos or sin (T, D/2) or (B, 1, T, D/2) -> (Bc, T, D/2) contiguous."""
    return table.reshape(-1, x.shape[2], x.shape[3] // 2).contiguous()


def _forward(x, cos, sin):
    B, H, T, D = x.shape
    out, rstd = qk_norm_rope_fwd(x.reshape(B * H, T, D).contiguous(), _tables(cos, x), _tables(sin, x), H,
                                 torch.finfo(x.dtype).eps)
    return out.view(B, H, T, D), rstd


def _backward(grad, x, cos, sin, rstd):
    B, H, T, D = x.shape
    dx = qk_norm_rope_bwd(grad.reshape(B * H, T, D).contiguous(), x.reshape(B * H, T, D).contiguous(),
                          _tables(cos, x), _tables(sin, x), rstd, H)
    return dx.view(B, H, T, D)


_op = NkiOp("nki_qk_norm_rope", _forward, _backward,
            forward_fake=lambda x, cos, sin: (torch.empty_like(x), x.new_empty(x.shape[0] * x.shape[1], x.shape[2],
                                                                             dtype=torch.float32)),
            backward_fake=lambda grad, x, cos, sin, rstd: torch.empty_like(x),
            forward_schema="(Tensor x, Tensor cos, Tensor sin) -> (Tensor, Tensor)",
            backward_schema="(Tensor grad, Tensor x, Tensor cos, Tensor sin, Tensor rstd) -> Tensor",
            grad_args=(0,))


def qk_norm_rope(x, cos, sin, gain=None):
    """The reference's signature: x (B, H, T, D), cos, sin (T, D/2) or (B, 1, T, D/2) in x's dtype,
    gain (H,) or None -> (B, H, T, D) in x's dtype."""
    out = _op(x, cos, sin)
    return out if gain is None else out * gain.to(out.dtype)[None, :, None, None]
