"""The parameter-golf records' items of April 2026 as model and optim keys: attention within
documents (model.doc_mask), SmearGate, attention-output gates, partial RoPE, layer-scaled norms,
sigmoid skip gates, XSA, the two-lane parallel decoder, and Muon's Polar-Express coefficients, row
normalisation and weight decay. Each off is the model and optimizer as before; each on computes its
formula, stays causal, keeps documents apart where asked, is counted, and survives checkpoints,
the EMA and copy growth."""
import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import config
import ledger
import optim
import sweep
import train
from config import ConfigError, load_config
from kernels.reference import rms_norm
from model import GPT, active_params, flops_per_token, param_count
from test_backends import XLA_GRAPHS, note, run, smoke_args

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"
BOS = 1  # the built-in tokenizer's (data.py trains it with bos_id=1)
# Every new item on, at a 4-layer smoke shape (head dimension 16).
ALL_ON = ("model.doc_mask=true", "model.smear_gate=true", "model.gate_window=8", "model.attn_gate=sparse",
          "model.attn_gate_scale=0.5", "model.rope_fraction=0.25", "model.ln_scale=true", "model.unet=true",
          "model.skip_gates=true", "model.xsa_layers=4", "model.parallel_layers=2", "model.parallel_lanes=2",
          "optim.muon_ns=polar_express", "optim.muon_row_norm=true", "optim.muon_wd=0.095")
MODEL_ITEMS = [o for o in ALL_ON if o.startswith("model.")]


def cfg_with(*overrides):
    return load_config(SMOKE, ["model.n_layer=4", *overrides])


def build(*overrides, seed=0, random=True):
    """A model with every weight random (zero-initialised projections and gates would hide a branch)."""
    c = cfg_with(*overrides)
    torch.manual_seed(seed)
    model = GPT(c.model, c.mod, bos=BOS, seq_len=c.data.seq_len)
    if random:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(std=0.3)
    return model


def tokens(batch=2, length=64, seed=1, starts=(0, 23, 41)):
    """Random tokens (never BOS) with a BOS at each of `starts`: documents."""
    idx = torch.randint(2, 1024, (batch, length), generator=torch.Generator().manual_seed(seed))
    idx[:, list(starts)] = BOS
    return idx


# -- off: the model as it was --------------------------------------------------------------------

def test_each_key_at_its_base_value_is_the_model_and_recipe_as_before():
    flat = config.flatten(dataclasses.asdict(load_config(SMOKE)))
    keys = [o.split("=")[0] for o in ALL_ON]
    assert all(k in config.RECIPE_NEUTRAL and k not in config.RECIPE_IGNORED for k in keys)
    without = {k: v for k, v in flat.items() if k not in keys}
    assert config.recipe(flat, "data") == config.recipe(without, "data")  # earlier rows keep their recipe
    for override in ALL_ON:
        key, value = override.split("=")
        on = config.flatten(dataclasses.asdict(load_config(SMOKE, ["model.n_layer=4", "model.unet=true",
                                                                    "model.parallel_layers=2", override])))
        assert config.recipe(on, "data") != config.recipe({**on, key: flat[key]}, "data"), key
    # Off, no parameter, buffer or initial weight is added or moved, and the rotation is the full one.
    torch.manual_seed(0)
    plain = GPT(cfg_with().model)
    assert not hasattr(plain, "bos") and plain.smear_gate is None
    assert all(b.attn.gate is None and b.norm_scale is None and not b.attn.xsa for b in plain.blocks)
    head_dim = 16
    want = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    assert torch.equal(plain.blocks[0].attn.rotary.inv_freq, want)


