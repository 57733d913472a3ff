"""The competition lineage's optimizer and schedule items (FrontierForge K82s4, recipes/K82s4/train.py,
github marker2601/trainium-simulator) as optim and schedule keys: NorMuon (optim.normuon_beta2), cautious
Muon weight decay (optim.muon_wd_cautious), the MLP output projections' Muon LR (optim.mlp_proj_lr), the
untied head's own decay (optim.head_wd), the stepped warm-down (optim.warmdown_steps), a stage's LR
factor (schedule stage `lr`, the batch ramp's 0.35 / 0.6), and the warm-up and momentum ramp counted in steps and
full batches as the lineage counts them (optim.warmup_steps, optim.muon_momentum_warmup_steps). Each off is the optimizer as before, bitwise;
each on computes its formula by hand; every parameter is in one group; a resumed run is the same run; XLA
compiles no more graphs. None changes the model (its forward, FLOPs per token or parameters): causality,
flops_per_token, active_params and load_for_eval are the model's, untouched."""
import dataclasses
from pathlib import Path

import pytest
import torch

import clock
import config
import ledger
import optim
import train
from config import ConfigError, load_config
from model import GPT
from test_backends import XLA_GRAPHS, run, smoke_args
from test_clock import calibration

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"
CPU = ROOT / "configs" / "cpu_windows256.yaml"
# Every key on, at the lineage's values (the decays' on an untied head), on a 4-layer smoke shape.
ALL_ON = ("optim.normuon_beta2=0.9", "optim.muon_wd=0.02", "optim.muon_wd_cautious=true", "optim.mlp_proj_lr=0.8",
          "model.tie_embeddings=false", "optim.weight_decay=0.001", "optim.head_wd=0.01", "optim.warmdown=0.7",
          "optim.warmdown_steps=19")
KEYS = ("optim.normuon_beta2", "optim.muon_wd_cautious", "optim.mlp_proj_lr", "optim.head_wd", "optim.warmdown_steps")
# K82s4's batch ramp on configs/cpu_windows256.yaml (8,192 tokens a step): the full batch for 20 steps, a quarter at LR x 0.35
# until 6 % of the budget, a half at x 0.6 until 20 %, then the full batch.
RAMP = ("schedule.stages=[{at: 0}, {at: 163840 tokens, batch_tokens: 2048, lr: 0.35}, "
        "{at: 0.06, batch_tokens: 4096, lr: 0.6}, {at: 0.2, batch_tokens: 8192}]")


def cfg_with(*overrides):
    return load_config(SMOKE, ["model.n_layer=4", *overrides])


def random_model(c, seed=0):
    torch.manual_seed(seed)
    model = GPT(c.model, c.mod)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.3)
    return model


SHAPES = [(16, 64), (64, 16), (16, 16), (8, 16), (16, 64), (24, 8), (16, 16)]  # wide, tall, square, in shared batches


def muon_run(shapes, steps=3, seed=3, **settings):
    """Muon on random matrices for `steps` steps of random gradients -> (initial weights, the gradients, the
    parameters after, the optimizer)."""
    g = torch.Generator().manual_seed(seed)
    w0 = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]
    params = [torch.nn.Parameter(w.clone()) for w in w0]
    opt = optim.Muon(params, **{**dict(lr=0.02, momentum=0.9, ns_steps=5), **settings})
    for step in grads:
        for p, grad in zip(params, step):
            p.grad = grad.clone()
        opt.step()
    return w0, grads, params, opt


# -- off: the optimizer and recipe as before -----------------------------------------------------

