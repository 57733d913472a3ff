"""NKI kernels (Trainium) for the output head fused with the logit soft-cap and cross-entropy,
forward and backward, for the two Neuron call paths (kernels/nki_common.py). Reference:
kernels/reference.head_nll. The [N, V] logits never exist in HBM: they live one
(128 rows x vocab chunk) PSUM tile at a time.

Shapes: N tokens, C = n_embd (<= 512: one PSUM bank holds a (128, C) fp32 gradient tile),
V vocab. HBM inputs: x_t (C, N) and w_t (C, V), the transposes of x (N, C) and the head weight
(V, C), because nc_matmul contracts over the partition axis (it computes stationary.T @ moving);
x and w themselves for the backward; targets (N,) as fp32 class ids (exact below 2^24).

Forward, per tile of 128 rows (the last partial): logits for vocab chunks of 512 (the PSUM free
limit) accumulate over C in chunks of 128 partitions (nc_matmul, fp32 in PSUM), the soft-cap
cap * tanh(logits / cap) is applied, and an online log-sum-exp (running max m and rescaled sum
d, as in nki-library's cross_entropy) plus the target's logit (an iota == target mask) give
lse (N,) and nll = lse - logit[target] (N,), both fp32.

Backward recomputes each (128 rows x 128 vocab) logits block and forms
dlogits = dnll * (softmax - onehot) * (1 - tanh^2 with the cap), in x's dtype; then
dx += dlogits @ w (accumulated over vocab tiles in PSUM, dlogits transposed by nc_transpose) and
dw += dlogits.T @ x (accumulated over row tiles in an fp32 SBUF tile of (V, C)). The weight is
loaded to SBUF once per kernel, both layouts: V * C must fit (asserted).

Written against the NKI 0.3+ API (`import nki`, nki.language, nki.isa, destination first;
nc_matmul's `accumulate` is NKI 0.3's matmul accumulation control): not run on Trainium or
under the Neuron compiler here (no Neuron SDK installs on these machines):
tests/test_nki_kernels.py runs this source on tests/nki_double.py.
"""

import nki
import nki.isa as nisa
import nki.language as nl
import torch

from kernels.nki_common import NkiOp

P = nl.tile_size.pmax  # 128 partitions: row tiles, contraction chunks, backward vocab tiles
V_CHUNK = nl.tile_size.psum_fmax  # 512 fp32 logits per partition in one PSUM bank
W_SBUF_MAX = 16384  # elements per partition for one resident copy of the weight (64 KiB fp32)


def _tiles(size, tile):
    return (size + tile - 1) // tile


def _load_weight_t(w_t):
    """w_t (C, V) HBM -> SBUF (P, C/128, V): chunk k of C on the partitions."""
    C, V = w_t.shape
    w_sb = nl.ndarray((P, _tiles(C, P), V), dtype=w_t.dtype, buffer=nl.sbuf)
    for k in nl.affine_range(_tiles(C, P)):
        kc = min(P, C - k * P)
        nisa.dma_copy(dst=w_sb[0:kc, k, :], src=w_t[k * P:k * P + kc, :])
    return w_sb


def _load_rows_t(x_t, r, rows):
    """Columns r*128 .. r*128+rows of x_t (C, N) -> SBUF (P, C/128, P): chunk k of C on partitions."""
    C = x_t.shape[0]
    x_sb = nl.ndarray((P, _tiles(C, P), P), dtype=x_t.dtype, buffer=nl.sbuf)
    for k in nl.affine_range(_tiles(C, P)):
        kc = min(P, C - k * P)
        nisa.dma_copy(dst=x_sb[0:kc, k, 0:rows], src=x_t[k * P:k * P + kc, r * P:r * P + rows])
    return x_sb


def _row_vector(hbm, r, rows):
    """Entries r*128 .. r*128+rows of an (N,) HBM vector -> SBUF (P, 1) fp32."""
    t = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t[0:rows, :], src=hbm[r * P:r * P + rows])
    return t


