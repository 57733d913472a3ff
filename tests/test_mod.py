"""Mixture-of-Depths routing in model.py: causal evaluation, static shapes, what the block router
computes and where its gradients go, skipped work, and the FLOP / parameter accounting."""
from types import SimpleNamespace

import pytest
import torch

import config
from model import GPT, active_params, flops_per_token, param_count, rms_norm, units_selected

T, BLOCK_SIZE, ROUTED = 32, 8, (1, 3)  # 4 tiles per sequence; layers 1 and 3 of 4 routed


def tiny_cfg(**changes):
    """configs/base.yaml's model section at a tiny shape."""
    base = {k.removeprefix("model."): v for k, v in config.base_values().items() if k.startswith("model.")}
    shape = dict(vocab_size=64, n_layer=4, n_embd=32, n_head=4, n_kv_head=2, mlp_mult=2)
    return SimpleNamespace(**{**base, **shape, **changes})


def mod_cfg(granularity, capacity=0.5):
    return SimpleNamespace(granularity=granularity, layers=ROUTED, block_size=BLOCK_SIZE,
                           capacity=capacity, aux_weight=0.1, recur=False)


def make(granularity, capacity=0.5, seed=0):
    """A model with every weight random: zero-initialised projections would hide leaks and deltas."""
    torch.manual_seed(seed)
    model = GPT(tiny_cfg(), mod_cfg(granularity, capacity))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return model


def tokens(batch=2, seed=1):
    return torch.randint(0, 64, (batch, T), generator=torch.Generator().manual_seed(seed))


def count_calls(modules):
    """Forward hooks recording the input shape of every call, per module."""
    calls = [[] for _ in modules]
    for log, m in zip(calls, modules):
        m.register_forward_hook(lambda mod, args, out, log=log: log.append(tuple(args[0].shape)))
    return calls


@pytest.mark.parametrize("granularity", ["block", "token", "layer", "microbatch"])
def test_evaluation_is_causal(granularity):
    model = make(granularity).eval()
    logits = [r.predictor for r in model.routers.values()]
    decisions = []
    for p in logits:
        p.register_forward_hook(lambda mod, args, out: decisions.append(out > 0))
    idx = tokens()
    for t in (3, 7, 8, 12, 23, 24):  # inside tiles, last token of a tile, first token of a tile
        changed = idx.clone()
        changed[:, t + 1:] = torch.randint(0, 64, (2, T - t - 1), generator=torch.Generator().manual_seed(t))
        with torch.no_grad():
            a, b = model(idx), model(changed)
        assert torch.equal(a[:, : t + 1], b[:, : t + 1]), t
        assert not torch.equal(a[:, t + 1:], b[:, t + 1:])  # the change did reach later positions
    if granularity in ("block", "token"):  # the predictor both processed and skipped tiles: routing was exercised
        decided = torch.cat([d.flatten() for d in decisions])
        assert decided.any() and not decided.all()