def test_each_key_at_its_base_value_is_the_recipe_as_before():
    flat = config.flatten(dataclasses.asdict(load_config(SMOKE)))
    assert all(k in config.RECIPE_NEUTRAL and k not in config.RECIPE_IGNORED for k in KEYS)
    without = {k: v for k, v in flat.items() if k not in KEYS}
    assert config.recipe(flat, "data") == config.recipe(without, "data")  # earlier rows keep their recipe
    for override in ALL_ON:
        key, value = override.split("=")
        on = config.flatten(dataclasses.asdict(cfg_with("model.tie_embeddings=false", "optim.muon_wd=0.02", override)))
        assert config.recipe(on, "data") != config.recipe({**on, key: flat[key]}, "data"), key
    # What a step learns, not what it computes: the LR schedule and the head's decay. The others add operations
    # (NorMuon, the mask) or split Newton-Schulz's batches (the projections' own group).
    assert {k for k in KEYS if k in clock.COST_IGNORED} == {"optim.head_wd", "optim.warmdown_steps"}
    # A stage's lr is not in its calibration key (its shape), and a schedule without lr resolves as before.
    ramp, k60 = (config.resolve_stages(load_config(CPU, [stages])) for stages in (RAMP, RAMP.replace(", lr: 0.35", "")
                                                                                  .replace(", lr: 0.6", "")))
    assert [s.lr for s in k60] == [1.0, 0.5, 0.5 ** 0.5, 1.0]  # the square-root rule (K60's 0.5 / 0.7071)
    assert [clock.stage_key(flat, "data", s) for s in ramp] == [clock.stage_key(flat, "data", s) for s in k60]
    assert config.resolve_stages(load_config(SMOKE))[0].lr == 1.0


def todays_muon_step(params, grads, state, lr, momentum, weight_decay):
    """Muon's step before these keys (optim.py at f6caec0), restated: the reference an off step must equal."""
    same_shape = {}
    for p, grad in zip(params, grads):
        buf = state.setdefault(p, torch.zeros_like(p))
        buf.mul_(momentum).add_(grad)
        update = grad.add(buf, alpha=momentum)
        tall = update.size(0) > update.size(1)
        same_shape.setdefault(tuple(sorted(update.shape)), []).append((p, tall, update.mT if tall else update))
    for batch in same_shape.values():
        orthogonal = optim.newton_schulz(torch.stack([wide for _, _, wide in batch]), 5)
        for (p, tall, _), update in zip(batch, orthogonal):
            p.mul_(1 - lr * weight_decay)
            p.add_(update.mT if tall else update, alpha=-lr * max(1.0, p.size(0) / p.size(1)) ** 0.5)


def test_off_is_todays_optimizer_bitwise():
    c = cfg_with("model.tie_embeddings=false", "optim.muon_wd=0.1", "optim.weight_decay=0.1")
    model = random_model(c)
    muon, adam = optim.make_optimizers(model, c.optim, {})
    matrices, adam_groups = optim.param_groups(model, c.optim)
    assert len(muon.param_groups) == 1 and muon.param_groups[0]["params"] == matrices  # one group, the same order
    assert [(g["lr"], g["weight_decay"]) for g in adam.param_groups] == [(c.optim.embed_lr, 0.1), (c.optim.scalar_lr, 0.0),
                                                                          (c.optim.head_lr, 0.1)]
    assert [g["params"] for g in adam.param_groups] == [g["params"] for g in adam_groups]
    with torch.no_grad():
        reference = [p.detach().clone() for p in matrices]
    state, g = {}, torch.Generator().manual_seed(5)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=g) for p in matrices]
        for p, grad in zip(matrices, grads):
            p.grad = grad.clone()
        muon.step()
        todays_muon_step(reference, grads, state, c.optim.muon_lr, c.optim.muon_momentum, 0.1)
    assert all(torch.equal(p, want) for p, want in zip(matrices, reference))
    o = c.optim
    for p in [i / 64 for i in range(65)]:  # warmdown_steps 0: the linear warm-down, exactly
        want = o.lr_floor + (1 - o.lr_floor) * (1 - p) / o.warmdown if p > 1 - o.warmdown else 1.0
        assert optim.lr_scale(p, o) == want


# -- on: each formula by hand --------------------------------------------------------------------

