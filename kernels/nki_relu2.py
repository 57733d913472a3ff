"""NKI kernels (Trainium) for the ReLU^2 MLP activation: relu(x)^2 and its backward in one pass
each, for the two Neuron call paths (kernels/nki_common.py). Reference: kernels/reference.relu2.

Layout: the host flattens x to (R, F) = (rows, last dim) in HBM, any float dtype. Rows go to the
128 partitions, F is cut into tiles of F_TILE; the last row tile and the last column tile are
partial (static slices of a full-size tile). Forward: out = relu(x) * relu(x). Backward:
dx = grad * 2 relu(x), recomputed from x (nothing but x is saved).

Written against the NKI 0.3+ API (`import nki`, nki.language, nki.isa, destination first);
not run on Trainium or under the Neuron compiler here (no Neuron SDK installs on these machines):
tests/test_nki_kernels.py runs this source on tests/nki_double.py.
"""

import nki
import nki.isa as nisa
import nki.language as nl
import torch

from kernels.nki_common import NkiOp

P = nl.tile_size.pmax  # 128 partitions
F_TILE = 2048  # elements per partition per tile: 8 KiB fp32 of the 192 KiB a partition holds


def _tiles(size, tile):
    return (size + tile - 1) // tile


@nki.jit
def relu2_fwd(x):
    """x (R, F) HBM -> relu(x)^2 (R, F) HBM in x's dtype."""
    assert len(x.shape) == 2, x.shape
    R, F = x.shape
    out = nl.ndarray((R, F), dtype=x.dtype, buffer=nl.shared_hbm)
    for r in nl.affine_range(_tiles(R, P)):
        rows = min(P, R - r * P)
        for f in nl.affine_range(_tiles(F, F_TILE)):
            cols = min(F_TILE, F - f * F_TILE)
            x_t = nl.ndarray((P, F_TILE), dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=x_t[0:rows, 0:cols], src=x[r * P:r * P + rows, f * F_TILE:f * F_TILE + cols])
            relu = nl.ndarray((P, F_TILE), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=relu[0:rows, 0:cols], op=nl.relu, data=x_t[0:rows, 0:cols])
            y = nl.ndarray((P, F_TILE), dtype=x.dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=y[0:rows, 0:cols], data1=relu[0:rows, 0:cols], data2=relu[0:rows, 0:cols],
                               op=nl.multiply)
            nisa.dma_copy(dst=out[r * P:r * P + rows, f * F_TILE:f * F_TILE + cols], src=y[0:rows, 0:cols])
    return out


@nki.jit
def relu2_bwd(grad, x):
    """grad, x (R, F) HBM -> dx = grad * 2 relu(x) (R, F) HBM in x's dtype."""
    assert grad.shape == x.shape and len(x.shape) == 2, (grad.shape, x.shape)
    R, F = x.shape
    dx = nl.ndarray((R, F), dtype=x.dtype, buffer=nl.shared_hbm)
    for r in nl.affine_range(_tiles(R, P)):
        rows = min(P, R - r * P)
        for f in nl.affine_range(_tiles(F, F_TILE)):
            cols = min(F_TILE, F - f * F_TILE)
            x_t = nl.ndarray((P, F_TILE), dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=x_t[0:rows, 0:cols], src=x[r * P:r * P + rows, f * F_TILE:f * F_TILE + cols])
            g_t = nl.ndarray((P, F_TILE), dtype=grad.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=g_t[0:rows, 0:cols], src=grad[r * P:r * P + rows, f * F_TILE:f * F_TILE + cols])
            # relu(2x) = 2 relu(x): the scale folds the factor 2 into the activation instruction.
            twice_relu = nl.ndarray((P, F_TILE), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=twice_relu[0:rows, 0:cols], op=nl.relu, data=x_t[0:rows, 0:cols], scale=2.0)
            dx_t = nl.ndarray((P, F_TILE), dtype=x.dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=dx_t[0:rows, 0:cols], data1=g_t[0:rows, 0:cols], data2=twice_relu[0:rows, 0:cols],
                               op=nl.multiply)
            nisa.dma_copy(dst=dx[r * P:r * P + rows, f * F_TILE:f * F_TILE + cols], src=dx_t[0:rows, 0:cols])
    return dx


def _rows(x):
    return x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1)


def _forward(x):
    return relu2_fwd(_rows(x).contiguous()).view(x.shape)


def _backward(grad, x):
    return relu2_bwd(_rows(grad).contiguous(), _rows(x).contiguous()).view(x.shape)


relu2 = NkiOp("nki_relu2", _forward, _backward,
              forward_fake=lambda x: torch.empty_like(x), backward_fake=lambda grad, x: torch.empty_like(x),
              forward_schema="(Tensor x) -> Tensor", backward_schema="(Tensor grad, Tensor x) -> Tensor",
              grad_args=(0,))
