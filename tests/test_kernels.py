"""kernels/: every Triton kernel computes its reference (values and gradients, odd shapes, soft-cap
on and off); the config section `kernels` resolves as documented; the model with the reference
kernels computes what it computed before kernels/ existed.

Without a GPU the Triton kernels run under TRITON_INTERPRET=1 (numpy on the CPU): set here, before
any kernels.triton_* module is imported, because @triton.jit reads it when a kernel is defined.
With a GPU the same tests run the compiled kernels on it, and the bfloat16 ones run too.
"""
import dataclasses
import importlib
import importlib.util
import os
import sys

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

import config  # noqa: E402
import kernels  # noqa: E402
import train  # noqa: E402
from kernels import reference  # noqa: E402
from model import GPT  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
SMOKE = "configs/smoke.yaml"
NO_BF16 = pytest.mark.skipif(not CUDA, reason="bfloat16 Triton kernels are checked on a GPU only (no CUDA device here)")
DTYPES = [pytest.param(torch.float32, id="fp32"),
          pytest.param(torch.bfloat16, id="bf16", marks=[pytest.mark.cuda, NO_BF16])]


def tolerance(dtype):
    """fp32: tight (reordered sums only); bf16: the reference rounds every intermediate to bf16."""
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)


def triton_op(op):
    return getattr(importlib.import_module(f"kernels.triton_{op}"), kernels.FUNCTIONS[op])


def check_against_reference(op, args, differentiable, dtype):
    """Run op's Triton kernel and its reference on copies of args; compare outputs and the
    gradients of a random weighting of the output with respect to args[i], i in differentiable."""
    def leaves():
        return [a.detach().clone().requires_grad_(i in differentiable) if torch.is_tensor(a) else a
                for i, a in enumerate(args)]
    ours, theirs = leaves(), leaves()
    out = triton_op(op)(*ours)
    expected = getattr(reference, kernels.FUNCTIONS[op])(*theirs)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, **tolerance(dtype))
    weights = torch.randn(out.shape, device=out.device, dtype=out.dtype)
    grads = torch.autograd.grad(out, [ours[i] for i in differentiable], weights)
    expected_grads = torch.autograd.grad(expected, [theirs[i] for i in differentiable], weights)
    for i, grad, expected_grad in zip(differentiable, grads, expected_grads):
        assert grad.dtype == expected_grad.dtype, i
        torch.testing.assert_close(grad, expected_grad, **tolerance(dtype))


# -- the Triton kernels against the reference --------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 53), (3, 5, 700)], ids=["2d", "over-one-block"])
def test_triton_relu2(shape, dtype):
    torch.manual_seed(0)
    check_against_reference("relu2", [torch.randn(shape, device=DEVICE, dtype=dtype)], [0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 48), (2, 3, 5, 7), (4, 96)])
