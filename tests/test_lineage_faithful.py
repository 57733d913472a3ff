"""What AION's copy of the lineage's recipe (FrontierForge K82s4, recipes/K82s4/train.py) did not express, as keys:
the value embedding of the first and last layer (model.value_embed_ends), the x0 scalars', the head's and the MLP
input's init (model.x0_init, model.head_init_std, model.mlp_in_init), per-group AdamW betas (optim.embed_betas,
head_betas, scalar_betas), the MTP weights' discrete levels (optim.mtp_levels) and Newton-Schulz in bfloat16
(optim.muon_bf16). Each at its base value is the model, optimizer and recipe as before; each on is its formula."""
import dataclasses
import math
import re

import pytest
import torch

import clock
import config
import optim
from config import ConfigError, load_config
from test_lineage_model import SMOKE, assert_causal
from test_lineage_optim import whole_and_resumed
from test_newer_records import build, cfg_with, tokens

VE = ("model.value_embed=true", "model.value_embed_ends=true")
INIT = ("model.x0_shortcut=true", "model.x0_init=0.05", "model.tie_embeddings=false", "model.head_init_std=0.001",
        "model.mlp_in_init=0.4")
BETAS = ("model.tie_embeddings=false", "optim.embed_betas=[0.8,0.995]", "optim.head_betas=[0.8,0.96]",
         "optim.scalar_betas=[0.9,0.95]")
OPT = ("optim.mtp_weights=[0.5,0.25]", "optim.mtp_until=[0.45,0.2]", "optim.mtp_levels=4", "optim.muon_bf16=true")
ALL_ON = (*VE, *INIT, *BETAS[1:], *OPT)
KEYS = sorted({o.split("=")[0] for o in ALL_ON} - {"model.value_embed", "model.x0_shortcut", "model.tie_embeddings",
                                                  "optim.mtp_weights", "optim.mtp_until"})
LEARNING_ONLY = {"model.x0_init", "model.head_init_std", "model.mlp_in_init", "optim.embed_betas", "optim.head_betas",
                 "optim.scalar_betas", "optim.mtp_levels"}  # what a step learns, not what it computes


def test_each_key_at_its_base_value_is_the_recipe_and_stage_costs_as_before():
    assert len(KEYS) == 9 and all(k in config.RECIPE_NEUTRAL and k not in config.RECIPE_IGNORED for k in KEYS)
    flat = config.flatten(dataclasses.asdict(load_config(SMOKE)))
    without = {k: v for k, v in flat.items() if k not in KEYS}
    assert config.recipe(flat, "data") == config.recipe(without, "data")  # earlier rows keep their recipe
    on = config.flatten(dataclasses.asdict(cfg_with(*ALL_ON)))
    stage = config.resolve_stages(cfg_with(*ALL_ON))[0]
    for key in KEYS:
        off = {**on, key: flat[key]}
        assert config.recipe(on, "data") != config.recipe(off, "data"), key
        assert (clock.stage_key(on, "d", stage) == clock.stage_key(off, "d", stage)) == (key in LEARNING_ONLY), key
        assert (key in clock.COST_IGNORED) == (key in LEARNING_ONLY), key


def test_off_the_initial_model_is_as_before_and_each_init_key_moves_only_its_weights():
    extras = ("model.x0_shortcut=true", "model.tie_embeddings=false", "model.value_embed=true")
    plain = build(*extras, random=False).state_dict()
    assert all(torch.equal(plain[f"blocks.{i}.x0_mix"], torch.tensor([1.0, 0.0])) for i in range(4))
    assert not plain["lm_head.weight"].any()
    x0 = build(*extras, "model.x0_init=0.05", random=False).state_dict()
    assert all(torch.equal(x0[n], torch.tensor([1.0, 0.05]) if n.endswith("x0_mix") else plain[n]) for n in plain)
    mlp = build(*extras, "model.mlp_in_init=0.4", random=False).state_dict()
    for n in plain:  # the same draws, the MLP inputs' scaled
        if n.endswith("mlp.c_fc.weight"):
            torch.testing.assert_close(mlp[n], 0.4 * plain[n], rtol=1e-6, atol=0)
        else:
            assert torch.equal(mlp[n], plain[n]), n
    head = build(*extras, "model.head_init_std=0.001", random=False).state_dict()
    assert abs(head["lm_head.weight"].std().item() - 0.001) < 2e-5 and abs(head["lm_head.weight"].mean()) < 2e-5
    assert all(torch.equal(head[n], plain[n]) for n in plain if n != "lm_head.weight")