# -- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (["model.gate_window=0"], "model.gate_window: expected 1..64 (model.n_embd), got 0"),
    (["model.gate_window=65"], "model.gate_window: expected 1..64 (model.n_embd), got 65"),
    (["model.rope_fraction=0"], "model.rope_fraction: expected in (0, 1], got 0.0"),
    (["model.rope_fraction=1.5"], "model.rope_fraction: expected in (0, 1], got 1.5"),
    (["model.rope_fraction=0.05"], "model.rope_fraction: 0.05 of a head's 16 dimensions rotates none of them"),
    (["model.attn_gate=full"], "model.attn_gate: expected one of none | dense | sparse, got 'full'"),
    (["model.attn_gate_scale=0"], "model.attn_gate_scale: expected > 0, got 0.0"),
    (["model.xsa_layers=5"], "model.xsa_layers: expected 0..4 (at most model.n_layer), got 5"),
    (["model.skip_gates=true"], "model.skip_gates: gates the U-net skips, so it needs model.unet=true"),
    (["model.parallel_lanes=3"], "model.parallel_lanes: expected 1 or 2, got 3"),
    (["model.parallel_lanes=2"], "model.parallel_lanes=2: the parallel decoder is the last model.parallel_layers"),
    (["model.parallel_layers=5", "model.parallel_lanes=2"], "model.parallel_layers: expected 0..4"),
    (["model.parallel_layers=2", "model.parallel_lanes=2", "mod.granularity=token", "mod.layers=[1]"],
     "model.parallel_lanes=2: two residual lanes are not routed"),
    (["model.parallel_layers=2", "model.parallel_lanes=2",
      "schedule.stages=[{at: 0}, {at: 0.5, recur: 2, recur_span: [0, 1]}]"],
     "recur: a loop is not defined with model.parallel_lanes=2"),
    (["model.doc_mask=true", "mod.granularity=block", "mod.layers=[1]", "mod.block_size=16"],
     "model.doc_mask: a routed tile can hold the end of one document and the start of the next"),
    (["mod.granularity=block", "mod.layers=[1]", "mod.block_size=16", "schedule.stages=[{at: 0}, {at: 0.5, doc_mask: true}]"],
     "model.doc_mask: a routed tile can hold the end of one document"),
    (["schedule.stages=[{at: 0}, {at: 0.5, xsa_layers: 9}]"], "xsa_layers: expected 0..4 (at most model.n_layer)"),
    (["optim.muon_ns=cubic"], "optim.muon_ns: expected one of quintic | polar_express, got 'cubic'"),
    (["optim.muon_wd=-0.1"], "optim.muon_wd: expected >= 0, got -0.1"),
])
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        cfg_with(*overrides)
    assert message in str(e.value)


def test_document_masking_without_a_bos_token_is_a_clear_error(tmp_path, builtin_1024, monkeypatch, capsys):
    table = train.data.ByteTable.__init__

    def without_bos(self, path):
        table(self, path)
        self.bos_id = -1
    monkeypatch.setattr(train.data.ByteTable, "__init__", without_bos)
    args = ["--config", str(SMOKE), f"data.path={ROOT / 'data' / 'builtin'}", f"ledger.path={tmp_path / 'l.csv'}",
            f"run.out_dir={tmp_path}"]
    assert train.main(args) == 0  # no item needs it
    for item in ("model.doc_mask=true", "model.smear_gate=true"):
        assert train.main([*args, item]) == 2
        assert "need a BOS token (it starts each document);" in capsys.readouterr().err


# -- causality and documents ---------------------------------------------------------------------

CAUSAL_CASES = [[item] for item in MODEL_ITEMS if item not in ("model.unet=true", "model.parallel_layers=2")] + [
    ["model.parallel_layers=2", "model.parallel_lanes=2"], ["model.attn_gate=dense"], MODEL_ITEMS,
    [*MODEL_ITEMS[:-2], "model.value_embed=true", "model.bigram_buckets=64", "model.x0_shortcut=true"]]


