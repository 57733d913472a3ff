"""The competition lineage's model levers (FrontierForge K82s4, recipes/K82s4/train.py): the LeakyReLU slope
(model.leaky_slope), a fixed query gain (model.qk_gain_learned=false), the key offset on slow rotary pairs
(model.key_offset) and attention-source reuse (model.attn_source_after, model.attn_source_layers). Each off is the
model as before; each on computes its formula, stays causal (alone, together, routed, within documents), is counted,
is optimised once, and survives checkpoints and load_for_eval, whose rows may be longer than the training ones."""
import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import clock
import config
import ledger
import optim
import train
from config import ConfigError, load_config
from kernels.reference import rms_norm
from model import active_params, flops_per_token, param_count, slow_pairs
from test_backends import XLA_GRAPHS, run, smoke_args
from test_newer_records import build, cfg_with, tokens

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"
BOS = 1  # the built-in tokenizer's
# Each lever on, at a 4-layer smoke shape: head dimension 16, 8 rotary pairs, base 1e4, rows of 64 tokens, so
# pair i turns 63 * 1e4^(-i/8) over a row: pairs 5, 6, 7 (0.199, 0.063, 0.020 rad) turn less than 0.3.
LEVERS = {"slope": ("model.mlp=leaky_relu2", "model.leaky_slope=0.35"),
          "gain": ("model.qk_gain_learned=false", "model.qk_gain_init=1.44"),
          "key_offset": ("model.key_offset=0.3",),
          "attn_source": ("model.attn_source_after=1", "model.attn_source_layers=[2,3]")}
ALL_ON = sum(LEVERS.values(), ())
SLOW = [5, 6, 7, 13, 14, 15]  # their key dimensions: pair i is dimensions i and i + 8
EXTRAS = ("model.value_embed=true", "model.bigram_buckets=64", "model.x0_shortcut=true")
KEYS = ("model.leaky_slope", "model.qk_gain_learned", "model.key_offset", "model.attn_source_after",
        "model.attn_source_layers")


def attention_by_hand(attn, x, slow=(), doc=None):
    """The attention's per-head output (before its projection) written out: QK-norm, rotary on AION's half-split
    pairs, the query gain, the key offset (dimensions `slow` of key t are key t-1's, except at position 0 and at a
    document's first token), causal softmax attention with the kv heads shared. x (B, T, C) -> (B, T, C)."""
    B, T, C = x.shape
    H, K, D = attn.n_head, attn.n_kv_head, attn.head_dim
    q = F.linear(x, attn.c_q.weight).view(B, T, H, D).transpose(1, 2)
    k, v = F.linear(x, attn.c_kv.weight).view(B, T, 2, K, D).permute(2, 0, 3, 1, 4)
    angle = torch.arange(T, dtype=torch.float32)[:, None] / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    cos, sin = angle.cos(), angle.sin()

    def rope(u):
        u1, u2 = rms_norm(u).chunk(2, dim=-1)
        return torch.cat((u1 * cos + u2 * sin, u2 * cos - u1 * sin), dim=-1)
    q, k = rope(q) * attn.q_gain[None, :, None, None], rope(k)
    spliced = k.clone()
    for b in range(B):
        for t in range(1, T):
            if doc is None or doc[b, t] == doc[b, t - 1]:
                spliced[b, :, t, list(slow)] = k[b, :, t - 1, list(slow)]
    k, v = spliced.repeat_interleave(H // K, dim=1), v.repeat_interleave(H // K, dim=1)
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    if doc is not None:
        allowed = allowed & (doc[:, None, :, None] == doc[:, None, None, :])
    scores = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C)


def attention_output(attn, x, **kwargs):
    """The model's attention output with c_proj the identity: attention_by_hand's quantity."""
    with torch.no_grad():
        attn.c_proj.weight.copy_(torch.eye(x.size(-1)))
        return attn(x, **kwargs)


# -- off: the model as it was --------------------------------------------------------------------

