"""Each NKI kernel (kernels/nki_*.py), forward and backward, against kernels/reference.py: values
and gradients, fp32 tight and bf16 loose, on shapes that are not multiples of the tiles (128
partitions, 512-wide PSUM chunks, 2048-wide elementwise tiles), with and without the soft-cap.

The kernels run through both host call paths of kernels/nki_common.NkiOp (the autograd.Function
used on XLA and the torch custom op used on native Neuron), here on CPU tensors. Without the
Neuron SDK (always, on these machines) the kernels' source runs on tests/nki_double.py; where the
real `nki` package with its CPU simulator is importable, the same tests run every kernel under
`nki.simulate` instead, and the double's own tests are skipped.
"""

import importlib
import importlib.util
import sys

import numpy as np
import pytest
import torch

import nki_double
from kernels import reference

REAL_NKI = importlib.util.find_spec("nki") is not None and hasattr(importlib.import_module("nki"), "simulate")
KERNELS = {
    "nki_relu2": ("relu2_fwd", "relu2_bwd"),
    "nki_rmsnorm": ("rms_norm_fwd", "rms_norm_bwd"),
    "nki_qk_norm_rope": ("qk_norm_rope_fwd", "qk_norm_rope_bwd"),
    "nki_head": ("head_nll_fwd", "head_nll_bwd"),
}
DTYPES = [torch.float32, torch.bfloat16]
PATHS = ["xla", "neuron"]


def _simulated(kernel):
    """A real @nki.jit kernel under nki.simulate, called with CPU torch tensors like the double."""
    import ml_dtypes
    import nki

    def to_numpy(a):
        if not isinstance(a, torch.Tensor):
            return a
        if a.dtype == torch.bfloat16:
            return a.detach().float().numpy().astype(ml_dtypes.bfloat16)
        return a.detach().numpy()

    def to_torch(a):
        if a.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(a))

    def run(*args):
        out = nki.simulate(kernel)(*(to_numpy(a) for a in args))
        return tuple(to_torch(o) for o in out) if isinstance(out, tuple) else to_torch(out)

    return run


@pytest.fixture
def load(monkeypatch):
    def load_module(name):
        if not REAL_NKI:
            return nki_double.load_kernel_module(name)
        module = importlib.import_module(f"kernels.{name}")
        for kernel in KERNELS[name]:
            monkeypatch.setattr(module, kernel, _simulated(getattr(module, kernel)))
        return module

    return load_module


def _run(op, path, *args):
    return op.on_xla(*args) if path == "xla" else op.on_neuron(*args)


def _close(actual, expected, loose):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (actual.dtype, actual.shape,
                                                                                 expected.dtype, expected.shape)
    if loose:  # bf16 inputs: a few bf16 roundings apart, relative to the tensor's scale
        error = (actual.float() - expected.float()).abs().max().item()
        assert error <= 3e-2 * max(1.0, expected.float().abs().max().item()), error
    else:  # fp32: summation order apart, relative to the tensor's scale
        error = (actual - expected).abs().max().item()
        assert error <= 1e-5 * max(1.0, expected.abs().max().item()), error


def _check(outputs, reference_outputs, inputs):
    """Values of the op, then gradients of every input under one random upstream gradient;
    fp32 tight, loose where the inputs are bf16."""
    loose = inputs[0].dtype == torch.bfloat16
    _close(outputs, reference_outputs, loose)
    grad = torch.randn(outputs.shape, generator=torch.Generator().manual_seed(0)).to(outputs.dtype)
    grads = torch.autograd.grad(outputs, inputs, grad)
    reference_grads = torch.autograd.grad(reference_outputs, inputs, grad)
    for g, rg in zip(grads, reference_grads):
        _close(g, rg, loose)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_relu2(load, dtype, path):
    module = load("nki_relu2")
    x = torch.randn(3, 70, 2100).to(dtype).requires_grad_()  # 210 rows, 2100 = one 2048 tile + 52
    _check(_run(module.relu2, path, x), reference.relu2(x), (x,))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(load, dtype, path):
    module = load("nki_rmsnorm")
    x = torch.randn(2, 150, 96).mul(3).to(dtype).requires_grad_()  # 300 rows: 128 + 128 + 44
    _check(_run(module.rms_norm, path, x), reference.rms_norm(x), (x,))