@pytest.mark.parametrize("overrides", CAUSAL_CASES, ids=lambda o: ",".join(x.split("=")[0][6:] for x in o))
def test_no_logit_depends_on_a_later_token(overrides):
    if "model.skip_gates=true" in overrides and "model.unet=true" not in overrides:
        overrides = [*overrides, "model.unet=true"]
    if "model.parallel_lanes=2" in overrides and "model.parallel_layers=2" not in overrides:
        overrides = [*overrides, "model.parallel_layers=2"]
    model = build(*overrides).eval()
    idx = tokens()
    for t in (0, 22, 23, 40, 50):
        changed = idx.clone()
        changed[:, t + 1:] = torch.randint(2, 1024, (2, 63 - t), generator=torch.Generator().manual_seed(t))
        with torch.no_grad():
            a, b = model(idx), model(changed)
        assert torch.equal(a[:, :t + 1], b[:, :t + 1]), t
        assert not torch.equal(a[:, t + 1:], b[:, t + 1:]), t


ROUTINGS = [(), ("mod.granularity=token", "mod.layers=[1,3]"), ("mod.granularity=layer", "mod.layers=[1]"),
            ("mod.granularity=microbatch", "mod.layers=[2]")]


@pytest.mark.parametrize("routing", ROUTINGS, ids=lambda r: r[0].split("=")[1] if r else "dense")
@pytest.mark.parametrize("items", [["model.doc_mask=true"], [o for o in MODEL_ITEMS if "lanes" not in o]
                                   + ["model.value_embed=true", "model.bigram_buckets=64", "model.x0_shortcut=true"]],
                         ids=("doc_mask", "all"))
def test_with_document_masking_no_logit_depends_on_an_earlier_document(routing, items):
    model = build(*items, *routing).eval()
    idx = tokens()
    earlier = idx.clone()
    earlier[:, 1:23] = torch.randint(2, 1024, (2, 22), generator=torch.Generator().manual_seed(9))  # document 1
    earlier[:, 30] = 5  # and one token of document 2, the one position 41's document follows
    with torch.no_grad():
        a, b = model(idx), model(earlier)
    assert torch.equal(a[:, 41:], b[:, 41:])  # the third document sees neither
    assert torch.equal(a[:, 23:30], b[:, 23:30])  # the second sees its own tokens only
    assert not torch.equal(a[:, 30:41], b[:, 30:41])
    unmasked = build(*[o for o in items if o != "model.doc_mask=true"], *routing).eval()
    with torch.no_grad():
        assert not torch.equal(unmasked(idx)[:, 41:], unmasked(earlier)[:, 41:])  # the test can fail


def test_a_stage_switches_document_masking_and_xsa_and_each_has_its_cost_key():
    c = cfg_with("schedule.stages=[{at: 0}, {at: 0.5, doc_mask: true, xsa_layers: 2}]")
    first, second = config.resolve_stages(c)
    assert (first.doc_mask, first.xsa_layers, second.doc_mask, second.xsa_layers) == (False, 0, True, 2)
    model = GPT(c.model, bos=BOS)
    flat = config.flatten(dataclasses.asdict(c))
    keys = [train.clock.stage_key(flat, "data", s) for s in (first, second)]
    assert keys[0] != keys[1]
    assert keys[0] == train.clock.stage_key(config.flatten(dataclasses.asdict(cfg_with())), "data", config.resolve_stages(cfg_with())[0])
    for stage, xsa in ((first, ()), (second, (2, 3))):
        train.set_stage(model, c, stage)
        assert model.doc_mask == stage.doc_mask and tuple(i for i, b in enumerate(model.blocks) if b.attn.xsa) == xsa


# -- what each item computes ---------------------------------------------------------------------

def test_smear_gate_mixes_in_the_previous_embedding_except_at_bos():
    model = build("model.smear_gate=true", "model.gate_window=8")
    idx = tokens()
    starts = idx == BOS
    with torch.no_grad():
        e, smeared = model.wte(idx), model.embed(idx, starts)
        gate = model.smear_lambda * torch.sigmoid(e[..., :8] @ model.smear_gate)  # (B, T)
        want = e.clone()
        want[:, 1:] += gate[:, 1:, None] * e[:, :-1]
        want[starts] = e[starts]  # a document's first token takes nothing from the one before it
    assert torch.equal(smeared[starts], e[starts]) and starts[:, 1:].any()
    torch.testing.assert_close(smeared, want, rtol=0, atol=1e-6)
    assert not torch.equal(smeared[:, 1:23], e[:, 1:23])
    fresh = build("model.smear_gate=true", random=False)  # w and lambda 0: enters as nothing
    assert torch.equal(fresh.embed(idx, starts), fresh.wte(idx))