def test_value_embed_ends_is_one_wide_table_on_the_first_and_last_layer():
    model = build(*VE, random=False)
    assert model.ve_layers == {0, 3} and model.value_embed.shape == (1024, 64)  # n_embd wide, not kv-wide (32)
    assert abs(model.value_embed.std().item() - 1.0) < 0.01  # K82s4: N(0, 1); AION's own: model.embed_init_std
    ve = [b.attn for b in model.blocks if b.attn.ve_ends]
    assert len(ve) == 2 and all(a.ve_gate.item() == a.ve_keep.item() == 0.5 for a in ve)
    assert not hasattr(model.blocks[1].attn, "ve_gate") and not model.blocks[1].attn.ve_ends
    c = cfg_with(*VE)
    matrices, adam = optim.param_groups(model, c.optim)
    grouped = [id(p) for p in matrices] + [id(p) for g in adam for p in g["params"]]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters())  # each optimised once
    assert id(model.value_embed) in [id(p) for p in adam[0]["params"]]  # with the embedding, as K82s4's


def test_value_embed_ends_mixes_a_value_per_query_head_by_hand():
    model = build(*VE)
    attn = model.blocks[0].attn
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(3))
    ve = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        attn.c_proj.weight.copy_(torch.eye(64))
        got = attn(x, ve=ve)
        B, T, H, K, D = 2, 16, 4, 2, 16
        q = attn.c_q(x).view(B, T, H, D).transpose(1, 2)
        k, v = attn.c_kv(x).view(B, T, 2, K, D).permute(2, 0, 3, 1, 4)
        cos, sin = attn.rotary(q, None)
        q, k = attn.kernels.qk_norm_rope(q, cos, sin, attn.q_gain), attn.kernels.qk_norm_rope(k, cos, sin)
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        v = attn.ve_keep * v + attn.ve_gate * ve.view(B, T, H, D).transpose(1, 2)  # head h: its own D of the table
        scores = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(),
                                                                      float("-inf"))
        expected = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, 64)
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize("extra", [(), ("model.xsa_layers=2", "model.key_offset=0.3"), ("model.doc_mask=true",)],
                         ids=["plain", "xsa_key_offset", "documents"])
def test_value_embed_ends_stays_causal(extra):
    assert_causal(build(*VE, *extra).eval(), tokens())


def test_per_group_betas_reach_adamw_and_default_to_beta1_beta2():
    c = cfg_with(*BETAS)
    _, adam = optim.make_optimizers(build(*BETAS, random=False), c.optim, {})
    assert [g["betas"] for g in adam.param_groups] == [(0.8, 0.995), (0.9, 0.95), (0.8, 0.96)]  # tables, vectors, head
    _, plain = optim.make_optimizers(build("model.tie_embeddings=false", random=False), cfg_with().optim, {})
    assert [g["betas"] for g in plain.param_groups] == [(0.9, 0.95)] * 3