def test_each_key_at_its_base_value_is_the_model_and_recipe_as_before():
    flat = config.flatten(dataclasses.asdict(load_config(SMOKE)))
    assert all(k in config.RECIPE_NEUTRAL and k not in config.RECIPE_IGNORED for k in KEYS)
    without = {k: v for k, v in flat.items() if k not in KEYS}
    assert config.recipe(flat, "data") == config.recipe(without, "data")  # earlier rows keep their recipe
    on = config.flatten(dataclasses.asdict(cfg_with(*ALL_ON)))
    for key in KEYS:
        assert config.recipe(on, "data") != config.recipe({**on, key: flat[key]}, "data"), key
    # The slope changes what a step learns, not what it computes; the others change the computation.
    stage = config.resolve_stages(cfg_with())[0]
    assert "model.leaky_slope" in clock.COST_IGNORED
    assert all(clock.stage_key(on, "d", stage) != clock.stage_key({**on, k: flat[k]}, "d", stage)
               for k in KEYS if k != "model.leaky_slope")
    # Off: a learned gain per block, no key offset, the slope 0.5, no source.
    plain = build(random=False)
    assert all(isinstance(b.attn.q_gain, torch.nn.Parameter) and b.attn.slow is None and b.mlp.slope == 0.5
               for b in plain.blocks)
    # On, no parameter, buffer or initial weight moves: the fixed gain is one parameter per block fewer, rebuilt.
    for name, lever in LEVERS.items():
        state, changed = plain.state_dict(), build(*lever, random=False).state_dict()
        gains = {n for n in state if n.endswith("q_gain")} if name == "gain" else set()
        assert list(changed) == [n for n in state if n not in gains], name
        assert all(torch.equal(changed[n], state[n]) for n in changed), name


def test_the_default_forward_is_the_blocks_as_before_to_the_bit():
    model = build()
    idx = tokens()
    with torch.no_grad():
        x = rms_norm(model.wte(idx))
        for block in model.blocks:
            x = x + block.attn(rms_norm(x))
            x = x + block.mlp(rms_norm(x))
        assert torch.equal(model.hidden(idx), rms_norm(x))
        attn, x = model.blocks[0].attn, torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(6))
        torch.testing.assert_close(attention_output(attn, x), attention_by_hand(attn, x), rtol=0, atol=2e-5)


# -- bad input -----------------------------------------------------------------------------------

LOOP = "schedule.stages=[{at: 0}, {at: 0.5, recur: 2, recur_span: [0, 1]}]"


@pytest.mark.parametrize("overrides, message", [
    (["model.leaky_slope=1"], "model.leaky_slope: expected in [0, 1), got 1.0"),
    (["model.leaky_slope=-0.1"], "model.leaky_slope: expected in [0, 1), got -0.1"),
    (["model.key_offset=-0.3"], "model.key_offset: expected >= 0, got -0.3"),
    (["model.key_offset=0.01"], "model.key_offset: a radius of 0.01 rad makes 0 of a head's 8 rotary pairs slow "
                                "(turning less than it over data.seq_len = 64 positions); expected some, not all"),
    (["model.key_offset=100"], "model.key_offset: a radius of 100.0 rad makes 8 of a head's 8 rotary pairs slow"),
    (["model.key_offset=0.3", "data.seq_len=2048", "optim.batch_tokens=8192"],
     "model.key_offset: a radius of 0.3 rad makes 0 of a head's 8 rotary pairs slow (turning less than it over "
     "data.seq_len = 2048 positions)"),
    (["model.qk_gain_learned=maybe"], "model.qk_gain_learned: expected bool, got 'maybe'"),
    (["model.attn_source_after=3", "model.attn_source_layers=[3]"],
     "model.attn_source_after: expected -1 (off) or a block 0..2 (model.n_layer - 2: later blocks read it), got 3"),
    (["model.attn_source_after=1"], "model.attn_source_after, model.attn_source_layers: expected both set (the source "
                                    "block and the later blocks that read it) or neither, got 1 and []"),
    (["model.attn_source_layers=[2]"], "expected both set (the source block and the later blocks that read it) or "
                                       "neither, got -1 and [2]"),
    (["model.attn_source_after=2", "model.attn_source_layers=[1]"],
     "model.attn_source_layers: expected distinct blocks after model.attn_source_after (2), in 3..3, got [1]"),
    (["model.attn_source_after=1", "model.attn_source_layers=[2,2]"], "expected distinct blocks after"),
    (["model.attn_source_after=1", "model.attn_source_layers=[4]"], "in 2..3, got [4]"),
    (["model.attn_source_after=1", "model.attn_source_layers=[true]"],
     "model.attn_source_layers: expected a list of integers, got (True,)"),
    (["model.attn_source_after=1", "model.attn_source_layers=[2]", "model.parallel_layers=1"],
     "model.attn_source_layers: attention-source reuse is defined for sequential blocks; expected "
     "model.parallel_layers=0, got 1"),
    (["model.attn_source_after=1", "model.attn_source_layers=[2,3]", "mod.granularity=token", "mod.layers=[1,3]"],
     "model.attn_source_layers: the readers [3] may not be Mixture-of-Depths layers (mod.layers)"),
    (["model.attn_source_after=1", "model.attn_source_layers=[2]", LOOP],
     "model.attn_source_layers: a loop (a schedule stage with recur > 1) is not defined with attention-source reuse"),
])
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        cfg_with(*overrides)
    assert message in str(e.value)