def _logits(x_sb, w_sb, C, rows, v0, cols, width, softcap):
    """Soft-capped logits of `rows` rows and vocab v0 .. v0+cols -> SBUF (P, width) fp32, and the
    tanh tile (None without the cap) that the backward's derivative needs."""
    acc = nl.ndarray((P, width), dtype=nl.float32, buffer=nl.psum)
    for k in nl.affine_range(_tiles(C, P)):
        kc = min(P, C - k * P)
        # The first matmul of the group overwrites PSUM, the rest add (accumulate, NKI 0.3+).
        nisa.nc_matmul(dst=acc[0:rows, 0:cols], stationary=x_sb[0:kc, k, 0:rows],
                       moving=w_sb[0:kc, k, v0:v0 + cols], accumulate=k > 0)
    logits = nl.ndarray((P, width), dtype=nl.float32, buffer=nl.sbuf)
    if softcap <= 0:
        nisa.tensor_copy(dst=logits[0:rows, 0:cols], src=acc[0:rows, 0:cols])
        return logits, None
    tanh = nl.ndarray((P, width), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=tanh[0:rows, 0:cols], op=nl.tanh, data=acc[0:rows, 0:cols], scale=1.0 / softcap)
    nisa.tensor_scalar(dst=logits[0:rows, 0:cols], data=tanh[0:rows, 0:cols], op0=nl.multiply, operand0=softcap)
    return logits, tanh


def _target_mask(targets_t, rows, v0, cols, width):
    """(P, width) fp32: 1.0 where column v0 + j is the row's target, else 0.0."""
    ids = nl.ndarray((P, width), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(dst=ids[0:rows, 0:cols], pattern=[[1, cols]], offset=v0)
    mask = nl.ndarray((P, width), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=mask[0:rows, 0:cols], data=ids[0:rows, 0:cols], op0=nl.equal,
                       operand0=targets_t[0:rows, :])
    return mask


@nki.jit
def head_nll_fwd(x_t, w_t, targets, softcap):
    """x_t (C, N), w_t (C, V) HBM in one dtype, targets (N,) fp32 class ids, softcap float
    (0 = off) -> (nll (N,), lse (N,)) fp32 HBM."""
    C, N = x_t.shape
    V = w_t.shape[1]
    assert w_t.shape[0] == C and targets.shape == (N,) and V < 2 ** 24, (x_t.shape, w_t.shape, targets.shape)
    assert _tiles(C, P) * V <= W_SBUF_MAX, f"weight (V={V}, C={C}) does not fit the SBUF budget"
    nll = nl.ndarray((N,), dtype=nl.float32, buffer=nl.shared_hbm)
    lse = nl.ndarray((N,), dtype=nl.float32, buffer=nl.shared_hbm)
    w_sb = _load_weight_t(w_t)
    for r in nl.affine_range(_tiles(N, P)):
        rows = min(P, N - r * P)
        x_sb = _load_rows_t(x_t, r, rows)
        targets_t = _row_vector(targets, r, rows)
        run_max = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=run_max[0:rows, :], value=-float("inf"))
        run_sum = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=run_sum[0:rows, :], value=0.0)
        target_logit = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=target_logit[0:rows, :], value=0.0)
        # A plain range: the online log-sum-exp carries run_max and run_sum from chunk to chunk
        # (the compiler turns range into sequential_range, nki.language.sequential_range docs).
        for v in range(_tiles(V, V_CHUNK)):
            v0, cols = v * V_CHUNK, min(V_CHUNK, V - v * V_CHUNK)
            logits, _ = _logits(x_sb, w_sb, C, rows, v0, cols, V_CHUNK, softcap)
            chunk_max = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=chunk_max[0:rows, :], op=nl.maximum, data=logits[0:rows, 0:cols], axis=1)
            new_max = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=new_max[0:rows, :], data1=run_max[0:rows, :], data2=chunk_max[0:rows, :],
                               op=nl.maximum)
            # run_sum *= exp(old max - new max): rescale the sum so far to the new max.
            rescale = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=rescale[0:rows, :], data1=run_max[0:rows, :], data2=new_max[0:rows, :],
                               op=nl.subtract)
            nisa.activation(dst=rescale[0:rows, :], op=nl.exp, data=rescale[0:rows, :])
            nisa.tensor_tensor(dst=run_sum[0:rows, :], data1=run_sum[0:rows, :], data2=rescale[0:rows, :],
                               op=nl.multiply)
            neg_max = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=neg_max[0:rows, :], data=new_max[0:rows, :], op0=nl.multiply, operand0=-1.0)
            exps = nl.ndarray((P, V_CHUNK), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=exps[0:rows, 0:cols], op=nl.exp, data=logits[0:rows, 0:cols], bias=neg_max[0:rows, :])
            chunk_sum = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=chunk_sum[0:rows, :], op=nl.add, data=exps[0:rows, 0:cols], axis=1)
            nisa.tensor_tensor(dst=run_sum[0:rows, :], data1=run_sum[0:rows, :], data2=chunk_sum[0:rows, :],
                               op=nl.add)
            nisa.tensor_copy(dst=run_max[0:rows, :], src=new_max[0:rows, :])
            mask = _target_mask(targets_t, rows, v0, cols, V_CHUNK)
            nisa.tensor_tensor(dst=mask[0:rows, 0:cols], data1=mask[0:rows, 0:cols], data2=logits[0:rows, 0:cols],
                               op=nl.multiply)
            picked = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=picked[0:rows, :], op=nl.add, data=mask[0:rows, 0:cols], axis=1)
            nisa.tensor_tensor(dst=target_logit[0:rows, :], data1=target_logit[0:rows, :], data2=picked[0:rows, :],
                               op=nl.add)
        lse_t = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=lse_t[0:rows, :], op=nl.log, data=run_sum[0:rows, :])
        nisa.tensor_tensor(dst=lse_t[0:rows, :], data1=lse_t[0:rows, :], data2=run_max[0:rows, :], op=nl.add)
        nll_t = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=nll_t[0:rows, :], data1=lse_t[0:rows, :], data2=target_logit[0:rows, :],
                           op=nl.subtract)
        nisa.dma_copy(dst=lse[r * P:r * P + rows], src=lse_t[0:rows, :])
        nisa.dma_copy(dst=nll[r * P:r * P + rows], src=nll_t[0:rows, :])
    return nll, lse


