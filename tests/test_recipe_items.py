"""Three items of the parameter-golf 10-minute records (April 2026): parallel residuals in the last
blocks (model.parallel_layers), the LeakyReLU(0.5)^2 MLP (model.mlp=leaky_relu2) and an EMA of the
weights for evaluation (optim.ema). Each off is the default model and run; each on computes its
reference formula, stays causal, and (the EMA) survives checkpoints and depth growth by copying."""
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import config
import ledger
import train
from config import ConfigError, load_config
from kernels.reference import head_nll, rms_norm
from model import GPT, flops_per_token, param_count

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"


def model_cfg(**changes):
    return dataclasses.replace(load_config(SMOKE, ["model.n_layer=4"]).model, **changes)


def randomised(model, seed=3):
    """Every weight random: zero-initialised projections would hide a branch."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.1)
    return model


def build(seed=0, **changes):
    torch.manual_seed(seed)
    return GPT(model_cfg(**changes))


def tokens(batch=2, length=48, seed=1):
    return torch.randint(0, 1024, (batch, length), generator=torch.Generator().manual_seed(seed))


def block_reference(block, x, parallel):
    """A block by hand: attention then MLP on the updated stream, or both on the same normed input."""
    h = rms_norm(x)
    attn = block.attn_scale * block.attn(h)
    if parallel:
        return x + attn + block.mlp_scale * block.mlp(h)
    x = x + attn
    return x + block.mlp_scale * block.mlp(rms_norm(x))


def hidden_reference(model, idx, parallel_blocks):
    x = rms_norm(model.wte(idx))
    for i in model.active:
        x = block_reference(model.blocks[i], x, i in parallel_blocks)
    return rms_norm(x)


# -- off: the default ---------------------------------------------------------------------------

def test_each_key_off_is_the_default_model():
    base = load_config(SMOKE).model
    assert (base.parallel_layers, base.mlp, load_config(SMOKE).optim.ema) == (0, "relu2", 0.0)
    model = randomised(build())
    assert not any(b.parallel for b in model.blocks)
    idx, targets = tokens(), tokens(seed=2)
    want = head_nll(hidden_reference(model, idx, ()).flatten(0, 1), model.wte.weight, targets.flatten(), base.logit_softcap)
    assert torch.equal(model.loss(idx, targets, reduction="none"), want)  # sequential blocks, ReLU^2: to the bit
    for changes in ({"parallel_layers": 2}, {"mlp": "leaky_relu2"}):  # no parameter added, the same initial weights
        on = build(**changes)
        assert param_count(on) == param_count(build())
        assert all(torch.equal(a, b) for a, b in zip(on.state_dict().values(), build().state_dict().values()))
        assert flops_per_token(on.cfg, 64) == flops_per_token(model.cfg, 64)  # the same matmuls
        with torch.no_grad():
            assert not torch.equal(randomised(on).loss(idx, targets), model.loss(idx, targets))


def test_keys_at_their_defaults_keep_the_recipe_and_change_it_when_on():
    flat = config.flatten(dataclasses.asdict(load_config(SMOKE)))
    new = ("model.parallel_layers", "optim.ema")
    without = {k: v for k, v in flat.items() if k not in new}
    assert config.recipe(flat, "data") == config.recipe(without, "data")  # earlier rows keep their recipe
    for key, value in {"model.parallel_layers": 1, "model.mlp": "leaky_relu2", "optim.ema": 0.99}.items():
        assert key not in config.RECIPE_IGNORED
        assert config.recipe({**flat, key: value}, "data") != config.recipe(flat, "data"), key


@pytest.mark.parametrize("override, message", [
    ("model.parallel_layers=3", "model.parallel_layers: expected 0..2 (at most model.n_layer), got 3"),
    ("model.parallel_layers=-1", "model.parallel_layers: expected 0..2 (at most model.n_layer), got -1"),
    ("model.mlp=gelu", "model.mlp: expected one of relu2 | leaky_relu2 | swiglu, got 'gelu'"),
    ("optim.ema=1", "optim.ema: expected in [0, 1), got 1.0"),
    ("optim.ema=-0.5", "optim.ema: expected in [0, 1), got -0.5"),
])
def test_config_errors_name_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(SMOKE, [override])
    assert message in str(e.value)


# -- model.parallel_layers ----------------------------------------------------------------------

def test_a_parallel_block_feeds_attention_and_mlp_the_same_input():
    block = randomised(build()).blocks[0]
    block.attn_scale.fill_(0.7)
    block.mlp_scale.fill_(1.3)
    x = torch.randn(2, 16, block.attn.c_q.in_features, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        sequential = block(x)
        assert torch.equal(sequential, block_reference(block, x, parallel=False))
        block.parallel = True
        assert torch.equal(block(x), block_reference(block, x, parallel=True))
        assert not torch.equal(block(x), sequential)


def test_the_last_active_blocks_are_parallel_and_follow_set_active():
    model = randomised(build(parallel_layers=2))
    full = model.cfg.mlp_mult * model.cfg.n_embd
    idx = tokens()
    for active, parallel in [((0, 1, 2, 3), {2, 3}), ((0, 1, 2), {1, 2}), ((0,), {0}), ((0, 2), {0, 2})]:
        model.set_active(active, full)
        assert {i for i, b in enumerate(model.blocks) if b.parallel} == parallel, active
        with torch.no_grad():
            assert torch.equal(model.hidden(idx), hidden_reference(model, idx, parallel)), active


@pytest.mark.parametrize("routing", [(), ("mod.granularity=block", "mod.layers=[1,3]", "mod.block_size=16"),
                                     ("mod.granularity=token", "mod.layers=[3]")])
def test_parallel_blocks_stay_causal(routing):
    c = load_config(SMOKE, ["model.n_layer=4", "model.parallel_layers=3", *routing])
    model = randomised(GPT(c.model, c.mod)).eval()
    assert [b.parallel for b in model.blocks] == [False, True, True, True]
    idx = tokens(length=64)
    for t in (0, 20, 40):
        changed = idx.clone()
        changed[:, t + 1:] = tokens(length=64 - t - 1, seed=t + 7)
        with torch.no_grad():
            a, b = model(idx), model(changed)
        assert torch.equal(a[:, : t + 1], b[:, : t + 1]), t
        assert not torch.equal(a[:, t + 1:], b[:, t + 1:])


# -- model.mlp=leaky_relu2 -----------------------------------------------------------------------

def test_leaky_relu2_mlp_is_the_squared_leaky_relu():
    mlp = randomised(build(mlp="leaky_relu2")).blocks[0].mlp
    x = torch.randn(2, 16, mlp.c_fc.in_features, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        for hidden in (mlp.c_proj.in_features, 64):  # the full width and a stage's narrower slice
            mlp.hidden = hidden
            h = x @ mlp.c_fc.weight[:hidden].T
            want = (torch.where(h > 0, h, 0.5 * h) ** 2) @ mlp.c_proj.weight[:, :hidden].T
            assert torch.equal(mlp(x), want)
            assert (h < 0).any() and (h > 0).any()


@pytest.mark.parametrize("mlp, flows", [("relu2", False), ("leaky_relu2", True)])
def test_gradient_flows_through_negative_pre_activations_only_with_leaky_relu2(mlp, flows):
    layer = randomised(build(mlp=mlp)).blocks[0].mlp
    with torch.no_grad():
        layer.c_fc.weight.abs_().neg_()  # positive inputs: every pre-activation negative
    x = torch.rand(2, 16, layer.c_fc.in_features, generator=torch.Generator().manual_seed(5)) + 0.1
    layer(x).sum().backward()
    assert (layer.c_fc.weight.grad.abs() > 0).all() if flows else (layer.c_fc.weight.grad == 0).all()


# -- optim.ema ------------------------------------------------------------------------------------

def trainer(tmp_path, *extra):
    return train.Trainer(load_config(SMOKE, [f"data.path={ROOT / 'data' / 'builtin'}", f"run.out_dir={tmp_path / 'runs'}",
                                             f"ledger.path={tmp_path / 'ledger.csv'}", *extra]))


def step(t, progress=0.0):
    t.step(progress)
    t.inputs = t.fetch()  # as the loop does


def ema_by_name(t):
    return {name: t.ema[t.masters.get(p, p)].clone() for name, p in t.model.named_parameters()}


@pytest.mark.parametrize("precision", [(), ("device.dtype=bfloat16", "device.bf16=weights")])
def test_ema_follows_its_recurrence_on_the_weights_the_optimizers_update(tmp_path, builtin_1024, precision):
    d = 0.75
    t = trainer(tmp_path, f"optim.ema={d}", *precision)
    p = t.model.blocks[0].attn.c_q.weight  # Muon-updated
    updated = t.masters.get(p, p)
    assert updated.dtype == torch.float32 and (p in t.masters) == bool(precision)
    w = [updated.detach().clone()]
    for _ in range(2):
        step(t)
        w.append(updated.detach().clone())
    assert not torch.equal(w[1], w[2])
    torch.testing.assert_close(t.ema[updated], d * (d * w[0] + (1 - d) * w[1]) + (1 - d) * w[2], rtol=0, atol=1e-6)
    assert not torch.equal(t.ema[updated], w[2])
    t.loader.close()


def test_training_with_an_ema_is_the_run_without_it(tmp_path, builtin_1024):
    """The EMA is only read at evaluation: the trajectory is the default's to the bit; off, there is none."""
    off, on = trainer(tmp_path), trainer(tmp_path, "optim.ema=0.9")
    assert off.ema == {} and off.state()["trained"] == {}
    for _ in range(3):
        assert torch.equal(off.step(0.1), on.step(0.1))
        off.inputs, on.inputs = off.fetch(), on.fetch()
    for a, b in zip(off.model.parameters(), on.model.parameters()):
        assert torch.equal(a, b)
    off.loader.close()
    on.loader.close()