def by_hand(w0, grads, lr=0.02, mu=0.9, wd=0.0, cautious=False, beta2=0.0):
    """Muon with NorMuon and cautious decay on each matrix alone, in its own orientation: the update X =
    NS(g + mu buf); NorMuon's neurons are the rows when rows >= columns, else the columns; w <- w - lr wd w
    [X w >= 0] - lr aspect X. -> (weights, NorMuon's second moments)."""
    out, moments = [], []
    for n, w in enumerate(w0):
        w, buf, s = w.clone(), torch.zeros_like(w), None
        rows, cols = w.shape
        for step in grads:
            buf = mu * buf + step[n]
            x = optim.newton_schulz(step[n] + mu * buf, 5)
            if beta2:
                per_row = rows >= cols
                v = (x * x).mean(dim=1 if per_row else 0)
                s = (1 - beta2) * v if s is None else beta2 * s + (1 - beta2) * v
                d = s.clamp_min(1e-10).sqrt()
                y = x / (d[:, None] if per_row else d[None, :])
                x = y * (x.norm() / y.norm())
            decay = w * ((x * w >= 0) if cautious else 1.0)
            w = w - lr * wd * decay - lr * max(1.0, rows / cols) ** 0.5 * x
        out.append(w)
        moments.append(s)
    return out, moments


@pytest.mark.parametrize("settings", [dict(beta2=0.9), dict(wd=0.1, cautious=True), dict(beta2=0.5, wd=0.1, cautious=True)],
                         ids=["normuon", "cautious", "both"])
def test_normuon_and_cautious_decay_by_hand_per_matrix(settings):
    """Same-shape matrices are batched, a tall one as its transpose: each still gets its own axis."""
    w0, grads, params, opt = muon_run(SHAPES, weight_decay=settings.get("wd", 0.0), cautious_wd=settings.get("cautious", False),
                                      normuon_beta2=settings.get("beta2", 0.0))
    want, moments = by_hand(w0, grads, **settings)
    for p, w, s in zip(params, want, moments):
        torch.testing.assert_close(p.detach(), w, rtol=0, atol=2e-6)
        if s is not None:  # one per neuron of the larger side (rows of a square matrix)
            assert opt.state[p]["normuon_buffer"].shape == (max(p.shape),)
            torch.testing.assert_close(opt.state[p]["normuon_buffer"], s, rtol=1e-5, atol=1e-9)
    plain, _ = by_hand(w0, grads, **{**settings, "beta2": 0.0, "cautious": False})
    assert all((p - w).abs().max() > 1e-4 for p, w in zip(params, plain))  # the items change every matrix's step
    if "beta2" in settings:  # and the axis matters: the other one's stats give another step
        x = optim.newton_schulz(grads[0][1] * 1.9, 5)  # the tall (64, 16) matrix's first update
        by_rows, by_cols = (x / (x * x).mean(dim=d, keepdim=True).sqrt() for d in (1, 0))
        assert not torch.allclose(by_rows / by_rows.norm(), by_cols / by_cols.norm(), atol=1e-3)