def test_routed_sources_and_unused_routing_keys_are_valid():
    cfg_with("model.attn_source_after=1", "model.attn_source_layers=[2]", "mod.granularity=token", "mod.layers=[1]")
    cfg_with("model.attn_source_after=1", "model.attn_source_layers=[2]", "mod.layers=[2]")  # granularity none
    cfg_with("model.key_offset=0.3", "model.doc_mask=true", "mod.granularity=token", "mod.layers=[3]", LOOP)


# -- what each lever computes ----------------------------------------------------------------------

def test_leaky_slope_sets_the_negative_branch_of_the_squared_activation():
    mlp = build("model.mlp=leaky_relu2", "model.leaky_slope=0.35").blocks[0].mlp
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        h = x @ mlp.c_fc.weight.T
        want = torch.where(h > 0, h * h, 0.1225 * h * h) @ mlp.c_proj.weight.T  # K82s4: a^2 h^2 below 0
        torch.testing.assert_close(mlp(x), want, rtol=1e-6, atol=1e-5)
        assert (h < 0).any() and (h > 0).any()
        mlp.slope = 0.5
        assert not torch.allclose(mlp(x), want, atol=1e-3)


def test_a_fixed_query_gain_is_the_constant_and_no_parameter():
    fixed, learned = build("model.qk_gain_learned=false", "model.qk_gain_init=1.44"), build("model.qk_gain_init=1.44")
    assert not any("q_gain" in n for n, _ in fixed.named_parameters())
    assert all(torch.equal(b.attn.q_gain, torch.full((4,), 1.44)) for b in fixed.blocks)
    assert param_count(learned) - param_count(fixed) == 4 * 4
    missing, unexpected = fixed.load_state_dict(learned.state_dict(), strict=False)
    assert missing == [] and sorted(unexpected) == sorted(f"blocks.{i}.attn.q_gain" for i in range(4))
    with torch.no_grad():
        for b in learned.blocks:
            b.attn.q_gain.fill_(1.44)
        idx = tokens()
        assert torch.equal(fixed(idx), learned(idx))  # the learned gain at 1.44 is the same model
        for b in learned.blocks:
            b.attn.q_gain.fill_(1.5)
        assert not torch.equal(fixed(idx), learned(idx))


def test_the_slow_pairs_are_the_lineages():
    """K82s4 (spec section 10): base 1e5, head dimension 256, rows of 1024, radius 0.3: pairs 91..127, 74 dimensions."""
    lineage = dataclasses.replace(cfg_with().model, n_embd=1024, n_head=4, rope_base=1e5, key_offset=0.3)
    assert slow_pairs(lineage, 1024).nonzero().flatten().tolist() == list(range(91, 128))
    assert slow_pairs(dataclasses.replace(lineage, key_offset=0.1), 1024).nonzero().flatten().tolist() == list(range(103, 128))
    attn = build("model.key_offset=0.3").blocks[0].attn
    assert attn.slow.nonzero().flatten().tolist() == SLOW
    assert "slow" not in attn.state_dict()  # rebuilt from the config, not saved
    # Partial RoPE: the pairs that do not turn (frequency 0) turn less than any radius.
    partial = build("model.key_offset=0.0001", "model.rope_fraction=0.5").blocks[0].attn
    assert partial.slow.nonzero().flatten().tolist() == [4, 5, 6, 7, 12, 13, 14, 15]