def test_mtp_levels_are_k82s4s_table():
    o = cfg_with(*OPT).optim
    n, (w2, w3) = 4, o.mtp_weights
    table = [(w2, w3 * (1 - (j + 0.5) / n)) for j in range(n)] + [(w2 * (1 - (j + 0.5) / n), 0.0) for j in range(n)]
    for p in (0.0, 0.01, 0.049, 0.05, 0.1, 0.1999, 0.2, 0.26, 0.3, 0.4499):  # its mtp_stage_of, by hand
        stage = (n + min(n - 1, int((p - 0.2) / 0.25 * n))) if p >= 0.2 else min(n - 1, int(p / 0.2 * n))
        assert optim.mtp_weights(p, o) == pytest.approx(list(table[stage])), p
    assert optim.mtp_weights(0.45, o) == optim.mtp_weights(1.0, o) == [0.0, 0.0]
    assert optim.mtp_weights(0.0, o)[1] == 0.21875 and optim.mtp_weights(-0.01, o) == optim.mtp_weights(0.0, o)


def test_muon_bf16_orthogonalises_in_bfloat16():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(32, 64))
    w.grad = torch.randn(32, 64)
    start = w.detach().clone()
    muon = optim.Muon([w], lr=0.1, momentum=0.0, ns_steps=5, ns_dtype=torch.bfloat16)
    muon.step()
    batch = w.grad[None]  # Muon orthogonalises same-shape matrices as one batch
    expected = start.add(optim.newton_schulz(batch, 5, torch.bfloat16)[0], alpha=-0.1)
    assert torch.equal(w.detach(), expected)
    assert not torch.equal(optim.newton_schulz(batch, 5, torch.bfloat16), optim.newton_schulz(batch, 5))
    muons = optim.make_optimizers(build(random=False), cfg_with("optim.muon_bf16=true").optim, {})[0]
    assert all(g["ns_dtype"] is torch.bfloat16 for g in muons.param_groups)


@pytest.mark.parametrize("overrides, message", [
    (("model.value_embed_ends=true",), "model.value_embed_ends=True: changes model.value_embed, so it needs"),
    (("model.x0_init=0.05",), "model.x0_init=0.05: changes model.x0_shortcut, so it needs model.x0_shortcut=true"),
    (("model.head_init_std=0.001",), "model.head_init_std=0.001: the untied head's"),
    (("optim.head_betas=[0.8,0.96]",), "optim.head_betas=[0.8, 0.96], model.head_init_std=0.0: the untied head's"),
    (("optim.embed_betas=[0.8]",), "optim.embed_betas: expected [] (= [optim.beta1, optim.beta2]) or two numbers"),
    (("optim.scalar_betas=[0.9,1.0]",), "optim.scalar_betas: expected [] (= [optim.beta1, optim.beta2]) or two"),
    (("optim.mtp_levels=-1",), "optim.mtp_levels: expected >= 0"),
    (("model.mlp_in_init=0",), "model.mlp_in_init: expected > 0"),
    (("model.x0_shortcut=true", "model.x0_init=0.05", "schedule.stages=[{at: 0, depth: 2}, {at: 0.5, depth: 4}]"),
     "depth: a block entering with model.x0_init=0.05 adds x0 and changes the function"),
])
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        cfg_with(*overrides)


def test_resume_with_every_key_on_is_the_uninterrupted_run(tmp_path, builtin_1024):
    """Calibrated clock (the steps and their progress fixed), the MTP levels stepping inside the run: the per-group
    AdamW state, the value embedding's scalars and the weights through the checkpoint, and load_for_eval's score."""
    _, a, b = whole_and_resumed(tmp_path, ("model.n_layer=4", *ALL_ON), [62.5])
    assert a["step"] == b["step"] == 17  # the first (compile) step uncharged, then 1 s of 62.5 ms steps
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    adam = [[g["betas"] for g in o["optimizers"][1]["param_groups"]] for o in (a, b)]
    assert adam[0] == adam[1] == [(0.8, 0.995), (0.9, 0.95), (0.8, 0.96)]
    for opt_a, opt_b in zip(a["optimizers"], b["optimizers"]):
        for index, state in opt_a["state"].items():
            for key, value in state.items():
                assert torch.equal(value, opt_b["state"][index][key]), (index, key)