def attention_output(attn, x, **kwargs):
    """The attention's per-head output before its projection: (B, T, C) with c_proj the identity."""
    with torch.no_grad():
        attn.c_proj.weight.copy_(torch.eye(x.size(-1)))
        return attn(x, **kwargs)


@pytest.mark.parametrize("kind, width", [("dense", 64), ("sparse", 8)])
def test_attention_gate_scales_each_head_by_a_sigmoid_of_the_input(kind, width):
    attn = build(f"model.attn_gate={kind}", "model.gate_window=8", "model.attn_gate_scale=0.5").blocks[0].attn
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(2))
    gated = attention_output(attn, x)
    gate, attn.gate = attn.gate, None
    plain = attention_output(attn, x)
    g = torch.sigmoid(0.5 * x[..., :width] @ gate.T)  # (B, T, H)
    torch.testing.assert_close(gated, (plain.view(2, 16, 4, 16) * g[..., None]).view(2, 16, 64), rtol=0, atol=1e-6)
    assert gate.shape == (4, width)
    fresh = build(f"model.attn_gate={kind}", "model.gate_window=8", random=False).blocks[0].attn
    assert torch.equal(fresh.gate, torch.zeros(4, width))  # every gate sigmoid(0) = 0.5 at the start


def test_xsa_removes_each_outputs_component_along_its_own_value():
    attn = build("model.xsa_layers=1").blocks[3].attn
    assert attn.xsa
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(2))
    y = attention_output(attn, x).view(2, 16, 4, 16)  # (B, T, H, D); heads 0, 1 share kv head 0
    v = F.linear(x, attn.c_kv.weight).view(2, 16, 2, 2, 16)[:, :, 1]  # (B, T, K, D)
    along = (y * v.repeat_interleave(2, dim=2)).sum(-1)
    torch.testing.assert_close(along, torch.zeros_like(along), rtol=0, atol=1e-4)
    attn.xsa = False
    assert not torch.allclose((attention_output(attn, x).view(2, 16, 4, 16) * v.repeat_interleave(2, 2)).sum(-1),
                              torch.zeros_like(along), atol=1e-3)


def test_partial_rope_leaves_the_unrotated_dimensions_without_position():
    attn = build("model.rope_fraction=0.25").blocks[0].attn  # head dim 16: 4 rotate, 2 of 8 pairs
    q = torch.randn(1, 4, 32, 16, generator=torch.Generator().manual_seed(3))
    cos, sin = attn.rotary(q)
    assert torch.equal(cos[:, 2:], torch.ones(32, 6)) and torch.equal(sin[:, 2:], torch.zeros(32, 6))
    same = q[:, :, :1].expand(-1, -1, 32, -1)  # one vector at every position
    out = attn.kernels.qk_norm_rope(same, cos, sin)
    unrotated = [d for d in range(16) if d % 8 >= 2]
    assert torch.equal(out[..., unrotated], out[:, :, :1, unrotated].expand(-1, -1, 32, -1))
    assert not torch.equal(out[..., [0, 1, 8, 9]], out[:, :, :1, [0, 1, 8, 9]].expand(-1, -1, 32, -1))
    # The rotated pairs turn at the frequencies of a 4-dimensional head.
    assert torch.equal(attn.rotary.inv_freq[:2], 1.0 / (10000.0 ** (torch.arange(0, 4, 2, dtype=torch.float32) / 4)))