def test_full_capacity_is_the_dense_layer_scaled_by_the_router():
    model = make("block", capacity=1.0).train()
    router, block = model.routers["1"], model.blocks[1]
    x = torch.randn(2, T, 32)
    out, _ = router(block, x, T // BLOCK_SIZE)
    ctx = torch.cat((torch.zeros(2, 1, 32), x[:, BLOCK_SIZE - 1::BLOCK_SIZE][:, :-1]), dim=1)  # (B, n, C)
    w = torch.sigmoid(router.router(rms_norm(ctx))).repeat_interleave(BLOCK_SIZE, dim=1)  # (B, T, 1)
    torch.testing.assert_close(out, x + w * (block(x) - x), rtol=1e-5, atol=1e-5)


def test_token_routing_reads_each_tokens_own_state():
    model = make("token", capacity=1.0).train()
    router, block = model.routers["1"], model.blocks[1]
    assert router.block_size == 1
    x = torch.randn(2, T, 32)
    out, _ = router(block, x, T)
    w = torch.sigmoid(router.router(rms_norm(x)))  # (B, T, 1): token t's own residual stream
    torch.testing.assert_close(out, x + w * (block(x) - x), rtol=1e-5, atol=1e-5)


def test_token_routing_gathers_a_static_number_of_tokens():
    model = make("token", capacity=0.25).train()
    (calls,) = count_calls([model.blocks[1]])
    for seed in (1, 2):
        model(tokens(seed=seed))
    assert calls == [(2, T // 4, 32)] * 2  # the top 8 of 32 tokens of each sequence, whatever the data


def test_gradients_reach_the_router():
    model = make("block").train()
    idx = tokens()
    model.loss(idx, torch.roll(idx, -1, dims=1)).backward()
    for router in model.routers.values():
        assert router.router.weight.grad.abs().sum() > 0


def test_aux_loss_trains_only_the_predictor():
    model = make("block").train()
    model(tokens())
    aux = model.aux_loss
    assert aux.shape == () and torch.isfinite(aux) and aux > 0
    aux.backward()
    for name, p in model.named_parameters():
        if ".predictor." in name:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name  # the detached context: nothing else is shaped by the BCE


def test_dense_models_have_no_aux_loss_or_agreement():
    for granularity in ("none", "layer", "microbatch"):
        model = make(granularity).eval()
        model(tokens())
        assert torch.equal(model.aux_loss, torch.zeros(()))
        assert [int(v) for v in model.routing_agreement()] == [0, 0]


def test_masked_evaluation_matches_gathered_training():
    # The context of tile j (last token of tile j-1) is set to +-u, u the router's weight, with
    # the predictor a copy of the router: training's top-2 and evaluation's logit > 0 then pick
    # the same tiles, {1, 3} and {2, 3} (tile 0 scores 0), so the two paths must agree.
    model = make("block")
    router, block = model.routers["1"], model.blocks[1]
    with torch.no_grad():
        router.router.bias.zero_()
        router.predictor.weight.copy_(router.router.weight)
        router.predictor.bias.zero_()
    kept = [{1, 3}, {2, 3}]
    x = torch.randn(2, T, 32)
    for b, tiles in enumerate(kept):
        for j in (1, 2, 3):
            x[b, j * BLOCK_SIZE - 1] = router.router.weight[0].detach() * (1 if j in tiles else -1)
    with torch.no_grad():
        gathered, _ = router.train()(block, x, 2)
        model.reset_routing_stats()
        masked, _ = router.eval()(block, x, 2)
    torch.testing.assert_close(masked, gathered, rtol=1e-5, atol=1e-5)
    for b, tiles in enumerate(kept):  # kept tiles changed, the others passed through
        for j in range(4):
            tile = slice(j * BLOCK_SIZE, (j + 1) * BLOCK_SIZE)
            assert torch.equal(masked[b, tile], x[b, tile]) != (j in tiles)
    assert [int(v) for v in model.routing_agreement()] == [8, 8]


def test_shapes_do_not_depend_on_the_data():
    model = make("block").train()
    (calls,) = count_calls([model.blocks[1]])
    for capacity, k in ((0.5, 2), (0.25, 1), (0.6, 3), (1.0, 4)):
        model.set_capacity(capacity)
        calls.clear()
        for seed in (1, 2):
            assert model(tokens(seed=seed)).shape == (2, T, 64)
        assert calls == [(2, k * BLOCK_SIZE, 32)] * 2
    model.eval()
    calls.clear()
    with torch.no_grad():
        model(tokens())
    assert calls == [(2, T, 32)]  # evaluation: dense and masked
    assert units_selected(0.3, 10) == 3  # not 4 from the float product 3.0000000000000004


def test_mod_none_is_the_dense_model():
    torch.manual_seed(0)
    dense = GPT(tiny_cfg())
    torch.manual_seed(0)
    none = GPT(tiny_cfg(), mod_cfg("none"))
    assert dense.state_dict().keys() == none.state_dict().keys()
    assert torch.equal(dense(tokens()), none(tokens()))


def test_flops_and_active_params():
    cfg = tiny_cfg()
    dense = flops_per_token(cfg, T)
    assert flops_per_token(cfg, T, mod_cfg("none")) == dense
    without_routed = flops_per_token(tiny_cfg(n_layer=cfg.n_layer - len(ROUTED)), T)
    block = flops_per_token(cfg, T, mod_cfg("block", 0.5))
    assert without_routed < block < dense
    layer, microbatch = (flops_per_token(cfg, T, mod_cfg(g, 0.5)) for g in ("layer", "microbatch"))
    assert block < layer == microbatch < dense  # block attention share c^2 < c
    token = flops_per_token(cfg, T, mod_cfg("token", 0.5))
    assert token - block == pytest.approx(3 * 2 * len(ROUTED) * 2 * 32 * (1 - 1 / BLOCK_SIZE))  # a router per token
    for granularity in ("block", "token", "layer", "microbatch"):
        model = GPT(cfg, mod_cfg(granularity, 0.5))
        assert active_params(model) < param_count(model)
        model.set_capacity(1.0)
        assert active_params(model) == param_count(model)


def test_layer_routing_really_skips_layers():
    model = make("layer").train()
    calls = count_calls(model.blocks)
    for micro_step in range(4):
        before = [len(c) for c in calls]
        model(tokens(), micro_step=micro_step)
        assert sum(len(calls[i]) - before[i] for i in ROUTED) >= 1  # never all routed layers skipped
    assert [len(c) for c in calls] == [4, 2, 4, 2]  # capacity 0.5 of the micro-batches
    assert all(g.shape == () for g in model.gates.values()) and len(model.gates) == len(ROUTED)
    model.eval()
    model(tokens())
    assert [len(c) for c in calls] == [5, 3, 5, 3]  # evaluation runs every layer


def test_microbatch_routing_sends_a_static_share_deep():
    model = make("microbatch").train()
    calls = count_calls(model.blocks)
    model(tokens(batch=4))
    assert [c[0][0] for c in calls] == [4, 2, 4, 2]  # routed layers see ceil(0.5 * 4) sequences
    model.set_capacity(0.25)
    model(tokens(batch=4))
    assert [c[1][0] for c in calls] == [4, 1, 4, 1]
    model.eval()
    model(tokens(batch=4))
    assert [c[2][0] for c in calls] == [4, 4, 4, 4]  # evaluation: every sequence goes deep