def _rotary(T, D, positions, dtype):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    t = torch.arange(T) if positions is None else positions[:, None]  # (T,) or (B, 1, T)
    freqs = t.float()[..., None] * inv_freq
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("gain", [False, True])
@pytest.mark.parametrize("routed", [False, True], ids=["positions-shared", "positions-per-sequence"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope(load, monkeypatch, dtype, routed, gain, path):
    module = load("nki_qk_norm_rope")
    monkeypatch.setattr(module, "_op", module._op.on_xla if path == "xla" else module._op.on_neuron)
    B, H, T, D = 2, 3, 200, 16  # T = 128 + 72
    positions = torch.randint(0, 1000, (B, T), generator=torch.Generator().manual_seed(1)) if routed else None
    cos, sin = _rotary(T, D, positions, dtype)
    x = torch.randn(B, H, T, D).mul(2).to(dtype).requires_grad_()
    q_gain = torch.linspace(0.5, 2.0, H).requires_grad_() if gain else None
    inputs = (x, q_gain) if gain else (x,)
    _check(module.qk_norm_rope(x, cos, sin, q_gain), reference.qk_norm_rope(x, cos, sin, q_gain), inputs)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("N, C, V", [(200, 96, 300), (130, 200, 1100)],
                         ids=["one-vocab-chunk", "three-vocab-chunks-two-C-chunks"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_head_nll(load, dtype, N, C, V, softcap, path):
    module = load("nki_head")
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(N, C, generator=generator).to(dtype).requires_grad_()
    # Large enough logits (std ~ 6) that the soft-cap bends them and chunk maxima differ.
    weight = torch.randn(V, C, generator=generator).mul(6 / C ** 0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=generator)
    outputs = _run(module.head_nll, path, x, weight, targets, softcap)
    _check(outputs, reference.head_nll(x, weight, targets, softcap), (x, weight))


needs_double = pytest.mark.skipif(REAL_NKI, reason="the real nki is importable: the kernels ran on nki.simulate")


@needs_double
def test_double_leaves_no_modules_behind():
    nki_double.load_kernel_module("nki_head")
    assert "nki" not in sys.modules and not any(m.startswith("kernels.nki_") for m in sys.modules)


@needs_double
def test_double_rounds_like_torch_bf16():
    values = torch.randn(10000).mul(100)
    values[:4] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 0.0])  # ties to even
    expected = values.to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(nki_double.round_bf16(values.numpy()), expected)


@needs_double
@pytest.mark.parametrize("case", ["partitions", "psum-width", "psum-dtype", "moving-width", "stationary-width",
                                  "accumulate-unwritten", "compute-on-hbm", "dma-into-psum"])
def test_double_enforces_the_shape_rules(case):
    with nki_double.installed() as nki:
        nl, nisa = nki.language, nki.isa
        a = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.sbuf)
        acc = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
        hbm = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.shared_hbm)
        wide = nl.ndarray((128, 513), dtype=nl.float32, buffer=nl.sbuf)
        violations = {
            "partitions": lambda: nl.ndarray((129, 4), dtype=nl.float32, buffer=nl.sbuf),
            "psum-width": lambda: nl.ndarray((128, 513), dtype=nl.float32, buffer=nl.psum),
            "psum-dtype": lambda: nl.ndarray((128, 4), dtype=nl.bfloat16, buffer=nl.psum),
            "moving-width": lambda: nisa.nc_matmul(dst=acc[:, 0:1], stationary=wide[:, 0:128], moving=wide,
                                                   accumulate=False),
            "stationary-width": lambda: nisa.nc_matmul(dst=acc[:, :], stationary=wide[:, 0:129],
                                                       moving=a, accumulate=False),
            "accumulate-unwritten": lambda: nisa.nc_matmul(dst=acc[:, 128:256], stationary=a, moving=a,
                                                           accumulate=True),
            "compute-on-hbm": lambda: nisa.tensor_tensor(dst=a, data1=hbm, data2=a, op=nl.add),
            "dma-into-psum": lambda: nisa.dma_copy(dst=acc[:, 0:128], src=hbm),
        }
        nisa.nc_matmul(dst=acc[:, 0:128], stationary=a, moving=a, accumulate=False)  # legal
        nisa.nc_matmul(dst=acc[:, 0:128], stationary=a, moving=a, accumulate=True)  # legal
        with pytest.raises(AssertionError):
            violations[case]()