def test_ln_scale_scales_block_i_norms_by_one_over_sqrt_i_plus_one():
    model = build("model.ln_scale=true")
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(4))
    for i, block in enumerate(model.blocks):
        assert torch.equal(block.norm(x), rms_norm(x) * (1 / math.sqrt(i + 1)))


def test_skip_gates_lerp_between_the_skip_and_the_stream():
    model = build("model.unet=true", "model.skip_gates=true")
    x, skip = (torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(s)) for s in (5, 6))
    block = model.blocks[3]  # the second half's last: the first skip saved, block 0's
    with torch.no_grad():
        got = model.block_input(block, 3, x, x, None, [skip])
        want = block.skip_weight * skip + torch.sigmoid(block.skip_gate) * (x - block.skip_weight * skip)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    fresh = build("model.unet=true", "model.skip_gates=true", random=False)
    assert torch.equal(fresh.blocks[3].skip_gate, torch.zeros(64))


def test_two_lane_decoder_by_hand():
    """With U-net skips too: the skip enters the attention lane only (as in the records)."""
    model = build("model.parallel_layers=2", "model.parallel_lanes=2", "model.unet=true").eval()
    idx = tokens()
    with torch.no_grad():
        x = rms_norm(model.wte(idx))
        outputs = []
        for i in (0, 1):
            x = model.blocks[i](x)
            outputs.append(x)
        lanes = (x, x)
        for i, skip in ((2, outputs[1]), (3, outputs[0])):  # the mirrored first-half outputs
            b = model.blocks[i]
            attn_lane = lanes[0] + b.skip_weight * skip
            a, m = b.attn(rms_norm(attn_lane)), b.mlp(rms_norm(lanes[1]))
            lanes = tuple(mix[0] * lane + mix[1] * a + mix[2] * m for mix, lane in zip(b.lane_mix, (attn_lane, lanes[1])))
        want = rms_norm(0.5 * (lanes[0] + lanes[1]))
        torch.testing.assert_close(model.hidden(idx), want, rtol=0, atol=1e-5)
    fresh = build("model.parallel_layers=2", "model.parallel_lanes=2", random=False)
    assert torch.equal(fresh.blocks[2].lane_mix, torch.tensor([[1.1, 1.0, 1.0]] * 2))


def test_polar_express_orthogonalises_with_its_own_triple_per_step():
    g = torch.randn(32, 64, generator=torch.Generator().manual_seed(7))
    polar, quintic = (optim.newton_schulz(g, 5, coefficients=c) for c in ("polar_express", "quintic"))
    s = torch.linalg.svdvals(polar)
    assert s.min() > 0.8 and s.max() < 1.2  # orthogonalised
    assert not torch.allclose(polar, quintic, atol=1e-3)
    x = g / g.norm()
    for a, b, c in optim.NS_COEFFICIENTS["polar_express"] + optim.NS_COEFFICIENTS["polar_express"][-1:]:
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    torch.testing.assert_close(optim.newton_schulz(g, 6, coefficients="polar_express"), x, rtol=0, atol=1e-6)


def test_muon_row_normalises_before_newton_schulz_and_decays_by_the_lr():
    torch.manual_seed(0)
    w0 = torch.randn(16, 32)
    grad = torch.randn(16, 32) * torch.arange(1, 17.0)[:, None]  # rows of very different norms
    results = {}
    for row_norm, wd in ((False, 0.0), (True, 0.0), (True, 0.1)):
        p = torch.nn.Parameter(w0.clone())
        p.grad = grad.clone()
        optim.Muon([p], lr=0.02, momentum=0.9, ns_steps=5, row_norm=row_norm, weight_decay=wd).step()
        results[row_norm, wd] = p.detach()
    nesterov = grad * 1.9  # the first step: the buffer is the gradient
    rows = nesterov / nesterov.norm(dim=1, keepdim=True)
    torch.testing.assert_close(results[True, 0.0], w0 - 0.02 * optim.newton_schulz(rows, 5), rtol=0, atol=1e-6)
    torch.testing.assert_close(results[False, 0.0], w0 - 0.02 * optim.newton_schulz(nesterov, 5), rtol=0, atol=1e-6)
    torch.testing.assert_close(results[True, 0.1], w0 * (1 - 0.02 * 0.1) - 0.02 * optim.newton_schulz(rows, 5),
                               rtol=0, atol=1e-6)