def test_cautious_decay_skips_where_update_and_weight_disagree_and_is_lr_coupled_as_muon_wd():
    w0, grads, params, _ = muon_run([(16, 64), (64, 16)], steps=1, lr=0.05, weight_decay=0.2, cautious_wd=True)
    for p, w, grad in zip(params, w0, grads[0]):
        x = optim.newton_schulz(grad * 1.9, 5)
        mask = x * w >= 0
        assert 0.3 < mask.float().mean() < 0.7
        # Decay lr * muon_wd (the LR without the tall matrices' aspect factor, as optim.muon_wd's), where signs agree.
        want = w - 0.05 * 0.2 * w * mask - 0.05 * max(1.0, w.size(0) / w.size(1)) ** 0.5 * x
        torch.testing.assert_close(p.detach(), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("mu", [0.85, 0.95])
@pytest.mark.parametrize("coefficients", ["quintic", "polar_express"])
def test_momentum_as_an_ema_orthogonalises_to_the_same_update(mu, coefficients):
    """AION: buf <- mu buf + g, update g + mu buf. K82s4: M <- mu M + (1 - mu) g, update (1 - mu) g + mu M:
    (1 - mu) times AION's, which Newton-Schulz's normalisation removes."""
    g = torch.Generator().manual_seed(11)
    buf, ema = torch.zeros(32, 96), torch.zeros(32, 96)
    for _ in range(6):
        grad = torch.randn(32, 96, generator=g)
        buf = mu * buf + grad
        ema = mu * ema + (1 - mu) * grad
        aion, lineage = grad + mu * buf, (1 - mu) * grad + mu * ema
        torch.testing.assert_close(lineage, (1 - mu) * aion)
        torch.testing.assert_close(optim.newton_schulz(lineage, 5, coefficients=coefficients),
                                   optim.newton_schulz(aion, 5, coefficients=coefficients), rtol=0, atol=1e-5)


def test_mlp_projections_get_their_own_muon_group_and_every_parameter_one_group():
    c = cfg_with("model.tie_embeddings=false", "model.value_embed=true", "model.bigram_buckets=64",
                 "model.x0_shortcut=true", "optim.mlp_proj_lr=0.8")
    model = random_model(c)
    for masters in ({}, {p: p.detach().float().clone() for p in model.parameters()}):  # bf16 weights: the masters
        muon, adam = optim.make_optimizers(model, c.optim, masters)
        grouped = [id(p) for opt in (muon, adam) for g in opt.param_groups for p in g["params"]]
        assert sorted(grouped) == sorted(id(masters.get(p, p)) for p in model.parameters())  # each exactly once
        rest, projections = muon.param_groups
        assert projections["params"] == [masters.get(b.mlp.c_proj.weight, b.mlp.c_proj.weight) for b in model.blocks]
        assert projections["lr"] == projections["peak_lr"] == c.optim.muon_lr * 0.8 and rest["lr"] == c.optim.muon_lr
        assert all(p.dim() == 2 for p in rest["params"]) and len(rest["params"]) == 4 * 4  # c_q, c_kv, c_proj, c_fc
    # A step with the projections' group: each matrix as in a group of its own (by hand), at its own LR.
    projection = model.blocks[0].mlp.c_proj.weight
    w0 = projection.detach().clone()
    muon, _ = optim.make_optimizers(model, c.optim, {})
    grad = torch.randn(projection.shape, generator=torch.Generator().manual_seed(2))
    for p in model.parameters():
        p.grad = grad.clone() if p is projection else None
    muon.step()
    want = w0 - c.optim.muon_lr * 0.8 * optim.newton_schulz(grad * (1 + c.optim.muon_momentum), 5)
    torch.testing.assert_close(projection.detach(), want, rtol=0, atol=1e-6)


def test_the_head_decays_by_head_wd_and_the_tables_by_weight_decay():
    for head_wd, want in ((-1.0, 0.001), (0.01, 0.01), (0.0, 0.0)):
        c = cfg_with("model.tie_embeddings=false", "model.value_embed=true", "optim.weight_decay=0.001",
                     f"optim.head_wd={head_wd}")
        model = random_model(c)
        _, adam = optim.make_optimizers(model, c.optim, {})
        tables, _, head = adam.param_groups
        assert (tables["weight_decay"], head["weight_decay"]) == (0.001, want)
        assert head["params"] == [model.lm_head.weight] and any(p is model.value_embed for p in tables["params"])
        # With a zero gradient AdamW's moments stay 0: the step is the decay alone, w * (1 - lr * wd).
        before = {p: p.detach().clone() for g in (tables, head) for p in g["params"]}
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        adam.step()
        for group in (tables, head):
            for p in group["params"]:
                torch.testing.assert_close(p.detach(), before[p] * (1 - group["lr"] * group["weight_decay"]), rtol=0, atol=0)


def test_stepped_warmdown_is_k82s4s_cool_down():
    """Spec section 13: levels 19 .. 1 (lr 0.95 .. 0.05) starting at these charged seconds of 1795."""
    starts = [538.5, 604.6, 670.8, 736.9, 803.0, 869.2, 935.3, 1001.4, 1067.6, 1133.7, 1199.8, 1266.0, 1332.1, 1398.2,
              1464.3, 1530.5, 1596.6, 1662.7, 1728.9]
    o = cfg_with("optim.warmdown=0.7", "optim.warmdown_steps=19").optim
    assert o.lr_floor == 0.0
    for level, seconds in zip(range(19, 0, -1), starts):
        p = 0.3 + 0.7 * (19 - level) / 19
        assert abs(p * 1795 - seconds) < 0.06  # the spec's figures, rounded to 0.1 s
        assert optim.lr_scale(p + 1e-9, o) == level / 20
        assert optim.lr_scale(p - 1e-9, o) == (level + 1) / 20  # 1.0 before the first drop
    grid = [optim.lr_scale(i / 10000, o) for i in range(10001)]
    assert min(grid) == grid[-1] == 0.05 and sorted(set(grid)) == [level / 20 for level in range(1, 21)]  # never 0
    o = cfg_with("optim.warmdown=0.5", "optim.warmdown_steps=3", "optim.lr_floor=0.1").optim
    for p, level in ((0.5, None), (0.51, 3), (0.66, 3), (0.67, 2), (0.83, 2), (0.84, 1), (1.0, 1)):
        assert optim.lr_scale(p, o) == (1.0 if level is None else 0.1 + 0.9 * level / 4), p


# -- the batch ramp's LR factors -----------------------------------------------------------------

def test_a_stage_sets_its_lr_factor_or_takes_the_square_root_rule():
    stages = config.resolve_stages(load_config(CPU, [RAMP]))
    assert [(s.at, s.at_tokens, s.batch_tokens, s.lr) for s in stages] == [
        (0.0, 0, 8192, 1.0), (0.0, 163840, 2048, 0.35), (0.06, 0, 4096, 0.6), (0.2, 0, 8192, 1.0)]  # lr is not carried over
    kept = config.resolve_stages(load_config(CPU, ["schedule.stages=[{at: 0, depth: 2, batch_tokens: 4096, lr: 0.6}, {at: 0.5, depth: 4}]"]))
    assert [s.lr for s in kept] == [0.6, 0.5 ** 0.5]  # a stage without lr: its batch's square-root rule


def test_the_stage_factor_reaches_every_groups_lr(tmp_path, builtin_1024):
    stages = "schedule.stages=[{at: 0, batch_tokens: 256, lr: 0.35}, {at: 0.5, batch_tokens: 512}]"
    t = train.Trainer(load_config(SMOKE, smoke_args(tmp_path, stages, "model.tie_embeddings=false",
                                                    "optim.mlp_proj_lr=0.8")[2:]))
    groups = [g for opt in t.optimizers for g in opt.param_groups]
    assert len(groups) == 5  # Muon's two, AdamW's tables, scalars and head
    t.step(0.0)
    assert all(g["lr"] == g["peak_lr"] * 0.35 for g in groups)
    t.enter_stage(1)
    t.step(0.5)
    assert all(g["lr"] == g["peak_lr"] for g in groups)
    t.loader.close()


STEP_RAMPS = ("optim.warmup_steps", "optim.muon_momentum_warmup_steps")


def test_the_warm_up_counts_steps_and_the_momentum_ramp_full_batches_as_k82s4s():
    """K82s4: lrm = (step + 1) / 20 for its steps 0-19, then its schedule; momentum 0.85 -> 0.95 over 300 full
    batches (micro-batches done / per step): a quarter-batch step counts a quarter."""
    o = cfg_with("optim.warmup=0", "optim.warmup_steps=20", "optim.muon_momentum_warmup=0",
                 "optim.muon_momentum_warmup_steps=300", "optim.warmdown=0.7", "optim.warmdown_steps=19").optim
    assert [optim.lr_scale(0.0, o, step) for step in (0, 1, 9, 19)] == [0.05, 0.1, 0.5, 1.0]
    assert optim.lr_scale(0.2, o, 20) == 1.0 and optim.lr_scale(0.5, o, 20) == 0.7  # then by progress: level 19 - 5
    assert [optim.muon_momentum(0.9, o, full) for full in (0, 150, 300, 600)] == pytest.approx([0.85, 0.9, 0.95, 0.95])
    flat = config.flatten(dataclasses.asdict(load_config(SMOKE)))
    assert all(k in config.RECIPE_NEUTRAL and k in clock.COST_IGNORED and flat[k] == 0 for k in STEP_RAMPS)
    assert config.recipe(flat, "data") == config.recipe({k: v for k, v in flat.items() if k not in STEP_RAMPS}, "data")


def test_the_run_takes_its_lr_by_step_and_its_momentum_by_full_batches(tmp_path, builtin_1024):
    """A quarter-batch stage: 4 steps are one full batch of the momentum ramp; the warm-up is 4 steps."""
    stages = "schedule.stages=[{at: 0, batch_tokens: 128}, {at: 0.5}]"
    t = train.Trainer(load_config(SMOKE, smoke_args(tmp_path, stages, "optim.warmup_steps=4", "optim.warmup=0",
                                                    "optim.muon_momentum_warmup_steps=2")[2:]))
    muon, lrs = t.optimizers[0].param_groups[0], []
    for _ in range(4):
        t.step(0.0)
        t.timeline[-1][2] += 1  # the loop's count of the stage's steps (Trainer.tokens)
        lrs.append(muon["lr"] / muon["peak_lr"])
    # the warm-up times the quarter batch's LR factor (0.5, the square-root rule); the last step's momentum after
    # 3 quarter steps, 0.75 of a full batch, of a ramp of 2
    assert lrs == [0.125, 0.25, 0.375, 0.5] and t.tokens == 512
    assert muon["momentum"] == pytest.approx(0.85 + 0.1 * 0.75 / 2)
    t.loader.close()


# -- state and graphs ----------------------------------------------------------------------------

def whole_and_resumed(tmp_path, on, costs_ms):
    """The smoke config with `on`, 1 s under a calibration of `costs_ms` a stage: whole, and stopped after 7 steps then
    resumed -> (the ledger's rows: whole, first part, resumed; the whole run's and the resumed run's checkpoints),
    both runs' val_bpb checked equal."""
    on = (*on, "run.profile_steps=0", "eval.tokens=2048")
    path = calibration(tmp_path, costs_ms, on)
    common = ["--config", str(SMOKE), f"data.path={ROOT / 'data' / 'builtin'}", f"ledger.path={tmp_path / 'l.csv'}",
              f"run.out_dir={tmp_path / 'runs'}", *on, "budget.clock=calibrated", f"budget.calibration={path}",
              "budget.seconds=1"]
    whole, first, resumed = tmp_path / "whole.pt", tmp_path / "first.pt", tmp_path / "resumed.pt"
    assert train.main([*common, "budget.max_steps=0", f"checkpoint.path={whole}"]) == 0
    assert train.main([*common, "budget.max_steps=7", f"checkpoint.path={first}"]) == 0
    assert train.main([*common, "budget.max_steps=0", f"checkpoint.resume={first}", f"checkpoint.path={resumed}"]) == 0
    rows = ledger.read(tmp_path / "l.csv")
    assert rows[0]["val_bpb"] == rows[2]["val_bpb"] != ""
    return rows, train.load_checkpoint(whole), train.load_checkpoint(resumed)


def test_resume_with_every_key_on_is_the_uninterrupted_run(tmp_path, builtin_1024):
    """Calibrated clock (the steps and their progress fixed): the ramp's stages by tokens, then by time, the stepped
    warm-down inside the budget, NorMuon's moments and both Muon groups through the checkpoint."""
    ramp = ("schedule.stages=[{at: 0}, {at: 1024 tokens, batch_tokens: 128, lr: 0.35}, "
            "{at: 0.2, batch_tokens: 256, lr: 0.6}, {at: 0.4, batch_tokens: 512}]")
    on = ("model.n_layer=4", *ALL_ON[:-1], "optim.warmdown_steps=4", ramp)
    rows, a, b = whole_and_resumed(tmp_path, on, [62.5, 15.625, 31.25, 62.5])
    assert rows[0]["stages"] == rows[2]["stages"] and len(rows[0]["stages"].split()) == 4  # every stage entered
    assert a["step"] == b["step"] > 7
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    for opt_a, opt_b in zip(a["optimizers"], b["optimizers"]):
        assert [g["params"] for g in opt_a["param_groups"]] == [g["params"] for g in opt_b["param_groups"]]
        for index, state in opt_a["state"].items():
            for key, value in state.items():
                assert torch.equal(value, opt_b["state"][index][key]), (index, key)
    assert sum("normuon_buffer" in s for s in a["optimizers"][0]["state"].values()) == 4 * 5  # every block matrix
    assert len(a["optimizers"][0]["param_groups"]) == 2


@pytest.mark.xla
def test_every_key_on_xla_compiles_the_same_graphs(tmp_path, builtin_1024):
    """The LR (a stage's factor, the warm-down's levels: 1,000 over the whole budget, so they change during the
    run) is graph data, NorMuon and the mask fixed operations: a run with every key on compiles the graphs of one
    without, however many steps."""
    items = ("model.n_layer=4", *ALL_ON[:-2], "optim.warmdown=1", "optim.warmdown_steps=1000",
             "schedule.stages=[{at: 0, lr: 0.35}]", "run.log_every=2")
    run(smoke_args(tmp_path, "device.type=xla", *items, "budget.max_steps=8"))
    row, = ledger.read(tmp_path / "ledger.csv")
    assert int(row["xla_compiles"]) == XLA_GRAPHS  # cumulative over the 8 steps, so over any shorter run too


# -- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (["optim.normuon_beta2=1"], "optim.normuon_beta2: expected in [0, 1) (0 = off), got 1.0"),
    (["optim.normuon_beta2=-0.1"], "optim.normuon_beta2: expected in [0, 1) (0 = off), got -0.1"),
    (["optim.muon_wd_cautious=sometimes"], "optim.muon_wd_cautious: expected bool, got 'sometimes'"),
    (["optim.mlp_proj_lr=0"], "optim.mlp_proj_lr: expected > 0, got 0.0"),
    (["optim.head_wd=-0.5"], "optim.head_wd: expected -1 (= optim.weight_decay) or >= 0, got -0.5"),
    (["optim.head_wd=0.01"], "optim.head_wd: the head is the embedding table with model.tie_embeddings=true (its decay "
                             "is optim.weight_decay); expected -1, got 0.01"),
    (["optim.warmdown_steps=-1"], "optim.warmdown_steps: expected >= 0, got -1"),
    (["optim.warmup=0.1", "optim.warmup_steps=20"], "optim.warmup_steps=20 and optim.warmup=0.1: one ramp, in steps "
                                                    "or in a fraction of the budget; expected one of them 0"),
    (["optim.muon_momentum_warmup=0.5", "optim.muon_momentum_warmup_steps=300"],
     "optim.muon_momentum_warmup_steps=300 and optim.muon_momentum_warmup=0.5: one ramp"),
    (["optim.warmup_steps=-2"], "optim.warmup_steps: expected >= 0, got -2"),
    (["optim.warmdown_steps=2.5"], "optim.warmdown_steps: expected int, got 2.5"),
    (["optim.warmdown=0", "optim.warmdown_steps=19"], "optim.warmdown_steps: cuts the warm-down into steps, so it needs "
                                                      "optim.warmdown > 0, got 19 steps and optim.warmdown 0.0"),
    (["schedule.stages=[{at: 0}, {at: 0.5, lr: 0}]"], "schedule.stages[1].lr: expected > 0"),
    (["schedule.stages=[{at: 0, lr: fast}]"], "schedule.stages[0].lr: expected float, got 'fast'"),
    (["schedule.stages=[{at: 0}, {at: 0.5}, {at: 2048 tokens}]"], "schedule.stages[2].at: expected increasing token "
                                                                  "counts, after 0, before any stage switched by time"),
    (["schedule.stages=[{at: 0}, {at: 2048 tokens, attn_scale: 0.5}, {at: 0.5, attn_scale: 1.0}]"],
     "schedule.stages[2].attn_scale, mlp_scale: they move linearly between two stages switched alike"),
])
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        cfg_with(*overrides)
    assert message in str(e.value)
