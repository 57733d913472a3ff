"""Triton output head + logit soft-cap + cross-entropy for CUDA, chunked over rows, so the full
(N, V) fp32 logits never exist at once.

x (N, C) final-normed activations and weight (V, C) the head, float32 or bfloat16 (under autocast
both are cast to the autocast dtype first, as F.linear would); targets (N,) int64 in [0, V);
softcap float, 0 = off. -> (N,) float32 NLL in nats.
Forward, per chunk of chunk_rows(N, V, C) rows: logits = x_chunk @ weight.T (cuBLAS, x's dtype,
the chunk's (rows, V) buffer is the only logits memory), then one Triton program per row reads
its logits once: soft-cap in fp32, an online logsumexp over blocks of BLOCK_V columns, and the
target's logit -> nll and lse (N,) fp32. Saves x, weight, targets, lse.
Backward, per chunk: the logits again, one Triton program per row overwrites them in place with
d logits = (softmax - onehot(target)) * dnll * (1 - tanh^2) (the soft-cap's derivative), then
dx_chunk = dlogits @ weight and dweight += dlogits.T @ x_chunk (accumulated in fp32).
tanh is computed from exp (the Triton interpreter has no libdevice): an odd Taylor series below
|u| = 0.2, where 1 - exp(-2|u|) would cancel, the exp form above.
Reference: kernels/reference.py head_nll.
"""

import torch
import triton
import triton.language as tl

from kernels.triton_checks import check_device

MAX_BLOCK_V = 4096  # vocab columns per block of the row loop


@triton.jit
def _tanh(u):
    a = tl.abs(u)
    e = tl.exp(-2.0 * a)
    far = (1.0 - e) / (1.0 + e)
    u2 = a * a
    near = a * (1.0 + u2 * (-1.0 / 3.0 + u2 * (2.0 / 15.0 + u2 * (-17.0 / 315.0 + u2 * (62.0 / 2835.0)))))
    t = tl.where(a < 0.2, near, far)
    return tl.where(u < 0, -t, t)


@triton.jit
def _forward(logits_ptr, targets_ptr, nll_ptr, lse_ptr, softcap, V: tl.constexpr,
             SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * V
    running_max = tl.zeros([], dtype=tl.float32) - float("inf")
    running_sum = tl.zeros([], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V
        z = tl.load(logits_row + cols, mask=mask, other=0.0).to(tl.float32)
        if SOFTCAP:
            z = softcap * _tanh(z / softcap)
        z = tl.where(mask, z, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(z, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(z - new_max), axis=0)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    z_target = tl.load(logits_row + tl.load(targets_ptr + row)).to(tl.float32)
    if SOFTCAP:
        z_target = softcap * _tanh(z_target / softcap)
    tl.store(nll_ptr + row, lse - z_target)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _backward(logits_ptr, targets_ptr, lse_ptr, dnll_ptr, softcap, V: tl.constexpr,
              SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * V
    lse = tl.load(lse_ptr + row)
    dnll = tl.load(dnll_ptr + row)
    target = tl.load(targets_ptr + row)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V
        z = tl.load(logits_row + cols, mask=mask, other=0.0).to(tl.float32)
        one_hot = tl.where(cols == target, 1.0, 0.0)
        if SOFTCAP:
            t = _tanh(z / softcap)
            grad = (tl.exp(softcap * t - lse) - one_hot) * dnll * (1.0 - t * t)
        else:
            grad = (tl.exp(z - lse) - one_hot) * dnll
        tl.store(logits_row + cols, grad.to(logits_ptr.dtype.element_ty), mask=mask)


def chunk_rows(N, V, C):
    """Rows per chunk: a chunk's (rows, V) logits are about as large as all of x (N, C)."""
    return max(1, triton.cdiv(N, triton.cdiv(V, C)))


def launch_meta(V, softcap):
    return dict(SOFTCAP=softcap > 0, BLOCK_V=min(triton.next_power_of_2(V), MAX_BLOCK_V))


class HeadNLL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, softcap):
        (N, C), V = x.shape, weight.size(0)
        assert x.dtype == weight.dtype and x.dtype in (torch.float32, torch.bfloat16), (x.dtype, weight.dtype)
        assert weight.shape == (V, C) and targets.shape == (N,) and targets.dtype == torch.int64, \
            (x.shape, weight.shape, targets.shape, targets.dtype)
        assert softcap >= 0, softcap
        check_device(x, weight, targets)
        x, targets = x.contiguous(), targets.contiguous()
        nll = torch.empty(N, dtype=torch.float32, device=x.device)
        lse = torch.empty(N, dtype=torch.float32, device=x.device)
        rows = chunk_rows(N, V, C)
        for start in range(0, N, rows):
            logits = x[start:start + rows] @ weight.t()  # (rows, V)
            _forward[(logits.size(0),)](logits, targets[start:], nll[start:], lse[start:], softcap, V,
                                        **launch_meta(V, softcap))
        ctx.save_for_backward(x, weight, targets, lse)
        ctx.softcap = softcap
        return nll

    @staticmethod
    def backward(ctx, dnll):
        x, weight, targets, lse = ctx.saved_tensors
        (N, C), V = x.shape, weight.size(0)
        dnll = dnll.contiguous().float()
        dx = torch.empty_like(x)
        dweight = torch.zeros(V, C, dtype=torch.float32, device=x.device)
        rows = chunk_rows(N, V, C)
        for start in range(0, N, rows):
            x_chunk = x[start:start + rows]
            dlogits = x_chunk @ weight.t()  # the logits, overwritten with their gradient
            _backward[(dlogits.size(0),)](dlogits, targets[start:], lse[start:], dnll[start:], ctx.softcap, V,
                                          **launch_meta(V, ctx.softcap))
            dx[start:start + rows] = dlogits @ weight
            dweight += dlogits.t() @ x_chunk
        return dx, dweight.to(weight.dtype), None, None


def head_nll(x, weight, targets, softcap):
    device = x.device.type
    if torch.is_autocast_enabled(device):
        # What F.linear does under autocast: the matmuls run in the autocast dtype.
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
    return HeadNLL.apply(x, weight, targets, float(softcap))