@pytest.mark.parametrize("documents", [False, True])
def test_key_offset_gives_the_slow_dimensions_of_the_previous_key(documents):
    attn = build("model.key_offset=0.3", "model.qk_gain_learned=false", "model.qk_gain_init=1.44").blocks[1].attn
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(6))
    doc = torch.tensor([[0] * 10 + [1] * 22, [0] * 20 + [1] * 5 + [2] * 7]) if documents else None
    got = attention_output(attn, x, doc=doc)
    torch.testing.assert_close(got, attention_by_hand(attn, x, SLOW, doc), rtol=0, atol=2e-5)
    assert not torch.allclose(got, attention_by_hand(attn, x, (), doc), atol=1e-3)


def hidden_by_hand(model, idx, source, readers):
    """GPT.hidden written out: the readers' attention reads the source block's normed output, times their norm scale."""
    x = rms_norm(model.wte(idx))
    values = None if model.value_embed is None else F.embedding(idx, model.value_embed)
    src = None
    for i in model.active:
        b = model.blocks[i]
        scale = 1 / math.sqrt(i + 1) if model.cfg.ln_scale else 1.0
        h = src if i in readers and src is not None else rms_norm(x)
        x = x + b.attn(h * scale, ve=values if i in model.ve_layers else None)
        x = x + b.mlp(rms_norm(x) * scale)
        if i == source:
            src = rms_norm(x)
    return rms_norm(x)


@pytest.mark.parametrize("extra", [(), ("model.ln_scale=true", "model.value_embed=true")])
def test_attention_source_readers_attend_from_the_source_output(extra):
    reuse = ("model.attn_source_after=0", "model.attn_source_layers=[1,3]")
    model = build(*reuse, *extra).eval()
    idx = tokens()
    with torch.no_grad():
        got = model.hidden(idx)
        torch.testing.assert_close(got, hidden_by_hand(model, idx, 0, (1, 3)), rtol=0, atol=1e-5)
        assert not torch.allclose(got, hidden_by_hand(model, idx, -1, ()), atol=1e-3)
        # Depth annealing: while the source is not active its readers read their own input.
        full = model.cfg.mlp_mult * model.cfg.n_embd
        model.set_active((1, 2, 3), full)
        torch.testing.assert_close(model.hidden(idx), hidden_by_hand(model, idx, -1, ()), rtol=0, atol=1e-5)
        model.set_active((0, 1), full)
        torch.testing.assert_close(model.hidden(idx), hidden_by_hand(model, idx, 0, (1, 3)), rtol=0, atol=1e-5)
    # Block 3's attention reads block 0's output, not the blocks between, and passes gradients back to it.
    model.set_active(range(4), full)
    out = []
    model.blocks[3].attn.register_forward_hook(lambda module, args, y: out.append(y))
    model.hidden(idx)
    g0, g2 = torch.autograd.grad(out[0].sum(), [model.blocks[0].mlp.c_fc.weight, model.blocks[2].mlp.c_fc.weight],
                                 allow_unused=True)
    assert g0.abs().sum() > 0 and g2 is None


# -- causality, documents, routing -------------------------------------------------------------------

CAUSAL_CASES = [*LEVERS.values(), ALL_ON, (*ALL_ON, *EXTRAS),
                (*ALL_ON, *EXTRAS, "model.ln_scale=true", "model.unet=true", "model.xsa_layers=2")]
ROUTINGS = [(), ("mod.granularity=token", "mod.layers=[1]"), ("mod.granularity=block", "mod.layers=[0,1]",
                                                               "mod.block_size=16"),
            ("mod.granularity=layer", "mod.layers=[1]"), ("mod.granularity=microbatch", "mod.layers=[1]")]


def assert_causal(model, idx):
    for t in (0, 15, 16, 22, 23, 40, 50):
        changed = idx.clone()
        changed[:, t + 1:] = torch.randint(2, 1024, (2, 63 - t), generator=torch.Generator().manual_seed(t))
        with torch.no_grad():
            a, b = model(idx), model(changed)
        assert torch.equal(a[:, :t + 1], b[:, :t + 1]), t
        assert not torch.equal(a[:, t + 1:], b[:, t + 1:]), t


@pytest.mark.parametrize("overrides", CAUSAL_CASES, ids=(*LEVERS, "all", "extras", "records"))
def test_no_logit_depends_on_a_later_token(overrides):
    assert_causal(build(*overrides).eval(), tokens())