# -- accounting, groups, state -------------------------------------------------------------------

def test_flops_and_active_parameters_count_the_gates():
    m = cfg_with().model
    base = flops_per_token(m, 64)
    for changes, per_token in (({"attn_gate": "dense"}, 4 * 4 * 64), ({"attn_gate": "sparse", "gate_window": 8}, 4 * 4 * 8),
                               ({"smear_gate": True, "gate_window": 8}, 8)):
        assert flops_per_token(dataclasses.replace(m, **changes), 64) - base == 3 * 2 * per_token, changes
    off, on = build(random=False), build(*MODEL_ITEMS, random=False)
    added = param_count(on) - param_count(off)
    # Attention gates, SmearGate, skip weights and gates, lane mixes: every block has them (depth may grow).
    assert added == 4 * 4 * 8 + 8 + 1 + 4 * (1 + 64) + 4 * 2 * 3
    assert active_params(on) - active_params(off) == added


def test_every_new_parameter_is_optimised_once_and_none_by_muon():
    model = build(*MODEL_ITEMS, random=False)
    matrices, adam = optim.param_groups(model, cfg_with(*ALL_ON).optim)
    grouped = [id(p) for p in matrices] + [id(p) for g in adam for p in g["params"]]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters())
    new = [model.smear_gate, model.smear_lambda] + [p for b in model.blocks for p in (b.attn.gate, b.skip_gate)] + [
        b.lane_mix for b in model.blocks]
    assert {id(p) for p in new} <= {id(p) for p in adam[1]["params"]}  # the scalars' AdamW group
    # So are a loop's gates and its passes' routers (before, the gates were in no group: never updated).
    c = cfg_with("mod.granularity=token", "mod.layers=[]", "mod.recur=true", "schedule.recur_gate=true",
                 "schedule.stages=[{at: 0}, {at: 0.5, recur: 3, recur_span: [1, 2]}]")
    looped = GPT(c.model, c.mod, passes=3, recur_gate=True)
    matrices, adam = optim.param_groups(looped, c.optim)
    assert {id(p) for p in looped.recur_gates} <= {id(p) for p in adam[1]["params"]}
    assert sorted(id(p) for p in matrices + [p for g in adam for p in g["params"]]) == sorted(id(p) for p in looped.parameters())


def trainer(tmp_path, *extra):
    return train.Trainer(load_config(SMOKE, [f"data.path={ROOT / 'data' / 'builtin'}", f"run.out_dir={tmp_path / 'runs'}",
                                             f"ledger.path={tmp_path / 'ledger.csv'}", "model.n_layer=4", *extra]))


def test_checkpoints_resume_and_load_for_eval_rebuild_every_item(tmp_path, builtin_1024):
    common = (*ALL_ON, "optim.ema=0.8", "run.profile_steps=0")
    whole, first, resumed = tmp_path / "whole.pt", tmp_path / "first.pt", tmp_path / "resumed.pt"
    trainer(tmp_path, *common, "budget.max_steps=4", f"checkpoint.path={whole}").train()
    trainer(tmp_path, *common, "budget.max_steps=2", f"checkpoint.path={first}").train()
    trainer(tmp_path, *common, "budget.max_steps=4", f"checkpoint.resume={first}", f"checkpoint.path={resumed}").train()
    a, b = train.load_checkpoint(whole), train.load_checkpoint(resumed)
    assert int(a["model"]["bos"]) == BOS
    for name in a["model"]:  # the average and the weights, gates included: the resumed run is the same run
        assert torch.equal(a["model"][name], b["model"][name]), name
        assert torch.equal(a["trained"][name], b["trained"][name]), name
    assert any("lane_mix" in n and not torch.equal(a["trained"][n], torch.tensor([[1.1, 1.0, 1.0]] * 2)) for n in a["trained"])
    rows = ledger.read(tmp_path / "ledger.csv")
    assert rows[0]["val_bpb"] == rows[2]["val_bpb"] != "" and rows[0]["status"] == "ok"
    scored = train.load_for_eval(whole, "cpu")
    assert int(scored.bos) == BOS and scored.doc_mask and scored.blocks[3].attn.xsa
    for name, p in scored.named_parameters():
        assert torch.equal(p, a["model"][name]), name
    idx = tokens(length=64)
    with torch.no_grad():
        assert torch.isfinite(scored(idx)).all()


