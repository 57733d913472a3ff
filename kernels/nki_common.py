"""The two Neuron call paths shared by the NKI kernel modules (kernels/nki_*.py).

An `NkiOp` is one fused op given as two host functions that launch NKI kernels:
forward(*args) -> out or (out, *saved) and backward(grad_out, *args, *saved) -> one gradient
per position in `grad_args`, plus a `fake` of each (output shapes only, for tracing). `NkiOp(*args)`
then runs it with its autograd on either Neuron path:

- device.type xla (torch-neuronx on PyTorch/XLA): the @nki.jit kernels are called on XLA tensors
  inside a torch.autograd.Function and lower to custom calls in the step's graph
  (nki/guides/framework_custom_op in the Neuron docs).
- device.type neuron (native TorchNeuron): forward and backward are registered as torch custom
  ops (torch.library.custom_op, with register_fake for tracing and register_autograd linking
  them), as torch/guides/how-to-work-with-nki in the Neuron docs shows for NKI kernels.

It also holds the RMSNorm tile helpers that nki_rmsnorm and nki_qk_norm_rope share.

Imported only through the nki_* modules, which kernels/__init__.py imports lazily. Nothing here
has run on Trainium: the Neuron SDK does not install on the machines this was written on. The
autograd and custom-op plumbing runs in tests on CPU tensors with tests/nki_double.py standing in
for NKI.
"""

import nki.isa as nisa
import nki.language as nl
import torch

P = nl.tile_size.pmax  # 128 partitions


def _save(ctx, args, saved):
    """Keep the op's arguments and forward's extra outputs for backward: tensors through
    save_for_backward, constants (floats) on ctx."""
    ctx.is_tensor = [isinstance(a, torch.Tensor) for a in args]
    ctx.constants = [a for a in args if not isinstance(a, torch.Tensor)]
    ctx.save_for_backward(*(a for a in args if isinstance(a, torch.Tensor)), *saved)


def _saved(ctx):
    """-> (args, saved) as _save kept them."""
    tensors, constants = iter(ctx.saved_tensors), iter(ctx.constants)
    args = [next(tensors) if t else next(constants) for t in ctx.is_tensor]
    return args, list(tensors)


class _OnXla(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, *args):
        out, *saved = _as_tuple(op.forward(*args))
        ctx.op = op
        _save(ctx, args, saved)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        args, saved = _saved(ctx)
        grads = ctx.op.backward(grad_out.contiguous(), *args, *saved)
        return (None, *ctx.op.place(_as_tuple(grads), len(args)))


class NkiOp:
    """forward_schema / backward_schema: torch.library schemas of forward(*args) -> (out, *saved)
    and backward(grad_out, *args, *saved) -> gradients of the args at positions grad_args."""

    def __init__(self, name, forward, backward, forward_fake, backward_fake, forward_schema, backward_schema,
                 grad_args):
        self.forward, self.backward, self.grad_args = forward, backward, grad_args
        self.neuron_forward = torch.library.custom_op(f"aion::{name}_fwd", forward, mutates_args=(),
                                                      schema=forward_schema)
        self.neuron_backward = torch.library.custom_op(f"aion::{name}_bwd", backward, mutates_args=(),
                                                       schema=backward_schema)
        self.neuron_forward.register_fake(forward_fake)
        self.neuron_backward.register_fake(backward_fake)
        self.neuron_forward.register_autograd(self._neuron_grad, setup_context=self._neuron_setup)

    def place(self, grads, n_args):
        """Gradients for grad_args -> one entry per argument (None where not differentiable)."""
        placed = [None] * n_args
        for position, grad in zip(self.grad_args, grads):
            placed[position] = grad
        return placed

    def _neuron_setup(self, ctx, inputs, output):
        _save(ctx, inputs, _as_tuple(output)[1:])

    def _neuron_grad(self, ctx, grad_out, *unused_saved_grads):
        args, saved = _saved(ctx)
        grads = self.neuron_backward(grad_out.contiguous(), *args, *saved)
        return tuple(self.place(_as_tuple(grads), len(args)))

    def on_xla(self, *args):
        return _OnXla.apply(self, *args)

    def on_neuron(self, *args):
        return _as_tuple(self.neuron_forward(*args))[0]

    def __call__(self, *args):
        device = args[0].device.type
        if device == "xla":
            return self.on_xla(*args)
        if device == "neuron":
            return self.on_neuron(*args)
        raise RuntimeError(f"NKI kernels run on device.type xla or neuron, not {device}")


def _as_tuple(result):
    """A host function returns one tensor or several (an op's output, then what backward needs)."""
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def row_rstd(x_t, rows, C, eps):
    """rstd (P, 1) fp32 of the first `rows` rows of the SBUF tile x_t (P, C)."""
    squares = nl.ndarray((P, C), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=squares[0:rows, :], data1=x_t[0:rows, :], data2=x_t[0:rows, :], op=nl.multiply)
    sum_sq = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=sum_sq[0:rows, :], op=nl.add, data=squares[0:rows, :], axis=1)
    eps_t = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=eps_t[0:rows, :], value=eps)
    rstd = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    # activation computes op(data * scale + bias): rsqrt(sum / C + eps) in one instruction.
    nisa.activation(dst=rstd[0:rows, :], op=nl.rsqrt, data=sum_sq[0:rows, :], scale=1.0 / C, bias=eps_t[0:rows, :])
    return rstd


def rms_backward_tile(dy, x_hat, rstd, rows, C, dx_t):
    """dx_t[:rows] = rstd * (dy - x_hat * mean(dy * x_hat)); dy, x_hat (P, C) fp32 tiles."""
    product = nl.ndarray((P, C), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=product[0:rows, :], data1=dy[0:rows, :], data2=x_hat[0:rows, :], op=nl.multiply)
    mean = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=mean[0:rows, :], op=nl.add, data=product[0:rows, :], axis=1)
    nisa.tensor_scalar(dst=mean[0:rows, :], data=mean[0:rows, :], op0=nl.multiply, operand0=1.0 / C)
    correction = nl.ndarray((P, C), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=correction[0:rows, :], data=x_hat[0:rows, :], op0=nl.multiply, operand0=mean[0:rows, :])
    nisa.tensor_tensor(dst=correction[0:rows, :], data1=dy[0:rows, :], data2=correction[0:rows, :], op=nl.subtract)
    nisa.tensor_scalar(dst=dx_t[0:rows, :], data=correction[0:rows, :], op0=nl.multiply, operand0=rstd[0:rows, :])