def test_triton_rmsnorm(shape, dtype):
    torch.manual_seed(0)
    x = torch.randn(shape, device=DEVICE, dtype=dtype) * 3 + 0.5
    check_against_reference("rmsnorm", [x], [0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gain", [True, False], ids=["q-gain", "k-no-gain"])
@pytest.mark.parametrize("routed", [False, True], ids=["positions-T", "positions-per-sequence"])
@pytest.mark.parametrize("head_dim", [12, 10])  # half 6 and 5: neither a power of two
def test_triton_qk_norm_rope(head_dim, routed, gain, dtype):
    torch.manual_seed(0)
    B, H, T = 2, 3, 5
    # Laid out as the model's q: (B, T, H, D) memory seen as (B, H, T, D), not contiguous.
    x = torch.randn(B, T, H, head_dim, device=DEVICE, dtype=dtype).transpose(1, 2)
    angles = torch.rand((B, 1, T, head_dim // 2) if routed else (T, head_dim // 2), device=DEVICE) * 6
    args = [x, angles.cos().to(dtype), angles.sin().to(dtype)]
    if gain:
        args.append(torch.rand(H, device=DEVICE) + 0.5)  # float32, as the model's q_gain
    check_against_reference("qk_norm_rope", args, [0, 3] if gain else [0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap", [0.0, 30.0, 2.0], ids=["no-cap", "cap-30", "cap-2"])
@pytest.mark.parametrize("block_v", [4096, 32], ids=["one-block", "blocks-of-32"])
def test_triton_head(block_v, softcap, dtype, monkeypatch):
    """N=37, C=48, V=100: 3 chunks of 13, 13 and 11 rows; blocks of 32 columns leave a partial
    fourth block. cap-2 pushes most logits past the tanh series' range (|u| >= 0.2)."""
    monkeypatch.setattr(importlib.import_module("kernels.triton_head"), "MAX_BLOCK_V", block_v)
    torch.manual_seed(0)
    N, C, V = 37, 48, 100
    x = reference.rms_norm(torch.randn(N, C, device=DEVICE)).to(dtype)
    weight = (torch.randn(V, C, device=DEVICE) * 0.3).to(dtype)
    targets = torch.randint(0, V, (N,), device=DEVICE)
    check_against_reference("head", [x, weight, targets, softcap], [0, 1], dtype)


def test_triton_head_chunks_the_rows():
    head = importlib.import_module("kernels.triton_head")
    assert head.chunk_rows(37, 100, 48) == 13  # ceil(37 / ceil(100 / 48))
    assert head.chunk_rows(16384, 1024, 512) == 8192  # base.yaml: two chunks, each half of [N, V]
    assert head.chunk_rows(5, 10, 64) == 5  # V <= C: one chunk


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="autocast of the head's matmuls needs a CUDA device (none here)")
def test_triton_head_under_autocast_matches_reference():
    torch.manual_seed(0)
    x = torch.randn(64, 48, device=DEVICE, requires_grad=True)
    weight = (torch.randn(100, 48, device=DEVICE) * 0.3).requires_grad_()
    targets = torch.randint(0, 100, (64,), device=DEVICE)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ours = triton_op("head")(x, weight, targets, 30.0)
        expected = reference.head_nll(x, weight, targets, 30.0)
    torch.testing.assert_close(ours, expected, rtol=3e-2, atol=3e-2)
    grads = torch.autograd.grad(ours.sum(), (x, weight))
    expected_grads = torch.autograd.grad(expected.sum(), (x, weight))
    for grad, expected_grad in zip(grads, expected_grads):
        assert grad.dtype == torch.float32
        torch.testing.assert_close(grad, expected_grad, rtol=3e-2, atol=3e-2)


# -- dispatch ----------------------------------------------------------------------------------

def choices(**changes):
    return {op: changes.get(op, "auto") for op in kernels.OPS}


def test_auto_is_the_table_and_the_table_names_implementations():
    assert set(kernels.AUTO) == {"cpu", "cuda", "xla-cpu", "xla-neuron", "neuron"}
    for table in kernels.AUTO.values():
        assert set(table) == set(kernels.OPS) and set(table.values()) <= set(kernels.IMPLS)
    resolved = kernels.resolve(choices(), "cpu")
    assert resolved.chosen == kernels.AUTO["cpu"]
    assert resolved.head is reference.head_nll and resolved.rmsnorm is reference.rms_norm
    assert resolved.qk_norm_rope is reference.qk_norm_rope and resolved.relu2 is reference.relu2


def test_auto_follows_the_table(monkeypatch):
    monkeypatch.setitem(kernels.AUTO, "cpu", dict(kernels.AUTO["cpu"], relu2="triton"))
    with pytest.raises(kernels.KernelError, match=r"kernels.relu2=auto \(auto picks triton here"):
        kernels.resolve(choices(), "cpu")
    monkeypatch.setitem(kernels.AUTO, "cuda", dict(kernels.AUTO["cuda"], relu2="triton"))
    assert kernels.resolve(choices(), "cuda").relu2 is triton_op("relu2")


@pytest.mark.parametrize("kind, on_trainium, op, impl, message", [
    ("cpu", False, "head", "triton", "kernels.head=triton: Triton kernels need device.type=cuda, this run's device is cpu"),
    ("xla", True, "rmsnorm", "triton", "kernels.rmsnorm=triton: Triton kernels need device.type=cuda"),
    ("cpu", False, "relu2", "nki", "kernels.relu2=nki: NKI kernels need device.type=neuron or device.type=xla on "
                                   "Trainium, this run's device is cpu"),
    ("xla", False, "qk_norm_rope", "nki", "kernels.qk_norm_rope=nki: NKI kernels need device.type=neuron or "
                                          "device.type=xla on Trainium, this run's device is xla (CPU PJRT)"),
    ("cuda", False, "head", "nki", "kernels.head=nki: NKI kernels need"),
])
def test_an_impossible_choice_names_the_key(kind, on_trainium, op, impl, message):
    with pytest.raises(kernels.KernelError) as e:
        kernels.resolve(choices(**{op: impl}), kind, on_trainium)
    assert message in str(e.value)


@pytest.mark.skipif(importlib.util.find_spec("nki") is not None, reason="the nki package is installed here")
def test_nki_without_the_neuron_sdk_names_the_key():
    with pytest.raises(kernels.KernelError, match=r"kernels.head=nki: the nki package \(Neuron SDK\) is not importable"):
        kernels.resolve(choices(head="nki"), "neuron")


def test_explicit_choices_load_their_modules_only():
    loaded = set(sys.modules)
    resolved = kernels.resolve(choices(head="torch", rmsnorm="triton", qk_norm_rope="triton", relu2="triton"), "cuda")
    assert resolved.chosen == dict(head="torch", rmsnorm="triton", qk_norm_rope="triton", relu2="triton")
    assert str(resolved) == "head:torch rmsnorm:triton qk_norm_rope:triton relu2:triton"
    assert resolved.rmsnorm is triton_op("rmsnorm") and resolved.head is reference.head_nll
    assert not any(name.startswith("kernels.nki_") for name in set(sys.modules) - loaded)


def test_config_rejects_an_unknown_implementation():
    with pytest.raises(config.ConfigError, match="kernels.head: expected one of auto | torch | triton | nki, got 'cuda'"):
        config.load_config(SMOKE, ["kernels.head=cuda"])


def test_cli_rejects_triton_on_the_cpu_before_any_work(tmp_path, capsys):
    args = ["--config", SMOKE, "device.type=cpu", "kernels.relu2=triton", f"run.out_dir={tmp_path / 'runs'}",
            f"ledger.path={tmp_path / 'ledger.csv'}"]
    assert train.main(args) == 2
    assert "kernels.relu2=triton: Triton kernels need device.type=cuda" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "ledger.csv").exists()


# -- the model ---------------------------------------------------------------------------------

def loss_before_kernels(model, idx, targets, reduction):
    """GPT.loss of a dense model as model.py computed it before kernels/ existed (F.rms_norm, the
    rotary inline, F.relu(x).square(), the logits and F.cross_entropy)."""
    def rms_norm(x):
        return F.rms_norm(x, (x.size(-1),))

    def rotate(x, inv_freq):
        freqs = torch.arange(x.size(-2)).float()[..., None] * inv_freq
        cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)

    x = rms_norm(model.wte(idx))
    B, T, C = x.shape
    for block in model.blocks:
        attn, mlp = block.attn, block.mlp
        h = rms_norm(x)
        q = attn.c_q(h).view(B, T, attn.n_head, attn.head_dim).transpose(1, 2)
        k, v = attn.c_kv(h).view(B, T, 2, attn.n_kv_head, attn.head_dim).permute(2, 0, 3, 1, 4)
        q, k = rotate(rms_norm(q), attn.rotary.inv_freq), rotate(rms_norm(k), attn.rotary.inv_freq)
        q = q * attn.q_gain.to(q.dtype)[None, :, None, None]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=attn.n_kv_head != attn.n_head)
        x = x + block.attn_scale * attn.c_proj(y.transpose(1, 2).reshape(B, T, C))
        n = mlp.hidden
        x = x + block.mlp_scale * F.linear(F.relu(F.linear(rms_norm(x), mlp.c_fc.weight[:n])).square(),
                                           mlp.c_proj.weight[:, :n])
    logits = F.linear(rms_norm(x), model.wte.weight).float()
    cap = model.cfg.logit_softcap
    logits = cap * torch.tanh(logits / cap)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), reduction=reduction)