def test_evaluation_and_load_for_eval_use_the_ema(tmp_path, builtin_1024):
    t = trainer(tmp_path, "optim.ema=0.5")
    for _ in range(3):
        step(t)
    weights = [p.detach().clone() for p in t.model.parameters()]
    ema_loss = t.evaluate(4096)[0]
    assert all(torch.equal(p, w) for p, w in zip(t.model.parameters(), weights))  # swapped back
    path = tmp_path / "ema.pt"
    train.save_checkpoint(path, t.state())
    t.loader.close()

    scored = train.load_for_eval(path, "cpu")
    ema = ema_by_name(t)
    assert all(torch.equal(p, ema[name]) for name, p in scored.named_parameters())
    plain = trainer(tmp_path, f"checkpoint.resume={path}")  # optim.ema = 0: training goes on from the weights
    assert all(torch.equal(p, w) for p, w in zip(plain.model.parameters(), weights))
    assert plain.evaluate(4096)[0] != ema_loss  # which it evaluates as they are
    plain.model.load_state_dict(scored.state_dict())
    assert plain.evaluate(4096)[0] == ema_loss
    plain.loader.close()


def test_a_resumed_run_continues_the_same_ema(tmp_path, builtin_1024):
    common = ("optim.ema=0.8", "run.profile_steps=0")
    whole, first = tmp_path / "whole.pt", tmp_path / "first.pt"
    trainer(tmp_path, *common, "budget.max_steps=4", f"checkpoint.path={whole}").train()
    trainer(tmp_path, *common, "budget.max_steps=2", f"checkpoint.path={first}").train()
    resumed = tmp_path / "resumed.pt"
    trainer(tmp_path, *common, "budget.max_steps=4", f"checkpoint.resume={first}", f"checkpoint.path={resumed}").train()
    a, b, half = (train.load_checkpoint(path) for path in (whole, resumed, first))
    assert a["step"] == b["step"] == 4 and half["step"] == 2
    assert a["model"].keys() == a["trained"].keys() and half["trained"]
    for name in a["model"]:  # the average (what load_for_eval scores) and the weights
        assert torch.equal(a["model"][name], b["model"][name]), name
        assert torch.equal(a["trained"][name], b["trained"][name]), name
    assert any(not torch.equal(a["model"][n], a["trained"][n]) for n in a["model"])
    rows = ledger.read(tmp_path / "ledger.csv")
    assert rows[0]["val_bpb"] == rows[2]["val_bpb"] != ""


def test_copy_growth_copies_the_ema_with_the_block(tmp_path, builtin_1024):
    t = trainer(tmp_path, "optim.ema=0.9", "model.n_layer=4", "schedule.grow_init=copy",
                "schedule.stages=[{at: 0, depth: 2}, {at: 0.5, depth: 4}]")
    for _ in range(2):
        step(t)
    before = ema_by_name(t)
    assert not torch.equal(before["blocks.0.attn.c_q.weight"], before["blocks.2.attn.c_q.weight"])
    t.enter_stage(1)
    after = ema_by_name(t)
    for name, value in before.items():
        if name.startswith(("blocks.2.", "blocks.3.")):  # the copies of blocks 0 and 1
            source = name.replace("blocks.2.", "blocks.0.").replace("blocks.3.", "blocks.1.")
            assert torch.equal(after[name], before[source]), name
        else:
            assert torch.equal(after[name], value), name
    t.loader.close()
