"""The optional architecture additions of model.py (value embeddings, embedding shortcut, hashed
bigram table, U-net skips) and Muon's momentum warm-up: each off is the model without it, each on
adds exactly its parameters, keeps evaluation causal, and starts where it says it starts."""
import dataclasses

import pytest
import torch

import optim
from model import GPT, bigram_rows, param_count
import config
from config import load_config

OPTIONS = {"value_embed": True, "x0_shortcut": True, "bigram_buckets": 37, "unet": True}


def cfg(**changes):
    return dataclasses.replace(load_config("configs/smoke.yaml", ["model.n_layer=4"]).model, **changes)


def build(seed=0, **changes):
    torch.manual_seed(seed)
    return GPT(cfg(**changes))


def tokens(batch=2, length=48, seed=1):
    return torch.randint(0, 1024, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_each_option_adds_exactly_its_parameters_and_leaves_the_others_as_they_were():
    off = build()
    c = off.cfg
    kv_dim = c.n_kv_head * (c.n_embd // c.n_head)
    extra = {"value_embed": {"value_embed": (c.vocab_size, kv_dim),  # layers 1 and 3 of 4
                             "blocks.1.attn.ve_gate": (), "blocks.3.attn.ve_gate": ()},
             "x0_shortcut": {f"blocks.{i}.x0_mix": (2,) for i in range(4)},
             "bigram_buckets": {"bigram": (37, c.n_embd), **{f"blocks.{i}.bigram_scale": () for i in range(4)}},
             "unet": {f"blocks.{i}.skip_weight": () for i in range(4)}}
    for option, value in OPTIONS.items():
        on = build(**{option: value})
        new = {k: tuple(v.shape) for k, v in on.state_dict().items() if k not in off.state_dict()}
        assert new == extra[option], option
        assert param_count(on) - param_count(off) == sum(torch.Size(s).numel() for s in new.values())
        for name, tensor in off.state_dict().items():  # the same initial weights for the same seed
            assert torch.equal(on.state_dict()[name], tensor), (option, name)


def randomised(model):
    """Every weight random, drawn in parameter order: zero-initialised projections hide leaks."""
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith(("x0_mix", "bigram_scale", "skip_weight", "ve_gate")) and name != "bigram":
                p.normal_(std=0.1)
    return model


@pytest.mark.parametrize("option", ["x0_shortcut", "bigram_buckets"])
def test_shortcut_and_bigram_start_as_the_model_without_them(option):
    off, on = randomised(build()), randomised(build(**{option: OPTIONS[option]}))
    idx = tokens()
    with torch.no_grad():
        assert torch.equal(on(idx), off(idx))  # lambda_0 = 0, a zero table: bitwise the same logits
    on.loss(idx, idx).backward()  # and the new parameters are on the gradient path
    new = [p for n, p in on.named_parameters() if n.endswith("x0_mix") or n == "bigram"]
    assert new and all(p.grad is not None and p.grad.abs().sum() > 0 for p in new)


@pytest.mark.parametrize("options", [{k: v} for k, v in OPTIONS.items()] + [OPTIONS])
def test_evaluation_stays_causal(options):
    model = build(**options).eval()
    torch.manual_seed(3)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    idx = tokens()
    for t in (0, 1, 20):
        changed = idx.clone()
        changed[:, t + 1:] = tokens(length=48 - t - 1, seed=t + 7)
        with torch.no_grad():
            a, b = model(idx), model(changed)
        assert torch.equal(a[:, : t + 1], b[:, : t + 1]), t
        assert not torch.equal(a[:, t + 1:], b[:, t + 1:])


def test_bigram_rows_hash_the_pair_and_reserve_row_zero_for_a_windows_first_token():
    idx = tokens(batch=4, length=64)
    rows = bigram_rows(idx, 37)
    assert rows.shape == idx.shape and rows.dtype == torch.int64
    assert (rows[:, 0] == 0).all() and (rows[:, 1:] >= 1).all() and (rows < 37).all()
    # A row depends on the pair alone: the same pair anywhere gets the same row.
    pairs = {}
    for (prev, cur), row in zip(torch.stack((idx[:, :-1], idx[:, 1:]), -1).view(-1, 2).tolist(), rows[:, 1:].flatten().tolist()):
        assert pairs.setdefault((prev, cur), row) == row
    assert len(set(rows[:, 1:].flatten().tolist())) > 30  # spread over the table


def test_unet_skips_feed_the_second_half_only():
    model = randomised(build(unet=True)).train()
    model.loss(tokens(), tokens(seed=2)).backward()
    grads = [model.blocks[i].skip_weight.grad for i in range(4)]
    assert grads[0] is None and grads[1] is None  # first half: outputs saved, no skip in
    assert all(g is not None and g.abs() > 0 for g in grads[2:])
    model.set_active([0, 1, 2], model.cfg.mlp_mult * model.cfg.n_embd)  # 3 active: 0 -> 2, 1 gets none
    for p in model.parameters():
        p.grad = None
    model.loss(tokens(), tokens(seed=2)).backward()
    assert [model.blocks[i].skip_weight.grad is not None for i in range(3)] == [False, False, True]


def test_value_embeddings_enter_every_other_layer_up_to_the_last():
    assert build(value_embed=True).ve_layers == {1, 3}
    assert GPT(cfg(value_embed=True, n_layer=5)).ve_layers == {0, 2, 4}
    model = randomised(build(value_embed=True))
    model.loss(tokens(), tokens(seed=2)).backward()
    assert model.value_embed.grad.abs().sum() > 0
    assert all(model.blocks[i].attn.ve_gate.grad.abs() > 0 for i in (1, 3))


@pytest.mark.parametrize("granularity", ["block", "layer", "microbatch"])
def test_options_run_under_every_routing(granularity):
    c = load_config("configs/smoke.yaml", ["model.n_layer=4", f"mod.granularity={granularity}", "mod.layers=[1,3]",
                                           "mod.block_size=16", *[f"model.{k}={str(v).lower()}" for k, v in OPTIONS.items()]])
    model = randomised(GPT(c.model, c.mod)).train()
    loss = model.loss(tokens(length=64), tokens(length=64, seed=2))
    loss.backward()
    assert torch.isfinite(loss) and model.value_embed.grad.abs().sum() > 0
    with torch.no_grad():
        assert model.eval()(tokens(length=64)).shape == (2, 64, c.model.vocab_size)


def test_new_parameters_are_optimised_once_each():
    c = load_config("configs/smoke.yaml", [f"model.{k}={str(v).lower()}" for k, v in OPTIONS.items()])
    model = GPT(c.model)
    matrices, adam = optim.param_groups(model, c.optim)
    grouped = [id(p) for p in matrices] + [id(p) for g in adam for p in g["params"]]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters())
    assert {id(model.wte.weight), id(model.value_embed), id(model.bigram)} == {id(p) for p in adam[0]["params"]}


def test_muon_momentum_warms_up_over_its_share_of_the_budget():
    o = load_config("configs/smoke.yaml", ["optim.muon_momentum=0.95", "optim.muon_momentum_start=0.85",
                                           "optim.muon_momentum_warmup=0.1"]).optim
    assert optim.muon_momentum(0.0, o) == pytest.approx(0.85)
    assert optim.muon_momentum(0.05, o) == pytest.approx(0.9)
    assert optim.muon_momentum(0.1, o) == optim.muon_momentum(0.7, o) == 0.95
    off = dataclasses.replace(o, muon_momentum_warmup=0.0)
    assert optim.muon_momentum(0.0, off) == 0.95


def test_options_at_their_neutral_values_keep_earlier_recipes():
    flat = config.flatten(dataclasses.asdict(load_config("configs/smoke.yaml")))
    assert set(config.RECIPE_NEUTRAL) <= set(flat)
    without = {k: v for k, v in flat.items() if k not in config.RECIPE_NEUTRAL}
    assert config.recipe(flat, "data") == config.recipe(without, "data")
    assert config.recipe({**flat, "model.unet": True}, "data") != config.recipe(without, "data")