@nki.jit
def head_nll_bwd(x_t, w_t, x, w, targets, lse, dnll, softcap):
    """x_t (C, N), w_t (C, V), x (N, C), w (V, C) HBM in one dtype; targets, lse, dnll (N,) fp32;
    softcap float -> (dx (N, C) in x's dtype, dw (V, C) in w's dtype) HBM."""
    C, N = x_t.shape
    V = w_t.shape[1]
    assert x.shape == (N, C) and w.shape == (V, C) and w_t.shape == (C, V), (x.shape, w.shape, w_t.shape)
    assert targets.shape == lse.shape == dnll.shape == (N,), (targets.shape, lse.shape, dnll.shape)
    assert C <= nl.tile_size.psum_fmax, f"C={C}: a (128, C) fp32 gradient tile must fit one PSUM bank"
    assert max(_tiles(C, P) * V, _tiles(V, P) * C) <= W_SBUF_MAX, f"weight (V={V}, C={C}) does not fit SBUF"
    n_vocab_tiles = _tiles(V, P)
    dx = nl.ndarray((N, C), dtype=x.dtype, buffer=nl.shared_hbm)
    dw = nl.ndarray((V, C), dtype=w.dtype, buffer=nl.shared_hbm)
    w_t_sb = _load_weight_t(w_t)
    w_sb = nl.ndarray((P, n_vocab_tiles, C), dtype=w.dtype, buffer=nl.sbuf)  # vocab tile v on partitions
    dw_acc = nl.ndarray((P, n_vocab_tiles, C), dtype=nl.float32, buffer=nl.sbuf)
    for v in nl.affine_range(n_vocab_tiles):
        vt = min(P, V - v * P)
        nisa.dma_copy(dst=w_sb[0:vt, v, :], src=w[v * P:v * P + vt, :])
        nisa.memset(dst=dw_acc[0:vt, v, :], value=0.0)
    # A plain range (sequential): every row tile adds into dw_acc.
    for r in range(_tiles(N, P)):
        rows = min(P, N - r * P)
        x_sb = _load_rows_t(x_t, r, rows)
        x_rows = nl.ndarray((P, C), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=x_rows[0:rows, :], src=x[r * P:r * P + rows, :])
        targets_t = _row_vector(targets, r, rows)
        dnll_t = _row_vector(dnll, r, rows)
        neg_lse = _row_vector(lse, r, rows)
        nisa.tensor_scalar(dst=neg_lse[0:rows, :], data=neg_lse[0:rows, :], op0=nl.multiply, operand0=-1.0)
        dx_acc = nl.ndarray((P, C), dtype=nl.float32, buffer=nl.psum)
        for v in nl.affine_range(n_vocab_tiles):
            v0, vt = v * P, min(P, V - v * P)
            logits, tanh = _logits(x_sb, w_t_sb, C, rows, v0, vt, P, softcap)
            grad = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=grad[0:rows, 0:vt], op=nl.exp, data=logits[0:rows, 0:vt], bias=neg_lse[0:rows, :])
            mask = _target_mask(targets_t, rows, v0, vt, P)
            nisa.tensor_tensor(dst=grad[0:rows, 0:vt], data1=grad[0:rows, 0:vt], data2=mask[0:rows, 0:vt],
                               op=nl.subtract)
            nisa.tensor_scalar(dst=grad[0:rows, 0:vt], data=grad[0:rows, 0:vt], op0=nl.multiply,
                               operand0=dnll_t[0:rows, :])
            if tanh is not None:
                # d(cap * tanh(l / cap)) / dl = 1 - tanh^2
                slope = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)
                nisa.tensor_tensor(dst=slope[0:rows, 0:vt], data1=tanh[0:rows, 0:vt], data2=tanh[0:rows, 0:vt],
                                   op=nl.multiply)
                nisa.tensor_scalar(dst=slope[0:rows, 0:vt], data=slope[0:rows, 0:vt], op0=nl.multiply, operand0=-1.0)
                nisa.tensor_scalar(dst=slope[0:rows, 0:vt], data=slope[0:rows, 0:vt], op0=nl.add, operand0=1.0)
                nisa.tensor_tensor(dst=grad[0:rows, 0:vt], data1=grad[0:rows, 0:vt], data2=slope[0:rows, 0:vt],
                                   op=nl.multiply)
            dlogits = nl.ndarray((P, P), dtype=x.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=dlogits[0:rows, 0:vt], src=grad[0:rows, 0:vt])
            # dx rows += dlogits @ w[v tile]: contract over vocab, so dlogits goes vocab-on-partitions.
            transposed = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.psum)
            nisa.nc_transpose(dst=transposed[0:vt, 0:rows], data=dlogits[0:rows, 0:vt])
            dlogits_t = nl.ndarray((P, P), dtype=x.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=dlogits_t[0:vt, 0:rows], src=transposed[0:vt, 0:rows])
            nisa.nc_matmul(dst=dx_acc[0:rows, :], stationary=dlogits_t[0:vt, 0:rows], moving=w_sb[0:vt, v, :],
                           accumulate=v > 0)
            # dw[v tile] += dlogits.T @ x rows: contract over rows, dlogits as it is.
            dw_part = nl.ndarray((P, C), dtype=nl.float32, buffer=nl.psum)
            nisa.nc_matmul(dst=dw_part[0:vt, :], stationary=dlogits[0:rows, 0:vt], moving=x_rows[0:rows, :],
                           accumulate=False)
            nisa.tensor_tensor(dst=dw_acc[0:vt, v, :], data1=dw_acc[0:vt, v, :], data2=dw_part[0:vt, :], op=nl.add)
        dx_t = nl.ndarray((P, C), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=dx_t[0:rows, :], src=dx_acc[0:rows, :])
        nisa.dma_copy(dst=dx[r * P:r * P + rows, :], src=dx_t[0:rows, :])
    for v in nl.affine_range(n_vocab_tiles):
        vt = min(P, V - v * P)
        dw_t = nl.ndarray((P, C), dtype=w.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=dw_t[0:vt, :], src=dw_acc[0:vt, v, :])
        nisa.dma_copy(dst=dw[v * P:v * P + vt, :], src=dw_t[0:vt, :])
    return dx, dw


def _forward(x, weight, targets, softcap):
    assert x.dtype == weight.dtype, (x.dtype, weight.dtype)
    return head_nll_fwd(x.t().contiguous(), weight.t().contiguous(), targets.float(), float(softcap))


def _backward(grad, x, weight, targets, softcap, lse):
    return head_nll_bwd(x.t().contiguous(), weight.t().contiguous(), x.contiguous(), weight.contiguous(),
                        targets.float(), lse, grad.float().contiguous(), float(softcap))


head_nll = NkiOp("nki_head_nll", _forward, _backward,
                 forward_fake=lambda x, weight, targets, softcap: (x.new_empty(x.shape[0], dtype=torch.float32),
                                                                   x.new_empty(x.shape[0], dtype=torch.float32)),
                 backward_fake=lambda grad, x, weight, targets, softcap, lse: (torch.empty_like(x),
                                                                                torch.empty_like(weight)),
                 forward_schema="(Tensor x, Tensor weight, Tensor targets, float softcap) -> (Tensor, Tensor)",
                 backward_schema=("(Tensor grad, Tensor x, Tensor weight, Tensor targets, float softcap, Tensor lse)"
                                  " -> (Tensor, Tensor)"),
                 grad_args=(0, 1))