def small_model(kernels_=None):
    torch.manual_seed(0)
    cfg = dataclasses.replace(config.load_config(SMOKE).model, vocab_size=100, n_embd=32)
    model = GPT(cfg, kernels=kernels_)
    for p in model.parameters():  # zero-initialised projections would hide most of the model
        torch.nn.init.normal_(p, std=0.2)
    return model


def test_model_with_reference_kernels_computes_what_it_did_before():
    model = small_model()
    idx = torch.randint(0, 100, (2, 24))
    targets = torch.roll(idx, -1, dims=1)
    assert torch.equal(model.loss(idx, targets, reduction="none"), loss_before_kernels(model, idx, targets, "none"))
    torch.testing.assert_close(model.loss(idx, targets), loss_before_kernels(model, idx, targets, "mean"),
                               rtol=1e-6, atol=0)  # .mean() of the per-token NLL: another summation order
    grads = torch.autograd.grad(model.loss(idx, targets, reduction="sum"), list(model.parameters()))
    expected = torch.autograd.grad(loss_before_kernels(model, idx, targets, "sum"), list(model.parameters()))
    for grad, expected_grad in zip(grads, expected):
        assert torch.equal(grad, expected_grad)
    logits = model(idx)
    assert torch.equal(F.cross_entropy(logits.view(-1, 100), targets.view(-1), reduction="none"),
                       loss_before_kernels(model, idx, targets, "none"))


def test_model_with_triton_kernels_matches_the_reference():
    resolved = kernels.resolve(choices(head="triton", rmsnorm="triton", qk_norm_rope="triton", relu2="triton"), "cuda")
    fused, plain = small_model(resolved).to(DEVICE), small_model().to(DEVICE)
    idx = torch.randint(0, 100, (2, 24), device=DEVICE)
    targets = torch.roll(idx, -1, dims=1)
    loss, expected = fused.loss(idx, targets), plain.loss(idx, targets)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    loss.backward()
    expected.backward()
    for (name, p), q in zip(fused.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
