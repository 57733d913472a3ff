"""NKI kernels (Trainium) for RMSNorm without weight, forward and backward, for the two Neuron
call paths (kernels/nki_common.py). Reference: kernels/reference.rms_norm.

Layout: the host flattens x to (R, C) rows in HBM (any float dtype); rows go to the 128
partitions (the last row tile is a partial, static slice), a whole row of C stays in one
partition. Statistics in fp32: rstd = 1 / sqrt(mean(x^2) + eps), eps = torch.finfo(x.dtype).eps
as in F.rms_norm. Forward returns y = x * rstd and the per-row rstd (R,) fp32 for backward:
dx = rstd * (g - x_hat * mean(g * x_hat)), x_hat = x * rstd.

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
C_MAX = 8192  # fp32 elements of one row per partition tile (32 KiB of a partition's 192 KiB)


@nki.jit
def rms_norm_fwd(x, eps):
    """x (R, C) HBM, eps float -> (y (R, C) in x's dtype, rstd (R,) fp32), both HBM."""
    assert len(x.shape) == 2 and x.shape[1] <= C_MAX, x.shape
    R, C = x.shape
    y = nl.ndarray((R, C), dtype=x.dtype, buffer=nl.shared_hbm)
    rstd_out = nl.ndarray((R,), dtype=nl.float32, buffer=nl.shared_hbm)
    for r in nl.affine_range((R + P - 1) // P):
        rows = min(P, R - r * P)
        x_t = nl.ndarray((P, C), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=x_t[0:rows, :], src=x[r * P:r * P + rows, :])
        rstd = row_rstd(x_t, rows, C, eps)
        y_t = nl.ndarray((P, C), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=y_t[0:rows, :], data=x_t[0:rows, :], op0=nl.multiply, operand0=rstd[0:rows, :])
        nisa.dma_copy(dst=y[r * P:r * P + rows, :], src=y_t[0:rows, :])
        nisa.dma_copy(dst=rstd_out[r * P:r * P + rows], src=rstd[0:rows, :])
    return y, rstd_out


@nki.jit
def rms_norm_bwd(grad, x, rstd):
    """grad, x (R, C) HBM, rstd (R,) fp32 HBM -> dx (R, C) HBM in x's dtype."""
    assert grad.shape == x.shape and len(x.shape) == 2 and x.shape[1] <= C_MAX, (grad.shape, x.shape)
    R, C = x.shape
    dx = nl.ndarray((R, C), dtype=x.dtype, buffer=nl.shared_hbm)
    for r in nl.affine_range((R + P - 1) // P):
        rows = min(P, R - r * P)
        x_t = nl.ndarray((P, C), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=x_t[0:rows, :], src=x[r * P:r * P + rows, :])
        g_t = nl.ndarray((P, C), dtype=grad.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=g_t[0:rows, :], src=grad[r * P:r * P + rows, :])
        rstd_t = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=rstd_t[0:rows, :], src=rstd[r * P:r * P + rows])
        x_hat = nl.ndarray((P, C), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=x_hat[0:rows, :], data=x_t[0:rows, :], op0=nl.multiply, operand0=rstd_t[0:rows, :])
        dy = nl.ndarray((P, C), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=dy[0:rows, :], src=g_t[0:rows, :])
        dx_t = nl.ndarray((P, C), dtype=x.dtype, buffer=nl.sbuf)
        rms_backward_tile(dy, x_hat, rstd_t, rows, C, dx_t)
        nisa.dma_copy(dst=dx[r * P:r * P + rows, :], src=dx_t[0:rows, :])
    return dx


def _forward(x):
    y, rstd = rms_norm_fwd(x.reshape(-1, x.shape[-1]).contiguous(), torch.finfo(x.dtype).eps)
    return y.view(x.shape), rstd


def _backward(grad, x, rstd):
    C = x.shape[-1]
    return rms_norm_bwd(grad.reshape(-1, C).contiguous(), x.reshape(-1, C).contiguous(), rstd).view(x.shape)


rms_norm = NkiOp("nki_rms_norm", _forward, _backward,
                 forward_fake=lambda x: (torch.empty_like(x), x.new_empty(x.numel() // x.shape[-1],
                                                                         dtype=torch.float32)),
                 backward_fake=lambda grad, x, rstd: torch.empty_like(x),
                 forward_schema="(Tensor x) -> (Tensor, Tensor)",
                 backward_schema="(Tensor grad, Tensor x, Tensor rstd) -> Tensor", grad_args=(0,))