@pytest.mark.parametrize("routing", ROUTINGS[1:], ids=lambda r: r[0].split("=")[1])
def test_routed_models_with_every_lever_stay_causal(routing):
    assert_causal(build(*ALL_ON, *EXTRAS, *routing).eval(), tokens())


@pytest.mark.parametrize("routing", [r for r in ROUTINGS if "mod.granularity=block" not in r],
                         ids=lambda r: r[0].split("=")[1] if r else "dense")
def test_with_document_masking_no_key_crosses_a_document(routing):
    items = (*ALL_ON, *EXTRAS, "model.doc_mask=true")
    model = build(*items, *routing).eval()
    idx = tokens()
    earlier = idx.clone()
    earlier[:, 1:23] = torch.randint(2, 1024, (2, 22), generator=torch.Generator().manual_seed(9))  # document 1
    earlier[:, 30] = 5  # and one token of document 2
    with torch.no_grad():
        a, b = model(idx), model(earlier)
    assert torch.equal(a[:, 41:], b[:, 41:])  # the third document sees neither, its first key included
    assert torch.equal(a[:, 23:30], b[:, 23:30])
    assert not torch.equal(a[:, 30:41], b[:, 30:41])
    unmasked = build(*[o for o in items if o != "model.doc_mask=true"], *routing).eval()
    with torch.no_grad():
        assert not torch.equal(unmasked(idx)[:, 41:], unmasked(earlier)[:, 41:])  # the test can fail