def test_copy_growth_and_the_ema_carry_the_gates(tmp_path, builtin_1024):
    t = trainer(tmp_path, *ALL_ON[:9], "optim.ema=0.9", "schedule.grow_init=copy",
                "schedule.stages=[{at: 0, depth: 2}, {at: 0.5, depth: 4}]")
    for _ in range(2):
        t.step(0.0)
        t.inputs = t.fetch()
    gate = {i: t.model.blocks[i].attn.gate.detach().clone() for i in range(4)}
    ema = {i: t.ema[t.model.blocks[i].skip_gate].clone() for i in range(4)}
    assert not torch.equal(gate[0], gate[2])
    t.enter_stage(1)
    assert torch.equal(t.model.blocks[2].attn.gate, gate[0]) and torch.equal(t.model.blocks[3].attn.gate, gate[1])
    assert torch.equal(t.ema[t.model.blocks[2].skip_gate], ema[0])
    t.loader.close()


def test_ablation_switches_each_item_off(tmp_path):
    path = tmp_path / "all.yaml"
    items = ", ".join(o.split(".", 1)[1].replace("=", ": ") for o in MODEL_ITEMS)
    path.write_text(f"base: {SMOKE}\nmodel: {{n_layer: 4, {items}}}\n"
                    "optim: {muon_ns: polar_express, muon_row_norm: true, muon_wd: 0.095}\n")
    variants = sweep.ablation(str(path), [1])["variants"]
    assert variants == {"full": [], "no-parallel": ["model.parallel_layers=0", "model.parallel_lanes=1"],
                        "one-lane": ["model.parallel_lanes=1"], "no-doc-mask": ["model.doc_mask=false"],
                        "no-smear-gate": ["model.smear_gate=false"], "no-attn-gate": ["model.attn_gate=none"],
                        "full-rope": ["model.rope_fraction=1"], "no-ln-scale": ["model.ln_scale=false"],
                        "no-skip-gates": ["model.skip_gates=false"], "no-xsa": ["model.xsa_layers=0"],
                        "quintic-ns": ["optim.muon_ns=quintic"], "no-row-norm": ["optim.muon_row_norm=false"],
                        "no-muon-wd": ["optim.muon_wd=0"]}
    for name, overrides in variants.items():  # each one a valid config
        load_config(path, overrides)


# -- static graphs, and the whole recipe on ---------------------------------------------------------

@pytest.mark.xla
def test_every_item_on_xla_compiles_the_same_graphs_whatever_the_tokens(tmp_path, builtin_1024, xla_level_2):
    """Each step's documents fall elsewhere; the mask is data, not a shape: no graph is added."""
    items = ("model.n_layer=4", *ALL_ON, "run.log_every=2")
    run(smoke_args(tmp_path, "device.type=xla", *items, "budget.max_steps=8"))
    run(smoke_args(tmp_path, *items, "budget.max_steps=8"))
    long, eager = ledger.read(tmp_path / "ledger.csv")
    # Cumulative over the 8 steps and the fewest a run compiles: none of them (a shorter run's among them) added one.
    assert int(long["xla_compiles"]) == XLA_GRAPHS
    # The same numbers as eager up to summation order: one forward agreed to 1e-6 of the logits' scale;
    # 8 steps of Polar-Express Newton-Schulz (coefficients up to 22) grew that to 1.1e-4 of val_bpb.
    assert float(long["val_bpb"]) == pytest.approx(float(eager["val_bpb"]), rel=1e-3)
    assert (long["val_tokens"], long["val_bytes"]) == (eager["val_tokens"], eager["val_bytes"])


