"""GPT: causality, parameter accounting, FLOP accounting against the model's own layers."""
import dataclasses

import pytest
import torch

from model import GPT, flops_per_token, param_count
from config import ModelConfig, load_config


def small_cfg(**changes) -> ModelConfig:
    base = load_config("configs/smoke.yaml").model
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize("changes", [{}, {"mlp": "swiglu", "tie_embeddings": False}, {"n_kv_head": 4}])
def test_causal_logits_ignore_later_tokens(changes):
    torch.manual_seed(0)
    model = GPT(small_cfg(**changes)).eval()
    for p in model.parameters():  # zero-initialised projections would hide any leak
        torch.nn.init.normal_(p, std=0.1)
    idx = torch.randint(0, model.cfg.vocab_size, (2, 48))
    t = 20
    changed = idx.clone()
    changed[:, t + 1:] = torch.randint(0, model.cfg.vocab_size, (2, 48 - t - 1))
    with torch.no_grad():
        a, b = model(idx), model(changed)
    assert a.shape == (2, 48, model.cfg.vocab_size) and a.dtype == torch.float32
    assert torch.equal(a[:, : t + 1], b[:, : t + 1])
    assert not torch.equal(a[:, t + 1:], b[:, t + 1:])  # the change did reach later positions


def test_param_count_counts_tied_embedding_once():
    tied, untied = GPT(small_cfg()), GPT(small_cfg(tie_embeddings=False))
    cfg = tied.cfg
    assert param_count(untied) - param_count(tied) == cfg.vocab_size * cfg.n_embd


@pytest.mark.parametrize("mlp", ["relu2", "swiglu"])
def test_flops_per_token_matches_the_models_matmuls(mlp):
    cfg = small_cfg(mlp=mlp)
    model = GPT(cfg)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    head = cfg.vocab_size * cfg.n_embd  # tied: the embedding matrix is the head's matmul
    seq_len = 64
    attention = cfg.n_layer * 2 * cfg.n_embd * seq_len  # QK^T and AV, causal half, 2 FLOPs per MAC
    assert flops_per_token(cfg, seq_len) == 3 * (2 * (linear + head) + attention)


def test_fresh_model_blocks_are_identity():
    # Zero-initialised output projections: every residual branch starts as a no-op.
    torch.manual_seed(0)
    deep, shallow = GPT(small_cfg(n_layer=3)), GPT(small_cfg(n_layer=0))
    shallow.wte.weight.data.copy_(deep.wte.weight)
    idx = torch.randint(0, deep.cfg.vocab_size, (1, 16))
    assert torch.equal(deep(idx), shallow(idx))


@pytest.mark.parametrize("bf16", ["autocast", "weights"])
def test_float32_attention_core_matches_the_reference(bf16):
    """The float32 attention core under bfloat16 (train.Backend.attn_float32) computes the same function:
    its loss and gradients agree with a float32 model's at least as well as the bfloat16 core's do."""
    torch.manual_seed(0)
    cfg = small_cfg(n_kv_head=2)
    ref = GPT(cfg)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.1)
    idx = torch.randint(0, cfg.vocab_size, (2, 32))

    def loss_and_grads(model, dtype):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "autocast"):
            loss = torch.nn.functional.cross_entropy(model(idx).float().flatten(0, 1), idx.roll(-1, 1).flatten())
        loss.backward()
        return loss.detach().float(), [p.grad.float() for p in model.parameters()]

    want, want_grads = loss_and_grads(ref, "float32")
    errors = {}
    for float32_core in (False, True):
        model = GPT(cfg, attn_float32=float32_core)
        model.load_state_dict(ref.state_dict())
        if bf16 == "weights":
            model.to(torch.bfloat16)
        assert all(b.attn.float32_core == float32_core for b in model.blocks)
        loss, grads = loss_and_grads(model, bf16)
        errors[float32_core] = max((g - w).norm() / w.norm() for g, w in zip(grads, want_grads) if w.norm() > 0)
        assert abs(loss - want) < 0.02 * want
    assert errors[True] < 0.05 and errors[True] <= errors[False] * 1.1, errors