@pytest.mark.parametrize("granularity, size, documents", [("block", 16, False), ("token", 1, True)])
def test_routed_evaluation_offsets_keys_as_training_does(granularity, size, documents):
    """TileRouter.masked computes what gathered does for the kept tiles: the previous key of a kept tile's first
    token is the previous kept token's (in the gathered sequence it is), not the skipped token before it."""
    extra = ("model.doc_mask=true",) if documents else ()
    model = build("model.key_offset=0.3", *extra, f"mod.granularity={granularity}", "mod.layers=[1]",
                  f"mod.block_size={size}")
    router, block = model.routers["1"], model.blocks[1]
    x = torch.randn(2, 64, 64, generator=torch.Generator().manual_seed(7))
    n = 64 // size
    tiles = torch.stack([torch.arange(0, n, 2), torch.arange(1, n, 2)]) if size > 1 else \
        torch.stack([torch.randperm(n, generator=torch.Generator().manual_seed(s))[:n // 2].sort().values for s in (1, 2)])
    keep = torch.zeros(2, n, dtype=torch.bool).scatter(1, tiles, True)
    w = torch.rand(2, n, generator=torch.Generator().manual_seed(8))
    doc = (tokens(length=64) == BOS).cumsum(1) if documents else None
    with torch.no_grad():
        gathered = router.gathered(block, x, tiles, w, None, doc)
        masked = router.masked(block, x, keep, w, None, doc)
        torch.testing.assert_close(masked, gathered, rtol=1e-5, atol=1e-5)
        block.attn.slow = torch.zeros_like(block.attn.slow)
        assert not torch.allclose(router.gathered(block, x, tiles, w, None, doc), gathered, atol=1e-4)


# -- accounting, groups, state -------------------------------------------------------------------

def test_flops_and_active_parameters():
    m = cfg_with().model
    on = cfg_with(*ALL_ON).model
    assert flops_per_token(on, 64) == flops_per_token(dataclasses.replace(m, mlp="leaky_relu2"), 64)
    off, every = build(random=False), build(*ALL_ON, random=False)
    assert param_count(off) - param_count(every) == 4 * 4  # the query gains, one per head and block
    assert active_params(off) - active_params(every) == 4 * 4
    for name, lever in LEVERS.items():
        if name != "gain":
            assert param_count(build(*lever, random=False)) == param_count(off), name


def test_every_parameter_is_optimised_once_and_the_fixed_gain_by_none():
    c = cfg_with(*ALL_ON, *EXTRAS)
    model = build(*ALL_ON, *EXTRAS, random=False)
    matrices, adam = optim.param_groups(model, c.optim)
    grouped = [id(p) for p in matrices] + [id(p) for g in adam for p in g["params"]]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters())
    assert not {id(b.attn.q_gain) for b in model.blocks} & set(grouped)


def trainer(tmp_path, *extra):
    return train.Trainer(load_config(SMOKE, [f"data.path={ROOT / 'data' / 'builtin'}", f"run.out_dir={tmp_path / 'runs'}",
                                             f"ledger.path={tmp_path / 'ledger.csv'}", "model.n_layer=4",
                                             "run.profile_steps=0", *extra]))


def test_checkpoints_resume_to_the_bit_and_load_for_eval_rebuilds_every_lever(tmp_path, builtin_1024):
    common = (*ALL_ON, *EXTRAS, "optim.ema=0.8")
    whole, first, resumed = tmp_path / "whole.pt", tmp_path / "first.pt", tmp_path / "resumed.pt"
    t = trainer(tmp_path, *common, "budget.max_steps=4", f"checkpoint.path={whole}")
    t.train()
    assert all(torch.equal(b.attn.q_gain, torch.full((4,), 1.44)) for b in t.model.blocks)  # not optimised
    trainer(tmp_path, *common, "budget.max_steps=2", f"checkpoint.path={first}").train()
    trainer(tmp_path, *common, "budget.max_steps=4", f"checkpoint.resume={first}", f"checkpoint.path={resumed}").train()
    a, b = train.load_checkpoint(whole), train.load_checkpoint(resumed)
    assert not any("q_gain" in n or "slow" in n for n in a["model"])
    for name in a["model"]:  # the average and the weights: the resumed run is the same run
        assert torch.equal(a["model"][name], b["model"][name]), name
        assert torch.equal(a["trained"][name], b["trained"][name]), name
    rows = ledger.read(tmp_path / "ledger.csv")
    assert rows[0]["val_bpb"] == rows[2]["val_bpb"] != "" and rows[0]["status"] == "ok"
    scored = train.load_for_eval(whole, "cpu")
    for i, block in enumerate(scored.blocks):
        assert torch.equal(block.attn.q_gain, torch.full((4,), 1.44)) and block.mlp.slope == 0.35
        assert block.attn.slow.nonzero().flatten().tolist() == SLOW
    assert (scored.cfg.attn_source_after, scored.cfg.attn_source_layers) == (1, (2, 3))
    for name, p in scored.named_parameters():
        assert torch.equal(p, a["model"][name]), name
    t.model.load_state_dict(a["model"])  # the training model with the saved weights computes what scored does
    idx = tokens()
    with torch.no_grad():
        assert torch.equal(scored(idx), t.model.eval()(idx))


def test_longer_evaluation_rows_splice_the_channels_training_used(tmp_path, builtin_1024):
    """Trained on rows of 256 (pairs 6, 7 turn less than 0.3 rad over them), scored on the kit's rows of 2048 (over
    which none would): the same dimensions, by the formula."""
    t = trainer(tmp_path, "model.key_offset=0.3", "data.seq_len=256", "optim.batch_tokens=1024", "budget.max_steps=2",
                f"checkpoint.path={tmp_path / 'c.pt'}")
    t.train()
    scored = train.load_for_eval(tmp_path / "c.pt", "cpu")
    assert slow_pairs(scored.cfg, 2048).sum() == 0
    for block in scored.blocks:
        assert block.attn.slow.nonzero().flatten().tolist() == [6, 7, 14, 15]
    attn = scored.blocks[2].attn
    x = torch.randn(1, 2048, 64, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(attention_output(attn, x), attention_by_hand(attn, x, [6, 7, 14, 15]), rtol=0, atol=2e-5)


@pytest.mark.xla
def test_every_lever_on_xla_compiles_the_same_graphs(tmp_path, builtin_1024):
    items = ("model.n_layer=4", *ALL_ON, *EXTRAS, "model.doc_mask=true", "run.log_every=2")
    run(smoke_args(tmp_path, "device.type=xla", *items, "budget.max_steps=8"))
    run(smoke_args(tmp_path, *items, "budget.max_steps=8"))
    long, eager = ledger.read(tmp_path / "ledger.csv")
    assert int(long["xla_compiles"]) == XLA_GRAPHS  # cumulative over the 8 steps, so over any shorter run too
    assert float(long["val_bpb"]) == pytest.approx(float(eager["val_bpb"]), rel=1e-3)
    assert (long["val_tokens"], long["val_bytes"]) == (eager["val_tokens"], eager["val_bytes"])