def test_every_item_compiled_traces_one_train_and_one_eval_graph(tmp_path, builtin_1024):
    # Two layers, each item still on (a U-net pair, XSA on both, one parallel layer): the graphs are one a run
    # whatever the depth, and the cold compile took 73 CPU-s against 92 at four (the slow test compiles four).
    layers = ("model.n_layer=2", "model.xsa_layers=2", "model.parallel_layers=1")
    run(smoke_args(tmp_path, "device.compile=true", *ALL_ON, *layers, "budget.max_steps=8"))
    row, = ledger.read(tmp_path / "ledger.csv")
    assert note(row, "compiled_graphs") == "2"  # cumulative over the 8 steps, so over any shorter run too


# cpu_windows256.yaml (cpu.yaml before issue 48) with every item on, as the records run them (warm-down 85 % to an LR
# floor of 0.1, Adam beta2 0.99).
CPU_ALL_ON = (*[o for o in ALL_ON if o != "model.gate_window=8"], "optim.warmdown=0.85", "optim.lr_floor=0.1",
              "optim.beta2=0.99")


@pytest.mark.slow  # a full-size config compiled, on each backend (tests/README.md)
@pytest.mark.parametrize("backend", ["device.compile=true", pytest.param("device.type=xla", marks=pytest.mark.xla)])
def test_cpu_windows256_yaml_with_every_item_on_trains(tmp_path, builtin_1024, xla_level_2, backend):
    args = ["--config", str(ROOT / "configs" / "cpu_windows256.yaml"), *smoke_args(tmp_path)[2:], *CPU_ALL_ON, backend,
            "budget.max_steps=24", "run.log_every=8", "eval.every_seconds=0", "eval.tokens=16384", "eval.kit_tokens=16384",
            "checkpoint.every_seconds=0", "run.profile_steps=0"]
    out = run(args)
    row, = ledger.read(tmp_path / "ledger.csv")
    assert row["status"] == "ok" and row["steps"] == "24" and math.isfinite(float(row["val_bpb"]))
    assert math.isfinite(float(row["kit_val_bpb"]))  # on the competition's task: the kit's protocol too
    assert all(math.isfinite(float(line.split("loss:")[1].split()[0])) for line in out.splitlines() if " loss:" in line)
    if backend == "device.type=xla":
        assert int(row["xla_compiles"]) == XLA_GRAPHS + 2  # and the kit's protocol's two (kit.evaluate_bpb)
    else:
        assert note(row, "compiled_graphs") == "2"


def test_muon_batches_same_shape_matrices_and_updates_each_as_on_its_own():
    """A tall matrix joins its transpose's batch; each parameter's step equals its own Newton-Schulz."""
    g = torch.Generator().manual_seed(3)
    shapes = [(16, 64), (64, 16), (16, 16), (16, 64), (8, 16), (16, 16)]
    w0 = [torch.randn(s, generator=g) for s in shapes]
    grads = [torch.randn(s, generator=g) for s in shapes]
    params = [torch.nn.Parameter(w.clone()) for w in w0]
    for p, grad in zip(params, grads):
        p.grad = grad.clone()
    optim.Muon(params, lr=0.02, momentum=0.9, ns_steps=5, weight_decay=0.1).step()
    for p, w, grad in zip(params, w0, grads):
        scale = max(1.0, w.size(0) / w.size(1)) ** 0.5
        want = w * (1 - 0.02 * 0.1) - 0.02 * scale * optim.newton_schulz(grad * 1.9, 5)
        torch.testing.assert_close(p.detach(), want, rtol=0, atol=1e-6)
